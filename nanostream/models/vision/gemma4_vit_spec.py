"""Gemma 4's vision tower as a spec: its sizes from a ``Gemma4Config``, the grids it takes, the tokens an image becomes.

An image of (1, h, w) patches, h and w multiples of the pooling kernel k, becomes h*w / k² tokens: the Qwen rule,
with k as its merge size. See gemma4_vit.py for the tower.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from nanostream.errors import ModelLoadError
from nanostream.models.vision.qwen_vit_spec import VISION_ACTIVATIONS

_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")


@dataclasses.dataclass(frozen=True)
class Gemma4VisionSpec:
    """A Gemma 4 tower of ``num_hidden_layers`` layers of ``hidden_size`` over patches of ``patch_size`` pixels,
    pooled ``pooling_kernel_size`` x ``pooling_kernel_size`` into tokens of ``text_hidden_size``."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    patch_size: int
    pooling_kernel_size: int
    position_embedding_size: int
    text_hidden_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 100.0
    gelu_approximate: str = "tanh"
    use_clipped_linears: bool = False
    standardize: bool = False
    num_channels: int = 3

    @property
    def spatial_merge_size(self) -> int:
        """Patches a side that one token averages."""
        return self.pooling_kernel_size

    @property
    def patch_pixels(self) -> int:
        """Values of one patch row: patch x patch x channels."""
        return self.num_channels * self.patch_size**2

    def num_tokens(self, grid: Sequence[int]) -> int:
        """The tokens an image of ``grid`` (t, h, w) becomes: t*h*w / k²."""
        t, h, w = (int(v) for v in grid)
        return t * h * w // self.pooling_kernel_size**2

    def grid_error(self, grid: Sequence[int]) -> str | None:
        """Why the tower cannot take an image of ``grid`` (t, h, w), or None where it can."""
        t, h, w = (int(v) for v in grid)
        k, most = self.pooling_kernel_size, self.position_embedding_size
        if t == 1 and h > 0 and w > 0 and h % k == 0 and w % k == 0 and max(h, w) <= most:
            return None
        return (
            f"the patch grid {tuple(grid)} does not fit this vision tower: it takes one frame (t = 1) of h x w "
            f"patches, h and w positive multiples of {k} (the pooling kernel) and at most {most}, as the model's "
            "image processor resizes images"
        )

    def __post_init__(self) -> None:
        if self.head_dim % 4:
            raise ModelLoadError(f"vision head_dim {self.head_dim} is not a multiple of 4 (its 2-D rotary's halves)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"vision num_attention_heads {self.num_attention_heads} is not a multiple of num_key_value_heads "
                f"{self.num_key_value_heads}"
            )

    @classmethod
    def from_config(cls, config: Any) -> Gemma4VisionSpec:
        """The spec of a ``Gemma4Config`` (or config.json's dict): its vision_config and the text model's width."""
        cfg = config if isinstance(config, dict) else config.to_dict()
        vision, text = cfg["vision_config"], cfg["text_config"]
        act = vision.get("hidden_activation", "gelu_pytorch_tanh")
        if act not in VISION_ACTIVATIONS:
            raise ModelLoadError(
                f"vision hidden_activation {act!r} is not supported; use one of {sorted(VISION_ACTIVATIONS)}"
            )
        rope = vision.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ModelLoadError(f"vision rope_type {rope['rope_type']!r} is not supported; Gemma 4's is 'axial'")
        return cls(
            **{f: vision[f] for f in _SIZES},
            head_dim=vision.get("head_dim") or vision["hidden_size"] // vision["num_attention_heads"],
            patch_size=vision["patch_size"],
            pooling_kernel_size=vision.get("pooling_kernel_size", 3),
            position_embedding_size=vision.get("position_embedding_size", 10240),
            text_hidden_size=text["hidden_size"],
            rms_norm_eps=float(vision.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", 100.0)),
            gelu_approximate=VISION_ACTIVATIONS[act],
            use_clipped_linears=bool(vision.get("use_clipped_linears", False)),
            standardize=bool(vision.get("standardize", False)),
        )
