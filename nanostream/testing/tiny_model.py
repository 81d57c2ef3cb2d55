"""A tiny random-weight model, built the same way on any machine, for tests.

``make_tiny_model(DIR)`` writes a Hugging Face model directory (config.json, model.safetensors, tokenizer files with a
chat template) with transformers' own config and model classes; random weights, to run the whole engine offline."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from nanostream.testing import tiny_families as families  # the families of issue 57
from nanostream.testing import tiny_vision as vision  # the vision-language models of issue 58
from nanostream.testing.tiny_latent import LATENT_ARCHITECTURES, LATENT_PRESETS, TINY_LATENT
from nanostream.testing.tokenizer import build_tokenizer

TINY_ARCHITECTURES = (
    "Qwen3ForCausalLM",
    "Qwen2ForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM",
    "MixtralForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
    "Olmo2ForCausalLM",
    "GraniteForCausalLM",
    "SmolLM3ForCausalLM",
    "Glm4ForCausalLM",
    "GptOssForCausalLM",
    "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    *vision.VL_ARCHITECTURES,  # Qwen3-VL
    "Glm4MoeForCausalLM",
    "MiniMaxM2ForCausalLM",
    *families.FAMILY_ARCHITECTURES,
    *LATENT_ARCHITECTURES,
)
# The dense families' departures, each exercised: Gemma 3's sliding and full layers (a window shorter than
# the tests' prompts), its own query scale and logit cap; Phi-3's window on every layer; Granite's
# multipliers; SmolLM3's layer without rotary embedding.
_TINY_DENSE: dict[str, dict] = {
    "Gemma3ForCausalLM": dict(
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        num_hidden_layers=3,
        final_logit_softcapping=8.0,
    ),
    "Phi3ForCausalLM": dict(sliding_window=40),
    "GraniteForCausalLM": dict(
        embedding_multiplier=1.5, residual_multiplier=0.6, attention_multiplier=0.2, logits_scaling=2.5
    ),
    "SmolLM3ForCausalLM": dict(no_rope_layers=[1, 0, 1], num_hidden_layers=3),
    "Glm4ForCausalLM": dict(head_dim=16, attention_bias=True),  # partial_rotary_factor 0.5, interleaved pairs
}
_CONFIG_CLASSES = {  # the text model's config, not the multimodal one
    "Gemma3ForCausalLM": "Gemma3TextConfig",
    "Qwen3_5ForCausalLM": "Qwen3_5TextConfig",
    "Qwen3_5MoeForCausalLM": "Qwen3_5MoeTextConfig",
    **families.FAMILY_CONFIG_CLASSES,
    **vision.VL_CONFIG_CLASSES,
}
# Each tiny MoE model's experts: some get no token of a short prompt, a decode token routes to several, and
# Qwen2-MoE mixes a dense layer in (mlp_only_layers) and has its shared expert. DeepSeek's router (GLM-4.5: a dense
# first layer, a shared expert, the top 2 of 4 groups, scaled weights; MiniMax-M2) with a correction bias drawn large
# enough to change the choice (make_tiny_model).
_GLM4_MOE = dict(
    head_dim=16, num_hidden_layers=4, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=3,
    moe_intermediate_size=32, n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
    norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
)  # fmt: skip
_TINY_MOE: dict[str, dict] = {
    "Qwen3MoeForCausalLM": dict(
        head_dim=16, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True
    ),
    "Qwen2MoeForCausalLM": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        norm_topk_prob=False,
        num_hidden_layers=3,
        mlp_only_layers=[1],
    ),
    "MixtralForCausalLM": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, sliding_window=None),
    "Glm4MoeForCausalLM": _GLM4_MOE,
    "MiniMaxM2ForCausalLM": dict(
        head_dim=16, num_hidden_layers=3, num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, rotary_dim=8
    ),
    # sliding (16 tokens) and full layers with sinks; the experts' clamp (limit 2) is reached at this init
    "GptOssForCausalLM": dict(
        head_dim=16, num_local_experts=6, num_experts_per_tok=2, intermediate_size=32, sliding_window=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], num_hidden_layers=3,
        swiglu_limit=2.0,
        rope_parameters={
            "rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 256, "rope_theta": 150000.0,
        },
    ),
}  # fmt: skip
# The hybrid families: Gated DeltaNet layers (2 key heads, each read by 2 value heads) beside gated attention, a
# full-attention layer in the middle and one last (Qwen3-Next, as published), and DeltaNet layers on both sides of it;
# Qwen3-Next with a dense layer among its MoE ones. Their (1 + w) norms are drawn near 0, the DeltaNet's decay slow.
_GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8)
_EXPERTS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
_LINEAR, _FULL = "linear_attention", "full_attention"
_TINY_HYBRID: dict[str, dict] = {
    "Qwen3NextForCausalLM": dict(
        **_GDN, **_EXPERTS, head_dim=16, num_hidden_layers=4, mlp_only_layers=[2], norm_topk_prob=True,
        layer_types=[_LINEAR, _FULL, _LINEAR, _FULL],
    ),
    "Qwen3_5ForCausalLM": dict(
        **_GDN, head_dim=16, num_hidden_layers=4, layer_types=[_LINEAR, _FULL, _LINEAR, _LINEAR]
    ),
    "Qwen3_5MoeForCausalLM": dict(
        **_GDN, **_EXPERTS, head_dim=16, num_hidden_layers=4, layer_types=[_LINEAR, _LINEAR, _FULL, _LINEAR]
    ),
}  # fmt: skip
_CENTRED_NORMS = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
_MULTIMODAL = {"Qwen3_5ForConditionalGeneration": ("Qwen3_5ForCausalLM", "Qwen3_5Config", vision.TINY_QWEN_VISION)}
_MULTIMODAL |= families.FAMILY_MULTIMODAL | vision.VL_MULTIMODAL
"""A multimodal checkpoint's tiny model: its language model's architecture, its config class, its vision config."""
EXPERT_LAYOUTS = ("per_expert", "stacked")
LLAMA3_ROPE_SCALING = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=256
)
"""Llama 3 rope scaling for a tiny model (``rope_scaling=``): of head_dim 16's 8 frequencies 3 kept, 1 interpolated."""
TINY_PRESETS: dict[str, dict] = {
    "llama": dict(architecture="LlamaForCausalLM", seed=3, tie_word_embeddings=False),
    "llama3": dict(  # Llama 3 rope scaling, biases on attention and MLP
        architecture="LlamaForCausalLM",
        seed=4,
        rope_scaling=LLAMA3_ROPE_SCALING,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=False,
    ),
    "mistral": dict(architecture="MistralForCausalLM", seed=5),  # tied embeddings
    "qwen3_moe": dict(architecture="Qwen3MoeForCausalLM", seed=7),
    "qwen2_moe": dict(architecture="Qwen2MoeForCausalLM", seed=8),  # a shared expert, a dense layer
    "mixtral": dict(architecture="MixtralForCausalLM", seed=9),
    "gemma3": dict(architecture="Gemma3ForCausalLM", seed=10),
    "phi3": dict(architecture="Phi3ForCausalLM", seed=11, tie_word_embeddings=False),
    "olmo2": dict(architecture="Olmo2ForCausalLM", seed=12, tie_word_embeddings=False),
    "granite": dict(architecture="GraniteForCausalLM", seed=13),
    "smollm3": dict(architecture="SmolLM3ForCausalLM", seed=14),
    "glm4": dict(architecture="Glm4ForCausalLM", seed=15, tie_word_embeddings=False),
    "gpt_oss": dict(architecture="GptOssForCausalLM", seed=18, tie_word_embeddings=False),
    "qwen3_next": dict(architecture="Qwen3NextForCausalLM", seed=19, tie_word_embeddings=False),
    "qwen3_5": dict(architecture="Qwen3_5ForCausalLM", seed=20),  # tied, as the small Qwen3.5 models
    "qwen3_5_moe": dict(architecture="Qwen3_5MoeForCausalLM", seed=21, tie_word_embeddings=False),
    "qwen3_5_vl": dict(architecture="Qwen3_5ForConditionalGeneration", seed=22),  # with a vision tower
    "glm4_moe": dict(architecture="Glm4MoeForCausalLM", seed=23, tie_word_embeddings=False),
    "minimax_m2": dict(architecture="MiniMaxM2ForCausalLM", seed=24, tie_word_embeddings=False),
    **families.FAMILY_PRESETS,
    **LATENT_PRESETS,
    **vision.VL_PRESETS,
}
"""make_tiny_model arguments of the tests' models: ``make_tiny_model(d, **TINY_PRESETS["llama"])``."""


