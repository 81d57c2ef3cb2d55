"""Supported architectures, keyed by the ``architectures`` entry of a model's config.json."""

from __future__ import annotations

from typing import Any

from nanostream.errors import ModelLoadError
from nanostream.models.qwen import DecoderSpec, QwenForCausalLM

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen2ForCausalLM")


def _rope_theta(hf_config: Any) -> float:
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ModelLoadError(f"rope type {rope_type!r} is not supported yet; only the default rotary embedding is")
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ModelLoadError("config.json gives no rope_theta")
    return float(theta)


def decoder_spec(hf_config: Any) -> DecoderSpec:
    """Read the decoder's shape from a transformers config, refusing what the decoder cannot run."""
    architectures = getattr(hf_config, "architectures", None) or []
    arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"unsupported architecture {architectures or 'missing'} in config.json; "
            f"nanostream runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if getattr(hf_config, "use_sliding_window", False):
        raise ModelLoadError("sliding-window attention is not supported; set use_sliding_window to false")
    is_qwen3 = arch == "Qwen3ForCausalLM"
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    return DecoderSpec(
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rms_norm_eps=hf_config.rms_norm_eps,
        rope_theta=_rope_theta(hf_config),
        max_position=hf_config.max_position_embeddings,
        qkv_bias=attention_bias if is_qwen3 else True,
        o_bias=attention_bias if is_qwen3 else False,
        qk_norm=is_qwen3,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
    )


def build_model(hf_config: Any) -> QwenForCausalLM:
    return QwenForCausalLM(decoder_spec(hf_config))
