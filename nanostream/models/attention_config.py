"""Reading how a family's attention layers depart from plain rotary attention, from its config.json: which layers
rotate (SmolLM3's and Llama 4's ``no_rope_layers``, EXAONE 4's NoPE full-attention layers), where the QK-norms sit,
and the queries' temperature by position (layers/query_temperature.py), refusing by name what nanostream does not
run::

    fields = attention_fields(hf_config, "Exaone4ForCausalLM", ARCHITECTURES["Exaone4ForCausalLM"])
    fields["rope_layers"]   # (True, True, True, False, ...): the full-attention layers have no rotary embedding
"""

from __future__ import annotations

import math
from typing import Any

from nanostream.errors import ModelLoadError
from nanostream.layers.query_temperature import QueryTemperature
from nanostream.models.declarations import Architecture


def attention_fields(hf_config: Any, name: str, arch: Architecture, max_model_len: int) -> dict[str, Any]:
    """The ``DecoderSpec`` fields of the attention layers' departures (models/spec.py). ``max_model_len``: chunks
    at least that long hide no token, so a model whose chunks all are runs without them."""
    rope_layers = _rope_layers(hf_config, name, arch)
    temperature, layers = _query_temperature(hf_config, name, arch, rope_layers)
    return dict(
        rope_layers=rope_layers,
        qk_norm_after_rotary=arch.qk_norm_after_rotary,
        query_temperature=temperature,
        temperature_layers=layers,
        layer_chunks=_layer_chunks(hf_config, name, arch, max_model_len),
        qk_norm_layers=rope_layers if arch.weightless_qk_norm else (),
        qk_norm_weightless=arch.weightless_qk_norm,
    )


def _layer_chunks(hf_config: Any, name: str, arch: Architecture, max_model_len: int) -> tuple[int | None, ...]:
    """Each layer's attention chunk (None: full attention); empty when no chunk hides a token."""
    size = getattr(hf_config, "attention_chunk_size", None) if arch.chunked_attention else None
    if size is None:
        return ()
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ModelLoadError(f"{name} with attention_chunk_size={size!r}: nanostream needs a positive integer")
    types = hf_config.layer_types
    kinds = ("chunked_attention", "full_attention")
    if len(types) != hf_config.num_hidden_layers or any(t not in kinds for t in types):
        raise ModelLoadError(f"{name} with layer_types {types!r}: nanostream runs {' and '.join(kinds)}, one a layer")
    if size >= max_model_len:
        return ()
    return tuple(size if t == "chunked_attention" else None for t in types)


def _rope_layers(hf_config: Any, name: str, arch: Architecture) -> tuple[bool, ...]:
    """Which layers rotate; empty: all."""
    if arch.nope_full_attention:  # a hybrid config's full layers see no position but the causal mask's
        if getattr(hf_config, "sliding_window", None) is None:
            return ()
        return tuple(t != "full_attention" for t in hf_config.layer_types)
    if not arch.no_rope_layers:
        return ()
    flags = getattr(hf_config, "no_rope_layers", None)
    if flags is None:
        return ()
    if len(flags) != hf_config.num_hidden_layers or any(f not in (0, 1) for f in flags):
        raise ModelLoadError(f"{name} with no_rope_layers={flags!r}: nanostream needs a 0 or 1 per layer")
    return tuple(bool(f) for f in flags)


def _query_temperature(
    hf_config: Any, name: str, arch: Architecture, rope_layers: tuple[bool, ...]
) -> tuple[QueryTemperature | None, tuple[bool, ...]]:
    """The queries' temperature and the layers it scales (empty: all)."""
    if not arch.query_temperature:
        return None, ()
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if "llama_4_scaling_beta" in rope:  # every layer, over the original context length
        beta = _number(rope["llama_4_scaling_beta"], "rope_parameters' llama_4_scaling_beta", name)
        floor_scale = _number(rope.get("original_max_position_embeddings"), "original_max_position_embeddings", name)
        return QueryTemperature(beta, floor_scale, offset=0), ()
    if not getattr(hf_config, "attn_temperature_tuning", False):
        return None, ()
    beta = _number(getattr(hf_config, "attn_scale", None), "attn_scale", name)
    floor_scale = _number(getattr(hf_config, "floor_scale", None), "floor_scale", name)
    if floor_scale <= 0:
        raise ModelLoadError(f"{name} with floor_scale={floor_scale!r}: nanostream needs a positive number")
    layers = tuple(not r for r in rope_layers) if rope_layers else (False,) * hf_config.num_hidden_layers
    return QueryTemperature(beta, floor_scale, offset=1), layers


def _number(value: Any, key: str, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ModelLoadError(f"{name} with {key}={value!r} is not supported; nanostream needs a number")
    return float(value)
