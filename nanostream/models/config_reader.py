"""Reading a transformers config (config.json) into the decoder's ``DecoderSpec``, by its family's declaration
(models/architectures.py), refusing what nanostream does not run.

What a config asks for that the decoder cannot run exactly (a rope type, an activation, a quantization method,
attention logit soft-capping, a layer type, a bad size) is refused with ``ModelLoadError`` naming it::

    spec = decoder_spec(AutoConfig.from_pretrained(path), max_model_len=4096)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from nanostream.errors import ModelLoadError
from nanostream.layers.activation import ACTIVATIONS, UNGATED_ACTIVATIONS
from nanostream.layers.moe_spec import MoESpec
from nanostream.layers.rope_config import rope_spec
from nanostream.layers.rotary import RopeSpec
from nanostream.models.architectures import ARCHITECTURES, TEXT_MODELS, Architecture
from nanostream.models.attention_config import attention_fields
from nanostream.models.latent_config import latent_attention
from nanostream.models.layer_kinds import attention_output_gate, short_conv_layers, token_mixers
from nanostream.models.model_config import ConfigFields, supported_architecture, text_config
from nanostream.models.moe_config import count, moe_spec, positive_int
from nanostream.models.quantization import fp8_spec
from nanostream.models.shared_layers import shared_layer_fields
from nanostream.models.spec import DecoderSpec


def _rope_params(hf_config: Any, with_theta: Any = None) -> dict:
    # transformers 5 keeps everything in rope_parameters; 4.x has rope_scaling (None by default) and rope_theta
    # (``with_theta``: the config to take it from, there).
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    if with_theta is not None and "rope_theta" not in params and getattr(with_theta, "rope_theta", None) is not None:
        params["rope_theta"] = with_theta.rope_theta
    return params


def _ropes(hf_config: Any, name: str, arch: Architecture) -> tuple[RopeSpec, RopeSpec | None]:
    """The rotary embedding of the (full) layers and, where the family gives its sliding layers their own
    (Gemma 3's local base), theirs. Full layers of their own head size (Gemma 4) rotate over it."""
    params = _rope_params(hf_config)
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    if "partial_rotary_factor" not in params and getattr(hf_config, "partial_rotary_factor", None) is not None:
        params["partial_rotary_factor"] = hf_config.partial_rotary_factor  # transformers 4.x keeps it outside
    if "rope_theta" not in params and getattr(hf_config, "rope_theta", None) is not None:
        params["rope_theta"] = hf_config.rope_theta

    def read(p: dict, head_dim: int = head_dim) -> RopeSpec:
        return rope_spec(
            p,
            head_dim=head_dim,
            max_position_embeddings=hf_config.max_position_embeddings,
            allowed=arch.rope_types,
            model=name,
            interleaved=arch.interleaved_rotary,
            partial_rotary=arch.partial_rotary,
            mrope=arch.mrope,
            mrope_interleaved=arch.mrope_interleaved,
        )

    if "full_attention" in params:  # Gemma 3: a rope per layer kind
        sliding = params.get("sliding_attention")
        types = getattr(hf_config, "layer_types", None) or ["full_attention"]
        full_dim = hf_config.per_layer_config[types.index("full_attention")].head_dim if arch.per_layer_shapes else 0
        return read(dict(params["full_attention"]), full_dim or head_dim), read(dict(sliding)) if sliding else None
    return read(params), None


def _sliding_window(hf_config: Any, arch: Architecture) -> int | None:
    switch = arch.sliding_window_switch
    if switch is not None and not getattr(hf_config, switch, False):
        return None
    return getattr(hf_config, "sliding_window", None)


def _layer_windows(hf_config: Any, arch_name: str, arch: Architecture, max_model_len: int) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full); empty when no layer's window hides a token of a
    ``max_model_len`` sequence (so those models run the plain kernels)."""
    window = _sliding_window(hf_config, arch)
    if window is None:
        return ()
    window = positive_int(hf_config, "sliding_window", arch_name)
    num_layers = hf_config.num_hidden_layers
    types = getattr(hf_config, "layer_types", None)
    if types is None:
        windows = (window,) * num_layers
    else:
        unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
        if unknown or len(types) != num_layers:
            raise ModelLoadError(
                f"{arch_name} with layer_types {unknown or types!r}: nanostream runs sliding_attention and "
                f"full_attention, one per layer ({num_layers})"
            )
        windows = tuple(window if t == "sliding_attention" else None for t in types)
    if all(w is None or w >= max_model_len for w in windows):
        return ()
    return windows


def _refuse_unsupported(hf_config: Any, name: str, arch: Architecture) -> None:
    fp8_spec(getattr(hf_config, "quantization_config", None), name)  # refuses what does not load, by name
    if getattr(hf_config, "attn_logit_softcapping", None) is not None:
        raise ModelLoadError(f"{name} with attn_logit_softcapping is not supported; nanostream caps only final logits")
    both_ways = getattr(hf_config, "use_bidirectional_attention", False)
    if both_ways and both_ways != "vision":  # "vision" (Gemma 4's): only images' tokens, which the engine places
        raise ModelLoadError(f"{name} with use_bidirectional_attention is not supported; nanostream attends causally")
    for key, runs in arch.fixed_values:
        value = getattr(hf_config, key, runs)
        if any(v != runs for v in (value if isinstance(value, list | tuple) else [value])):
            raise ModelLoadError(f"{name} with {key}={value!r} is not supported; nanostream runs {key}={runs!r}")


def decoder_spec(hf_config: Any, *, max_model_len: int) -> DecoderSpec:
    """Read the decoder's shape from a transformers config, refusing what the decoder cannot run.

    ``max_model_len``: the engine's (resolved) limit. Sliding windows at least that long hide no token, so
    a model whose windows all are runs as full attention. A field the config lacks is a ``ModelLoadError``
    naming it (models/model_config.py)."""
    name = supported_architecture(hf_config)
    if name in TEXT_MODELS:  # a multimodal checkpoint: its language model alone
        spec = decoder_spec(text_config(hf_config), max_model_len=max_model_len)
        quantization = fp8_spec(getattr(hf_config, "quantization_config", None), name)
        return dataclasses.replace(
            spec, checkpoint_prefixes=TEXT_MODELS[name].prefixes, quantization=quantization or spec.quantization
        )
    if not isinstance(hf_config, ConfigFields):
        hf_config = ConfigFields(hf_config, name)  # a field it lacks: a ModelLoadError naming it
    arch = ARCHITECTURES[name]
    if arch.per_layer_shapes:  # its global head_dim and num_key_value_heads: the other layers' (shared_layers.py)
        hf_config._config.allow_global_per_layer_attribute_access = True
    _refuse_unsupported(hf_config, name, arch)
    act = getattr(hf_config, arch.activation_key, None) or "silu"
    if act not in (ACTIVATIONS if arch.gated_mlp else UNGATED_ACTIVATIONS):
        raise ModelLoadError(
            f"{name} with {arch.activation_key}={act!r} is not supported; nanostream's MLP runs "
            f"{', '.join(ACTIVATIONS if arch.gated_mlp else UNGATED_ACTIVATIONS)}"
        )
    num_heads = hf_config.num_attention_heads
    mla = mixers = gated_deltanet = short_conv = None
    if arch.latent_attention is not None:  # every layer: its rope dims are the head_dim the rotary tables know
        mla, rope = latent_attention(hf_config, name, arch, _rope_params(hf_config, hf_config))
        sliding_rope, head_dim, mixers = None, mla.qk_rope_head_dim, ("latent_attention",) * hf_config.num_hidden_layers
    else:
        rope, sliding_rope = _ropes(hf_config, name, arch)
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        mixers, gated_deltanet = token_mixers(hf_config, name, arch)
        conv_mixers, short_conv = short_conv_layers(hf_config, name, arch)
        mixers = mixers or conv_mixers
    attention_bias = bool(arch.attention_bias_key and getattr(hf_config, arch.attention_bias_key, False))
    o_bias = attention_bias or bool(arch.o_bias_key and getattr(hf_config, arch.o_bias_key, False))
    qkv_bias = arch.qkv_bias or bool(arch.qkv_bias_key and getattr(hf_config, arch.qkv_bias_key, False))
    mlp_bias = bool(arch.mlp_bias_key and getattr(hf_config, arch.mlp_bias_key, False))
    # (layers of their own shape keep their windows: which layers are full says which head and rope they have)
    windows = _layer_windows(hf_config, name, arch, 2**62 if arch.per_layer_shapes else max_model_len)
    moe = moe_spec(hf_config, name, arch.experts) if arch.experts else None
    qk_norm = arch.qk_norm or bool(arch.qk_norm_key and getattr(hf_config, arch.qk_norm_key, False))
    return DecoderSpec(
        architecture=name,
        quantization=fp8_spec(getattr(hf_config, "quantization_config", None), name),
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=_dense_intermediate_size(hf_config, moe, arch),
        num_layers=hf_config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rms_norm_eps=getattr(hf_config, arch.norm_eps_key),
        rope=rope,
        max_position=hf_config.max_position_embeddings,
        qkv_bias=qkv_bias or attention_bias,
        o_bias=o_bias,
        qk_norm=qk_norm,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        mlp_bias=mlp_bias,
        moe=moe,
        norms=arch.norms,
        norm_weight_offset=arch.norm_weight_offset,
        qk_norm_whole=arch.qk_norm_whole,
        activation=ACTIVATIONS[act] if arch.gated_mlp else act,
        mlp_gated=arch.gated_mlp,
        scale_embeddings=arch.scale_embeddings,
        **_multipliers(hf_config, name, arch),
        attention_sinks=arch.attention_sinks,
        layer_windows=windows,
        sliding_rope=sliding_rope if windows else None,
        **attention_fields(hf_config, name, arch, max_model_len),
        token_mixers=mixers,
        short_conv=short_conv,
        gated_deltanet=gated_deltanet,
        latent_attention=mla,
        attn_output_gate=attention_output_gate(hf_config, name, arch),
        **shared_layer_fields(hf_config, name, arch),
        unused_tensors=arch.unused_tensors + _mtp_layers(hf_config, name, arch),
    )


def _mtp_layers(hf_config: Any, name: str, arch: Architecture) -> tuple[str, ...]:
    """The prefixes of the multi-token-prediction layers a checkpoint appends to the decoder's (not loaded)."""
    if arch.mtp_layers_key is None:
        return ()
    first = hf_config.num_hidden_layers
    return tuple(f"model.layers.{first + i}." for i in range(count(hf_config, arch.mtp_layers_key, name)))