def _classes(architecture: str):
    import transformers

    if architecture not in TINY_ARCHITECTURES:
        raise ValueError(f"architecture must be one of {', '.join(TINY_ARCHITECTURES)}, got {architecture!r}")
    prefix = architecture.removesuffix("ForCausalLM")  # Qwen3ForCausalLM -> transformers.Qwen3Config
    config = _MULTIMODAL[architecture][1] if architecture in _MULTIMODAL else f"{prefix}Config"
    config = _CONFIG_CLASSES.get(architecture, config)
    return getattr(transformers, config), getattr(transformers, architecture, None)  # None: Qwen3-VL's LM alone


def tiny_config(architecture: str = "Qwen3ForCausalLM", **config_overrides):
    """The transformers config of ``make_tiny_model(DIR, architecture=..., **config_overrides)``, in memory."""
    config_cls, _ = _classes(architecture)
    if architecture in _MULTIMODAL:  # the language model's config as text_config, a one-block vision tower
        tower = dict(_MULTIMODAL[architecture][2]) | config_overrides.pop("vision_config", {})  # a shape's own
        text = tiny_config(_MULTIMODAL[architecture][0], **config_overrides)
        if architecture in vision.OUT_WIDTH:  # Qwen's: its merger's output is the text model's width
            tower["out_hidden_size"] = text.hidden_size
        tokens, text.vocab_size = vision.vision_token_ids(architecture) or ({}, text.vocab_size)  # its placeholders
        config = config_cls(
            text_config=text.to_dict(), vision_config=tower, tie_word_embeddings=text.tie_word_embeddings, **tokens
        )
        config.architectures = [architecture]
        return config
    tokenizer = build_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    kwargs = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=eos,
        bos_token_id=eos,
        pad_token_id=eos,
    )
    if architecture == "Qwen3ForCausalLM":
        kwargs["head_dim"] = 16
    elif architecture == "MistralForCausalLM":
        kwargs["sliding_window"] = None
    kwargs.update(_TINY_MOE.get(architecture, {}))
    kwargs.update(_TINY_DENSE.get(architecture, {}))
    kwargs.update(_TINY_HYBRID.get(architecture, {}))
    kwargs.update((families.FAMILY_CONFIGS | vision.VL_CONFIGS).get(architecture, {}))
    kwargs.update(TINY_LATENT.get(architecture, {}))
    if architecture == "Qwen3_5MoeForCausalLM":
        kwargs.pop("intermediate_size")  # every layer is MoE: its configs have none
    kwargs.update(config_overrides)
    config = config_cls(**kwargs)
    config.architectures = [architecture]
    return config


