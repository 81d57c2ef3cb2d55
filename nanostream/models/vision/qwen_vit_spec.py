"""The shape of a Qwen vision transformer (Qwen3-VL's, Qwen3.5/3.6's), read from a transformers vision config.

One reader for both families: Qwen3.5's encoder is Qwen3-VL's without the DeepStack mergers, so a config
without ``deepstack_visual_indexes`` reads as an empty tuple. What the encoder cannot run exactly (Qwen2.5-VL's
windowed attention, another rope type or activation) is refused with ``ModelLoadError`` naming it::

    spec = QwenVisionSpec.from_config(AutoConfig.from_pretrained(path).vision_config)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from nanostream.errors import ModelLoadError

# config ``hidden_act`` -> F.gelu's ``approximate`` (the ViT MLP's activation; the mergers always use erf GELU)
VISION_ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


@dataclasses.dataclass(frozen=True)
class QwenVisionSpec:
    """Sizes of the ViT: ``depth`` blocks of ``hidden_size`` with ``num_heads`` heads, patches of
    ``temporal_patch_size`` x ``patch_size`` x ``patch_size`` pixels, a learned ``num_position_embeddings``
    square grid resampled to each image, and a merger of ``spatial_merge_size``² patches into one token of
    ``out_hidden_size`` (the language model's width). ``deepstack_visual_indexes``: the blocks whose output a
    DeepStack merger also projects (Qwen3-VL; empty for Qwen3.5)."""

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    num_position_embeddings: int
    in_channels: int = 3
    rope_theta: float = 10000.0
    gelu_approximate: str = "tanh"
    deepstack_visual_indexes: tuple[int, ...] = ()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def grid_side(self) -> int:
        """Side of the learned position grid (``num_position_embeddings`` = side²)."""
        return math.isqrt(self.num_position_embeddings)

    @property
    def merge_unit(self) -> int:
        """Patches merged into one language-model token."""
        return self.spatial_merge_size**2

    @property
    def patch_pixels(self) -> int:
        """Values of one row of ``pixel_values``: channels x temporal x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            raise ModelLoadError(
                f"vision hidden_size {self.hidden_size} over {self.num_heads} heads must give a head size that is "
                "a multiple of 4 (the 2-D rotary embedding splits it into height and width halves)"
            )
        if self.grid_side**2 != self.num_position_embeddings:
            raise ModelLoadError(
                f"vision num_position_embeddings {self.num_position_embeddings} is not a square; the learned "
                "position grid must be side x side"
            )
        if self.gelu_approximate not in VISION_ACTIVATIONS.values():
            raise ModelLoadError(f"vision gelu_approximate {self.gelu_approximate!r} is not 'tanh' or 'none'")
        bad = [i for i in self.deepstack_visual_indexes if not 0 <= i < self.depth]
        if bad:
            raise ModelLoadError(f"deepstack_visual_indexes {bad} lie outside the encoder's {self.depth} blocks")

    @classmethod
    def from_config(cls, vision_config: Any) -> QwenVisionSpec:
        """The spec of a transformers vision config (``Qwen3_5VisionConfig``, ``Qwen3VLVisionConfig``, their
        MoE twins) or its dict (``config.json``'s ``vision_config``)."""
        cfg = vision_config if isinstance(vision_config, dict) else vision_config.to_dict()
        if "window_size" in cfg or "fullatt_block_indexes" in cfg:
            raise ModelLoadError(
                "this vision config has windowed attention (Qwen2.5-VL's encoder: RMSNorm, gated MLP, no learned "
                "position grid); nanostream runs the Qwen3-VL / Qwen3.5 encoder only"
            )
        rope = cfg.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ModelLoadError(f"vision rope_type {rope.get('rope_type')!r} is not supported; only 'axial' is")
        act = cfg.get("hidden_act", "gelu_pytorch_tanh")
        if act not in VISION_ACTIVATIONS:
            raise ModelLoadError(f"vision hidden_act {act!r} is not supported; use one of {sorted(VISION_ACTIVATIONS)}")
        for key in ("patch_size", "temporal_patch_size"):
            if not isinstance(cfg[key], int):
                raise ModelLoadError(f"vision {key} {cfg[key]!r} must be one integer (non-square patches are not run)")
        return cls(
            depth=cfg["depth"],
            hidden_size=cfg["hidden_size"],
            num_heads=cfg["num_heads"],
            intermediate_size=cfg["intermediate_size"],
            out_hidden_size=cfg["out_hidden_size"],
            patch_size=cfg["patch_size"],
            temporal_patch_size=cfg["temporal_patch_size"],
            spatial_merge_size=cfg["spatial_merge_size"],
            num_position_embeddings=cfg["num_position_embeddings"],
            in_channels=cfg.get("in_channels", 3),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            gelu_approximate=VISION_ACTIVATIONS[act],
            deepstack_visual_indexes=tuple(cfg.get("deepstack_visual_indexes") or ()),
        )
