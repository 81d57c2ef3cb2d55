"""Reading a config's rope parameters (transformers 5's ``rope_parameters``) into a ``RopeSpec`` (layers/rotary.py),
with the defaults and derived values of transformers' ``_compute_<type>_parameters``; what nanostream cannot
run exactly is refused with ``ModelLoadError`` naming it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from nanostream.errors import ModelLoadError
from nanostream.layers.rope_scaling import (
    LinearRopeScaling,
    Llama3RopeScaling,
    LongRopeScaling,
    ProportionalRopeScaling,
    RopeScaling,
    YarnRopeScaling,
)
from nanostream.layers.rotary import RopeSpec, dims_problem

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic", "proportional")
"""The rope types nanostream runs; "dynamic" only with a fixed ``alpha`` (HunYuan's NTK alpha: a larger base);
"proportional" (Gemma 4) reads ``partial_rotary_factor`` as the share of the head's pairs that turn."""


def rope_spec(
    params: dict[str, Any],
    *,
    head_dim: int,
    max_position_embeddings: int,
    allowed: tuple[str, ...],
    model: str,
    interleaved: bool = False,
    partial_rotary: bool = False,
    mrope: tuple[int, int, int] | None = None,
    mrope_interleaved: bool = True,
) -> RopeSpec:
    """The ``RopeSpec`` of one rope-parameters dict (transformers 5's ``config.rope_parameters``; Gemma 3 has one
    per layer type, the caller passes one). ``allowed``: the rope types the family may declare; ``model`` names it
    in errors. ``interleaved``: the family rotates pairs (2i, 2i + 1). ``partial_rotary``: the family's rotation
    honours ``partial_rotary_factor`` (Phi-3, GLM-4); elsewhere one other than 1 is refused. ``mrope``: the family
    rotates by M-RoPE (Qwen3.5), over the params' ``mrope_section`` or, where they have none, this one (its default
    in transformers), its pairs interleaved or in three runs as ``mrope_interleaved`` says (the family's, as
    transformers fixes it per family: the config's own key is not read).
    Raises ``ModelLoadError`` naming what nanostream cannot run exactly: another rope type, a missing key, odd dims.

    >>> rope_spec({"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}, head_dim=256,
    ...           max_position_embeddings=131072, allowed=("default", "linear"), model="Gemma3ForCausalLM").scaling
    LinearRopeScaling(factor=8.0)"""
    section = None if mrope is None else _mrope_section(params.get("mrope_section", mrope), model)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in allowed or rope_type not in ROPE_TYPES:
        runs = ", ".join(t for t in allowed if t in ROPE_TYPES)
        raise ModelLoadError(f"rope type {rope_type!r} is not supported for {model}; nanostream runs {runs}")
    theta = float(_need(params, "rope_theta", rope_type, model))
    if rope_type == "proportional":  # the whole head in (i, i + D/2) pairs, the first share of them turning
        proportion, factor = float(params.get("partial_rotary_factor", 1.0)), float(params.get("factor", 1.0))
        pairs = int(proportion * head_dim // 2)  # as transformers rounds it
        if head_dim % 2 or not 0 <= pairs <= head_dim // 2:
            raise ModelLoadError(f"{model} with partial_rotary_factor={proportion} over head_dim {head_dim}")
        return RopeSpec(theta, ProportionalRopeScaling(factor, pairs), None, interleaved, section, mrope_interleaved)
    partial = params.get("partial_rotary_factor")
    rotary_dim = head_dim if partial is None else int(head_dim * partial)
    if rotary_dim != head_dim and not partial_rotary:
        raise ModelLoadError(f"{model} with partial_rotary_factor={partial} is not supported; it rotates whole heads")
    problem = dims_problem(head_dim, rotary_dim)
    if problem is not None:
        raise ModelLoadError(f"{model} rotates {problem}, which nanostream does not run")
    if rope_type == "dynamic":  # frequencies that change with the context length, unless a fixed alpha sets them
        alpha = params.get("alpha")
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0:
            raise ModelLoadError(
                f"{model} with rope type 'dynamic' and alpha={alpha!r} is not supported; nanostream runs it with a "
                "fixed positive alpha (NTK alpha scaling)"
            )
        theta, rope_type = theta * float(alpha) ** (head_dim / (head_dim - 2)), "default"
    if rope_type == "default":
        rotary = None if rotary_dim == head_dim else rotary_dim
        return RopeSpec(theta, None, rotary, interleaved, section, mrope_interleaved)
    original = params.get("original_max_position_embeddings", max_position_embeddings)
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise ModelLoadError(f"{model} with original_max_position_embeddings={original!r}: it must be a positive int")
    scaling = _READERS[rope_type](params, rotary_dim, original, max_position_embeddings, model)
    rotary = None if rotary_dim == head_dim else rotary_dim
    return RopeSpec(theta, scaling, rotary, interleaved, section, mrope_interleaved)


def _mrope_section(section: Any, model: str) -> tuple[int, int, int]:
    ints = isinstance(section, (list, tuple)) and all(type(n) is int and n >= 0 for n in section)
    if not ints or len(section) != 3:
        raise ModelLoadError(f"{model}'s mrope_section {section!r}: it must be three non-negative ints (t, h, w)")
    return tuple(section)


def _need(params: dict[str, Any], key: str, rope_type: str, model: str) -> Any:
    if key not in params:
        raise ModelLoadError(f"{model}'s rope parameters (rope type {rope_type!r}) lack {key}")
    return params[key]


# Each reader takes (params, rotary_dim, original_max_position_embeddings, max_position_embeddings, model), with
# the defaults and derived values of transformers' _compute_<type>_parameters.


def _linear(params: dict[str, Any], rotary_dim: int, original: int, max_position: int, model: str) -> RopeScaling:
    return LinearRopeScaling(float(_need(params, "factor", "linear", model)))


def _llama3(params: dict[str, Any], rotary_dim: int, original: int, max_position: int, model: str) -> RopeScaling:
    factors = (float(_need(params, k, "llama3", model)) for k in ("factor", "low_freq_factor", "high_freq_factor"))
    return Llama3RopeScaling(*factors, original_max_position_embeddings=original)


def _yarn(params: dict[str, Any], rotary_dim: int, original: int, max_position: int, model: str) -> RopeScaling:
    factor = _need(params, "factor", "yarn", model)
    factor = max_position / original if factor is None else float(factor)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1)
    truncate = bool(params.get("truncate", True))
    return YarnRopeScaling(factor, original, float(attention_factor), beta_fast, beta_slow, truncate)


def _longrope(params: dict[str, Any], rotary_dim: int, original: int, max_position: int, model: str) -> RopeScaling:
    lists = [_need(params, k, "longrope", model) for k in ("short_factor", "long_factor")]
    for name, factors in zip(("short_factor", "long_factor"), lists):
        numbers = isinstance(factors, (list, tuple)) and all(isinstance(f, (int, float)) for f in factors)
        if not numbers or len(factors) != rotary_dim // 2:
            raise ModelLoadError(f"{model}'s longrope {name} must be a list of {rotary_dim // 2} numbers (one a pair)")
    factor = params.get("factor")
    factor = max_position / original if factor is None else factor
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    short, long = (tuple(float(f) for f in factors) for factors in lists)
    return LongRopeScaling(short, long, original, float(attention_factor))


_READERS: dict[str, Callable[[dict[str, Any], int, int, int, str], RopeScaling]] = {
    "linear": _linear,
    "llama3": _llama3,
    "yarn": _yarn,
    "longrope": _longrope,
}


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
