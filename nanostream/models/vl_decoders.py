"""The language models of vision-language checkpoints that transformers builds only inside their wrapper (no class of
its own): nanostream's names for them and their declarations. models/architectures.py maps each wrapper to one
(``TEXT_MODELS``); the wrapper's vision tower runs apart (models/vision/tower.py).
"""

from __future__ import annotations

from nanostream.models.declarations import ROPES, Architecture
from nanostream.models.moe_config import Experts

VL_DECODERS: dict[str, Architecture] = {
    # Qwen3-VL: Qwen3's decoder rotating by M-RoPE over its 64 frequency pairs, (24, 20, 20) interleaved; its images'
    # DeepStack features join the first layers' hidden states (models/placeholder_embeds.py).
    "Qwen3VLForCausalLM": Architecture(
        qk_norm=True, attention_bias_key="attention_bias", mrope=(24, 20, 20), rope_types=ROPES,
        unused_tensors=("model.visual.",),
    ),
    # Qwen3-VL's MoE models (30B-A3B, 235B-A22B): the same with Qwen3-MoE's experts, top-k always renormalised, saved
    # stacked and inputs first ([E, H, 2I], [E, I, H]).
    "Qwen3VLMoeForCausalLM": Architecture(
        qk_norm=True, attention_bias_key="attention_bias", mrope=(24, 20, 20), rope_types=ROPES,
        experts=Experts(renormalize=True, transposed=True), unused_tensors=("model.visual.",),
    ),
    # Qwen2.5-VL: Qwen2's decoder (q, k, v biases) rotating by M-RoPE in three runs of pairs, (16, 24, 24); its vision
    # tower under model.visual. (transformers 5) or visual. (the published checkpoints, saved by transformers 4).
    "Qwen2_5_VLForCausalLM": Architecture(
        qkv_bias=True, sliding_window_switch="use_sliding_window", rope_types=ROPES, mrope=(16, 24, 24),
        mrope_interleaved=False, unused_tensors=("model.visual.", "visual."),
    ),
}  # fmt: skip