def _dense_intermediate_size(hf_config: Any, moe: MoESpec | None, arch: Architecture) -> int:
    """The dense MLP's intermediate size (config key ``arch.dense_intermediate_key``, LFM2's adjusted); 0 where
    every layer is MoE and the config has none (Qwen3.5-MoE's)."""
    key = arch.dense_intermediate_key
    if moe is not None and len(moe.layers) == hf_config.num_hidden_layers:
        return getattr(hf_config, key, 0)
    size = getattr(hf_config, key)
    if arch.auto_adjust_ff_dim and getattr(hf_config, "block_auto_adjust_ff_dim", False):
        size = int(2 * size / 3)  # as transformers' LFM2 rounds it
        multiplier = getattr(hf_config, "block_ffn_dim_multiplier", None)
        if multiplier is not None:
            multiple = positive_int(hf_config, "block_multiple_of", hf_config.architectures[0])
            size = multiple * ((int(multiplier * size) + multiple - 1) // multiple)
    return size


def _multipliers(hf_config: Any, name: str, arch: Architecture) -> dict[str, float | None]:
    """The scales a family puts on embeddings, residual branches, the softmax and the logits."""

    def positive(key: str) -> float:
        value = getattr(hf_config, key, None)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise ModelLoadError(f"{name} with {key}={value!r} is not supported; nanostream needs a positive number")
        return float(value)

    out: dict[str, float | None] = {}
    if arch.multipliers:
        out["embedding_multiplier"] = positive("embedding_multiplier")
        out["residual_multiplier"] = positive("residual_multiplier")
        out["attention_scale"] = positive("attention_multiplier")
        out["logits_divisor"] = positive("logits_scaling")
    if arch.query_pre_attn_scalar:
        out["attention_scale"] = positive("query_pre_attn_scalar") ** -0.5
    if arch.final_logit_softcap and getattr(hf_config, "final_logit_softcapping", None) is not None:
        out["final_logit_softcap"] = positive("final_logit_softcapping")
    return out
