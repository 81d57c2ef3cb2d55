"""The shape of a Qwen vision transformer, read from a transformers vision config.

Two encoders share the sizes of ``QwenViTSizes`` (blocks, heads, patches, the merger, the 2-D rotary):

- ``QwenVisionSpec``: Qwen3-VL's and Qwen3.5/3.6's (LayerNorm, GELU MLP, a learned position grid, and for
  Qwen3-VL the DeepStack blocks; Qwen3.5 reads as an empty ``deepstack_visual_indexes``);
- ``QwenWindowedSpec``: Qwen2.5-VL's (RMSNorm, gated SiLU MLP, attention within windows of ``window_size``
  pixels but for the ``fullatt_block_indexes`` blocks).

``vision_spec`` reads whichever a config describes; what no encoder runs exactly (another rope type or
activation, non-square patches) is refused with ``ModelLoadError`` naming it::

    spec = vision_spec(AutoConfig.from_pretrained(path).vision_config)  # QwenVisionSpec | QwenWindowedSpec
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from nanostream.errors import ModelLoadError

# config ``hidden_act`` -> F.gelu's ``approximate`` (the ViT MLP's activation; the mergers always use erf GELU)
VISION_ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}
WINDOW_KEYS = ("window_size", "fullatt_block_indexes")  # a config with these is Qwen2.5-VL's windowed encoder


@dataclasses.dataclass(frozen=True)
class QwenViTSizes:
    """Sizes both encoders share: ``depth`` blocks of ``hidden_size`` with ``num_heads`` heads (a 2-D rotary of
    ``rope_theta`` in each), patches of ``temporal_patch_size`` x ``patch_size`` x ``patch_size`` pixels of
    ``in_channels`` channels, and a merger of ``spatial_merge_size``² patches into one token of
    ``out_hidden_size`` (the language model's width)."""

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int = 3
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merge_unit(self) -> int:
        """Patches merged into one language-model token."""
        return self.spatial_merge_size**2

    @property
    def patch_pixels(self) -> int:
        """Values of one row of ``pixel_values``: channels x temporal x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    def grid_error(self, grid: Any) -> str | None:
        """Why the encoder cannot take an image of ``grid`` (t, h, w), or None where it can: t >= 1, h and w
        positive multiples of ``spatial_merge_size``."""
        t, h, w = (int(v) for v in grid)
        merge = self.spatial_merge_size
        if t >= 1 and h >= merge and w >= merge and not h % merge and not w % merge:
            return None
        return (
            f"the patch grid {(t, h, w)} is not (t >= 1, h, w) with h and w positive multiples of {merge}; send the "
            "grid the model's image processor gave (image_grid_thw)"
        )

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            raise ModelLoadError(
                f"vision hidden_size {self.hidden_size} over {self.num_heads} heads must give a head size that is "
                "a multiple of 4 (the 2-D rotary embedding splits it into height and width halves)"
            )

    @staticmethod
    def sizes_of(cfg: dict[str, Any]) -> dict[str, Any]:
        """The shared fields of a vision config dict, checked."""
        rope = cfg.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ModelLoadError(f"vision rope_type {rope.get('rope_type')!r} is not supported; only 'axial' is")
        for key in ("patch_size", "temporal_patch_size"):
            if not isinstance(cfg[key], int):
                raise ModelLoadError(f"vision {key} {cfg[key]!r} must be one integer (non-square patches are not run)")
        names = [f.name for f in dataclasses.fields(QwenViTSizes) if f.default is dataclasses.MISSING]
        return dict(
            {name: cfg[name] for name in names},
            in_channels=cfg.get("in_channels", cfg.get("in_chans", 3)),  # Qwen2-VL-era configs: in_chans
            rope_theta=float(rope.get("rope_theta", 10000.0)),
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class QwenVisionSpec(QwenViTSizes):
    """Qwen3-VL's and Qwen3.5/3.6's encoder: a learned ``num_position_embeddings`` square grid resampled to each
    image, GELU (``gelu_approximate``) MLPs, and ``deepstack_visual_indexes``: the blocks whose output a
    DeepStack merger also projects (Qwen3-VL; empty for Qwen3.5)."""

    num_position_embeddings: int
    gelu_approximate: str = "tanh"
    deepstack_visual_indexes: tuple[int, ...] = ()

    @property
    def grid_side(self) -> int:
        """Side of the learned position grid (``num_position_embeddings`` = side²)."""
        return math.isqrt(self.num_position_embeddings)

    def __post_init__(self) -> None:
        super().__post_init__()
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
        cfg = _as_dict(vision_config)
        if any(key in cfg for key in WINDOW_KEYS):
            raise ModelLoadError(
                "this vision config has windowed attention (Qwen2.5-VL's encoder: RMSNorm, gated MLP, no learned "
                "position grid); read it with QwenWindowedSpec.from_config or vision_spec"
            )
        act = cfg.get("hidden_act", "gelu_pytorch_tanh")
        if act not in VISION_ACTIVATIONS:
            raise ModelLoadError(f"vision hidden_act {act!r} is not supported; use one of {sorted(VISION_ACTIVATIONS)}")
        return cls(
            **cls.sizes_of(cfg),
            num_position_embeddings=cfg["num_position_embeddings"],
            gelu_approximate=VISION_ACTIVATIONS[act],
            deepstack_visual_indexes=tuple(cfg.get("deepstack_visual_indexes") or ()),
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class QwenWindowedSpec(QwenViTSizes):
    """Qwen2.5-VL's encoder: attention within square windows ``window_size`` pixels a side (``window`` merged
    tokens a side), except in the ``fullatt_block_indexes`` blocks, which attend over each whole frame."""

    window_size: int
    fullatt_block_indexes: tuple[int, ...] = ()

    @property
    def window(self) -> int:
        """A window's side in merged tokens (``window_size`` // merge // patch, floored as transformers does)."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window < 1:
            raise ModelLoadError(
                f"vision window_size {self.window_size} is smaller than one merged token "
                f"({self.spatial_merge_size} x {self.patch_size} pixels); it must be at least that"
            )
        bad = [i for i in self.fullatt_block_indexes if not 0 <= i < self.depth]
        if bad:
            raise ModelLoadError(f"fullatt_block_indexes {bad} lie outside the encoder's {self.depth} blocks")

    @classmethod
    def from_config(cls, vision_config: Any) -> QwenWindowedSpec:
        """The spec of a ``Qwen2_5_VLVisionConfig`` or its dict (``config.json``'s ``vision_config``)."""
        cfg = _as_dict(vision_config)
        missing = [key for key in WINDOW_KEYS if key not in cfg]
        if missing:
            raise ModelLoadError(f"vision config lacks {missing}; it is not a windowed (Qwen2.5-VL) encoder's")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"vision hidden_act {act!r} is not supported by the windowed encoder; only 'silu' is")
        return cls(
            **cls.sizes_of(cfg),
            window_size=cfg["window_size"],
            fullatt_block_indexes=tuple(cfg["fullatt_block_indexes"] or ()),
        )


def vision_spec(vision_config: Any) -> QwenVisionSpec | QwenWindowedSpec:
    """The spec of any Qwen vision config: windowed (Qwen2.5-VL) where it has ``window_size``, else Qwen3-VL's."""
    cfg = _as_dict(vision_config)
    return (QwenWindowedSpec if any(k in cfg for k in WINDOW_KEYS) else QwenVisionSpec).from_config(cfg)


def _as_dict(vision_config: Any) -> dict[str, Any]:
    return vision_config if isinstance(vision_config, dict) else vision_config.to_dict()
