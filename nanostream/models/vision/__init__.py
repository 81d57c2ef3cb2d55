"""Vision encoders of vision-language checkpoints and the positions their image tokens take in the prompt.

- ``qwen_vit``: the Qwen3-VL / Qwen3.5 vision transformer (``QwenVisionEncoder``), its config reader
  (``qwen_vit_spec``) and its per-image tables (``qwen_vit_grid``);
- ``qwen25_vit``: Qwen2.5-VL's windowed vision transformer (``QwenWindowedEncoder``, spec ``QwenWindowedSpec``),
  built from qwen_vit's patch embedding, rotary and attention; ``vision_spec`` reads either kind of config;
- ``gemma4_vit``: Gemma 4's tower and multimodal embedder (``Gemma4VisionEncoder``), images of many shapes pooled
  k x k; its spec in ``gemma4_vit_spec`` (``Gemma4VisionSpec``);
- ``weights``: loading an encoder from a checkpoint's ``model.visual.*`` tensors;
- ``mrope``: Qwen's multimodal rotary positions (temporal, height, width) for prompts with images.
"""

from nanostream.models.vision.mrope import mrope_decode_positions, mrope_positions, mrope_positions_range
from nanostream.models.vision.qwen25_vit import QwenWindowedEncoder
from nanostream.models.vision.qwen_vit import QwenVisionEncoder, VisionOutput
from nanostream.models.vision.qwen_vit_spec import QwenVisionSpec, QwenWindowedSpec, vision_spec
from nanostream.models.vision.weights import load_vision_weights

__all__ = [
    "QwenVisionEncoder",
    "QwenVisionSpec",
    "QwenWindowedEncoder",
    "QwenWindowedSpec",
    "VisionOutput",
    "load_vision_weights",
    "mrope_decode_positions",
    "mrope_positions",
    "mrope_positions_range",
    "vision_spec",
]
