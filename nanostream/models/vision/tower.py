"""Which checkpoints take images, and the vision tower each runs: read from config.json, built on a device.

Example::

    tower = vision_tower(read_model_config(path))  # None: a text model
    encoder = tower.build(path, dtype=torch.bfloat16, device="cuda", load_format="auto")

The engine checks requests' images against the tower (engine/images.py) and its runner encodes them.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from nanostream.models.vision.gemma4_vit import Gemma4VisionEncoder
from nanostream.models.vision.gemma4_vit_spec import Gemma4VisionSpec
from nanostream.models.vision.qwen25_vit import QwenWindowedEncoder
from nanostream.models.vision.qwen_vit import QwenVisionEncoder
from nanostream.models.vision.qwen_vit_spec import QwenVisionSpec, QwenWindowedSpec, vision_spec
from nanostream.models.vision.siglip import SiglipEncoder, SiglipSpec
from nanostream.models.vision.weights import VISION_PREFIXES, load_vision_weights

log = logging.getLogger(__name__)

QWEN_TOWERS = (
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
)
"""Wrappers whose vision tower runs: the Qwen3.5 / 3.6 and Qwen3-VL encoder (with DeepStack features for Qwen3-VL),
Qwen2.5-VL's windowed one (``QwenWindowedEncoder``); M-RoPE positions in the language model."""
GEMMA_TOWERS = ("Gemma3ForConditionalGeneration", "Gemma4ForConditionalGeneration")
"""Wrappers whose image tokens may attend to each other both ways in the language model: Gemma 3's SigLIP tower and
projector (``SiglipEncoder``: one image size, a fixed number of tokens an image), Gemma 4's tower and embedder
(``Gemma4VisionEncoder``: images of many shapes, h*w / k² tokens, both ways on the sliding layers only and only where
the text config's ``use_bidirectional_attention`` is "vision")."""

ENCODERS: dict[type, type[torch.nn.Module]] = {
    QwenVisionSpec: QwenVisionEncoder,
    QwenWindowedSpec: QwenWindowedEncoder,
    SiglipSpec: SiglipEncoder,
    Gemma4VisionSpec: Gemma4VisionEncoder,
}
"""The encoder each kind of spec describes."""


@dataclasses.dataclass(frozen=True)
class VisionTower:
    """A checkpoint's vision encoder and how its images sit in a prompt: each image is ``t*h*w / merge²``
    consecutive ``image_token_id`` tokens, whose embeddings the encoder's rows replace. ``both_ways``: the layers of
    the language model where an image's tokens attend to each other both ways, "all" (Gemma 3's) or "sliding" (Gemma
    4's windowed layers, where its config says "vision"; its full layers stay causal); None: causally (Qwen's).
    ``spec.grid_error(grid)`` says why the tower cannot take an image's grid (None: it can)."""

    spec: QwenVisionSpec | QwenWindowedSpec | SiglipSpec | Gemma4VisionSpec
    image_token_id: int
    both_ways: str | None = None

    @property
    def bidirectional(self) -> bool:
        """Whether an image's tokens see each other both ways in any layer (a chunk never cuts such an image)."""
        return self.both_ways is not None

    @property
    def merge(self) -> int:
        return self.spec.spatial_merge_size

    @property
    def deepstack_levels(self) -> tuple[int, ...]:
        """The encoder blocks whose DeepStack features join the language model (Qwen3-VL's; none elsewhere)."""
        return tuple(getattr(self.spec, "deepstack_visual_indexes", ()))

    def build(self, path: Path, *, dtype: torch.dtype, device: torch.device | str, load_format: str) -> torch.nn.Module:
        """The encoder with the checkpoint's weights (random ones for ``load_format="dummy"``), in eval mode."""
        with torch.device(device):
            encoder = ENCODERS[type(self.spec)](self.spec)
        if load_format != "dummy":
            load_vision_weights(encoder, Path(path), getattr(encoder, "checkpoint_prefixes", VISION_PREFIXES))
        return encoder.to(dtype).eval()


def vision_tower(model: Any) -> VisionTower | None:
    """The tower of ``model`` (a ``ModelConfig``: its architecture and whole config), or None where the checkpoint
    has none that runs; a multimodal wrapper whose tower does not run yet is logged (its language model runs)."""
    config = model.hf_config
    vision = getattr(config, "vision_config", None)
    if model.architecture not in QWEN_TOWERS + GEMMA_TOWERS or vision is None:
        if vision is not None:
            log.info("%s: its vision tower does not run yet; text prompts only", model.architecture)
        return None
    image_token_id = getattr(config, "image_token_id", None)
    image_token_id = getattr(config, "image_token_index", None) if image_token_id is None else image_token_id
    if model.architecture == "Gemma4ForConditionalGeneration":
        vision_both_ways = getattr(config.get_text_config(), "use_bidirectional_attention", None) == "vision"
        spec = Gemma4VisionSpec.from_config(config)
        return VisionTower(spec, int(image_token_id), both_ways="sliding" if vision_both_ways else None)
    if model.architecture in GEMMA_TOWERS:
        return VisionTower(SiglipSpec.from_config(config), int(image_token_id), both_ways="all")
    return VisionTower(vision_spec(vision), int(image_token_id))