def make_tiny_model(
    path: str | os.PathLike,
    *,
    architecture: str = "Qwen3ForCausalLM",
    seed: int = 0,
    init_std: float = 0.15,
    weights_dtype: str = "float32",
    expert_layout: str = "per_expert",
    weights: bool = True,
    **config_overrides,
) -> Path:
    """Write a tiny random model directory at ``path`` and return its path.

    ``architecture``: one of ``TINY_ARCHITECTURES``; ``config_overrides`` go to its transformers config class
    (``rope_scaling={...}``, ``tie_word_embeddings=False``, ...). Mistral's sliding window is off unless given.
    ``init_std`` is larger than a real model's so that next-token distributions are peaked and greedy choices are not
    near-ties; every parameter is drawn, the MoE routers and the norms too (norms, Gemma 4's router's scales near 1),
    and DeepSeek's router's correction bias (a buffer in transformers), of N(0, 0.3^2): as wide as the sigmoid scores'
    spread, so that it changes most tokens' choice. The same architecture, shape and seed give the same weights.
    ``weights_dtype`` ("bfloat16"): the model is built and saved in it, never whole in float32 (an 8B
    shape then takes 16 GB of memory and of disk, not 32).
    ``expert_layout``: how an MoE model's experts are saved, ``per_expert`` (the published checkpoints'
    ``experts.N.gate_proj.weight``, what transformers' save_pretrained writes by default) or ``stacked``
    (``experts.gate_up_proj``, save_pretrained(save_original_format=False)).
    ``weights=False``: only config.json and the tokenizer (for ``load_format="dummy"``: any shape, no model
    built).
    """
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout must be one of {', '.join(EXPERT_LAYOUTS)}, got {expert_layout!r}")
    _, model_cls = _classes(architecture)
    path = Path(path)
    tokenizer = vision.tokenizer_of(architecture)
    config = tiny_config(architecture, **config_overrides)
    if not weights:
        config.dtype = weights_dtype
        path.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(path)
        tokenizer.save_pretrained(path)
        return path
    dtype, default = getattr(torch, weights_dtype), torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # the parameters are made in it
    try:
        model = model_cls(config).to(dtype)
    finally:
        torch.set_default_dtype(default)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        centred = architecture in _CENTRED_NORMS or architecture in _MULTIMODAL.keys() - vision.PLAIN_NORMS  # 1 + w
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                one = 0.0 if centred and not any(k in name for k in ("linear_attn", "vision_tower")) else 1.0
                param.copy_(one + 0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith(("router.scale", "per_expert_scale")):  # Gemma 4's router's scales: ~1 where they act
                scale = param.shape[0] ** 0.5 if name.endswith("router.scale") else 1.0  # the input's: x H^-0.5 there
                param.copy_(scale * (1.0 + 0.3 * torch.randn(param.shape, generator=gen)))
            elif name.endswith(("A_log", "dt_bias")):  # decay exp(-exp(A_log) softplus(a + dt_bias)) ~ 0.9 a token
                param.copy_((-2.0 if name.endswith("A_log") else -1.0) + 0.5 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(init_std * torch.randn(param.shape, generator=gen))
        for name, buffer in sorted(model.named_buffers()):  # DeepSeek's router's bias, a buffer in transformers
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn(buffer.shape, generator=gen))
    path.mkdir(parents=True, exist_ok=True)
    stacked = {"save_original_format": False} if expert_layout == "stacked" else {}
    model.save_pretrained(path, safe_serialization=True, **stacked)
    tokenizer.save_pretrained(path)
    vision.save_image_processor(config, architecture, path)  # where its images run
    gen_cfg = path / "generation_config.json"
    if gen_cfg.exists():  # keep the EOS but drop sampling defaults that would make HF generate sample
        data = json.loads(gen_cfg.read_text())
        gen_cfg.write_text(
            json.dumps({k: v for k, v in data.items() if k.endswith("token_id") or k.startswith("_")}, indent=2)
        )
    return path
