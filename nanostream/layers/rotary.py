"""Rotary position embedding: the cos/sin tables, the rope types transformers scales them by, and the reference
rotation.

Every table is in one format, ``[max_position, D/2]`` float32, and rotates full rotate-half pairs ``(i, i + D/2)``
of a head of D dims; the fused attention prologue (kernels/qkv_prologue.py) reads the same tables. Families that
rotate otherwise run in it through a fixed permutation of each head's dims (``RopeSpec.head_order``):

- partial rotary (Phi-3, GLM-4: only the first ``rotary_dim`` dims rotate, pairs ``(i, i + rotary_dim/2)``), whose
  pass-through dims land on pairs with cos = 1, sin = 0;
- interleaved pairs ``(2i, 2i + 1)`` (GLM-4).

Permuting the q and k projection rows of each head alike (and their biases, and per-head q/k norm weights) once
after loading leaves q·k, so attention, unchanged: the permuted model rotates in the one format.

    spec = rope_spec(config.rope_parameters, head_dim=128, max_position_embeddings=131072,
                     allowed=("default", "yarn"), model="Qwen3ForCausalLM")
    rotary = RotaryEmbedding(128, 131072, spec)
    q, k = rotary(positions, q, k)   # q: [T, Hq, D], k: [T, Hkv, D]

The tables are bit-identical to transformers' (5.24) cos/sin, attention factor folded in as it folds it: each
step below is the same float32 op on the same values as ``transformers.modeling_rope_utils``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from nanostream.errors import ModelLoadError

RotaryFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""``(positions, q, k, cos, sin)`` -> rotated (q, k): this module's ``apply_rotary`` or a compiled form of it."""


def _inv_freq(theta: float, dim: int) -> torch.Tensor:
    # [dim/2]: theta^(-2i/dim), the angle pair i turns by per position
    return 1.0 / _base_powers(theta, dim)


def _base_powers(theta: float, dim: int) -> torch.Tensor:
    # [dim/2]: theta^(2i/dim), the positions pair i takes to turn by one radian
    return theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)


class RopeScaling(Protocol):
    """A rope type's frequencies. ``angles(positions [P] float32, theta, dim)`` -> [P, dim/2] radians;
    ``table_scale``: the factor cos and sin are multiplied by (transformers' ``attention_scaling``)."""

    rope_type: ClassVar[str]

    @property
    def table_scale(self) -> float: ...

    def angles(self, positions: torch.Tensor, theta: float, dim: int) -> torch.Tensor: ...


class _Uniform:
    """A rope type whose frequencies are the same at every position: ``inv_freq(theta, dim)``."""

    table_scale = 1.0

    def inv_freq(self, theta: float, dim: int) -> torch.Tensor:
        raise NotImplementedError

    def angles(self, positions: torch.Tensor, theta: float, dim: int) -> torch.Tensor:
        return positions[:, None] * self.inv_freq(theta, dim)[None, :]


@dataclass(frozen=True)
class LinearRopeScaling(_Uniform):
    """rope_type "linear": every frequency divided by ``factor`` (positions slowed by it)."""

    rope_type: ClassVar[str] = "linear"
    factor: float

    def inv_freq(self, theta: float, dim: int) -> torch.Tensor:
        return _inv_freq(theta, dim) / self.factor


@dataclass(frozen=True)
class Llama3RopeScaling(_Uniform):
    """rope_type "llama3" (Llama 3.1+): long wavelengths slowed by ``factor``, short ones kept, those between
    interpolated."""

    rope_type: ClassVar[str] = "llama3"
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def inv_freq(self, theta: float, dim: int) -> torch.Tensor:
        inv_freq = _inv_freq(theta, dim)
        old_len = self.original_max_position_embeddings
        low_freq_wavelen = old_len / self.low_freq_factor
        high_freq_wavelen = old_len / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (old_len / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)


@dataclass(frozen=True)
class YarnRopeScaling(_Uniform):
    """rope_type "yarn" (gpt-oss, Qwen's long context): fast pairs kept (extrapolated), slow ones divided by
    ``factor`` (interpolated), a linear ramp between the dims that turn ``beta_fast`` and ``beta_slow`` times in
    ``original_max_position_embeddings``; cos and sin scaled by ``attention_factor``."""

    rope_type: ClassVar[str] = "yarn"
    factor: float
    original_max_position_embeddings: int
    attention_factor: float
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    """Round the ramp's ends out to whole dims (gpt-oss: false)."""

    @property
    def table_scale(self) -> float:
        return self.attention_factor

    def _ramp_ends(self, theta: float, dim: int) -> tuple[float, float]:
        def dim_of(turns: float) -> float:  # the (fractional) dim that turns ``turns`` times in the original length
            return dim * math.log(self.original_max_position_embeddings / (turns * 2 * math.pi)) / (2 * math.log(theta))

        low, high = dim_of(self.beta_fast), dim_of(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, dim - 1)

    def inv_freq(self, theta: float, dim: int) -> torch.Tensor:
        powers = _base_powers(theta, dim)
        low, high = self._ramp_ends(theta, dim)
        if low == high:
            high += 0.001  # a ramp of no width
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        kept = 1 - ramp  # per pair: 1 extrapolated (fast pairs), 0 interpolated (slow)
        return 1.0 / (self.factor * powers) * (1 - kept) + 1.0 / powers * kept


@dataclass(frozen=True)
class LongRopeScaling:
    """rope_type "longrope" (Phi-3): per-pair ``short_factor`` / ``long_factor`` divide the frequencies; cos and
    sin scaled by ``attention_factor``.

    Decided per position: positions below ``original_max_position_embeddings`` take the short factors, the
    others the long ones. transformers (5.24, ``dynamic_rope_update``) decides per forward call instead: a call
    whose largest position is at or past ``original_max_position_embeddings`` rotates all of its positions with
    the long factors, any other call all with the short ones, and its KV cache keeps keys as they were rotated.
    The two agree on every sequence within ``original_max_position_embeddings``, and on transformers' generation
    of a prompt within it (decode steps past it take the long factors in both); they differ where one call
    spans the boundary (a longer prompt, or a whole-sequence forward): there transformers rotates the positions
    below it with the long factors. nanostream batches many sequences into a step and caches K, so a position's
    rotation cannot depend on the rest of its call."""

    rope_type: ClassVar[str] = "longrope"
    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float

    @property
    def table_scale(self) -> float:
        return self.attention_factor

    def angles(self, positions: torch.Tensor, theta: float, dim: int) -> torch.Tensor:
        powers = _base_powers(theta, dim)
        short = 1.0 / (torch.tensor(self.short_factor, dtype=torch.float32) * powers)
        long = 1.0 / (torch.tensor(self.long_factor, dtype=torch.float32) * powers)
        p = positions[:, None]
        return torch.where(p < self.original_max_position_embeddings, p * short[None, :], p * long[None, :])


def _dims_problem(head_dim: int, rotary_dim: int) -> str | None:
    """What keeps a head of ``head_dim`` dims rotating ``rotary_dim`` of them from the table format, or None."""
    if head_dim % 2:
        return f"head_dim {head_dim} is odd; the rotary tables pair a head's dims"
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        return f"a rotary dim of {rotary_dim} in a head of {head_dim} (it must be even, from 2 to head_dim)"
    return None


@dataclass(frozen=True)
class RopeSpec:
    """How a model rotates: ``RopeSpec(1e6)`` is plain RoPE over the whole head; ``rope_spec`` reads a config's.

    ``rotary_dim``: the dims that rotate, the head's first ones (partial_rotary_factor × head_dim); None: all.
    ``interleaved``: the model rotates pairs (2i, 2i + 1) (GLM-4), not (i, i + rotary_dim/2)."""

    theta: float
    scaling: RopeScaling | None = None
    rotary_dim: int | None = None
    interleaved: bool = False

    @property
    def rope_type(self) -> str:
        return "default" if self.scaling is None else self.scaling.rope_type

    def head_order(self, head_dim: int) -> torch.Tensor | None:
        """The permutation of a head's dims that puts this model's rotation in the table format; None: identity.

        ``order`` (LongTensor [head_dim]): rotating ``x[..., order]`` with the tables equals the model's rotation
        of ``x``, permuted: ``rotate(x[..., order]) == model_rotation(x)[..., order]``. Apply it once to each head's
        q and k projection rows, their biases and q/k norm weights (``permute_heads``). Its first half holds the
        first dim of each rotated pair, then half the pass-through dims; its second half the pairs' second dims,
        then the other pass-through dims, on which the tables hold cos = 1, sin = 0."""
        rotary_dim = self.rotary_dim or head_dim
        if rotary_dim == head_dim and not self.interleaved:
            return None
        pairs = torch.arange(rotary_dim // 2)
        first, second = (2 * pairs, 2 * pairs + 1) if self.interleaved else (pairs, pairs + rotary_dim // 2)
        passed = torch.arange(rotary_dim, head_dim).view(2, -1)
        return torch.cat((first, passed[0], second, passed[1]))

    def tables(self, head_dim: int, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [max_position, head_dim/2] float32, in the order of ``head_order``."""
        rotary_dim = self.rotary_dim or head_dim
        problem = _dims_problem(head_dim, rotary_dim)
        if problem is not None:
            raise ValueError(f"RopeSpec cannot rotate {problem}")
        positions = torch.arange(max_position).float()
        if self.scaling is None:
            angles = positions[:, None] * _inv_freq(self.theta, rotary_dim)[None, :]
            scale = 1.0
        else:
            angles, scale = self.scaling.angles(positions, self.theta, rotary_dim), self.scaling.table_scale
        cos, sin = angles.cos() * scale, angles.sin() * scale  # [P, rotary_dim/2]
        passed = (head_dim - rotary_dim) // 2  # pass-through pairs: cos 1, sin 0 leave them as they are
        cos = torch.cat((cos, torch.ones(max_position, passed)), dim=1)
        sin = torch.cat((sin, torch.zeros(max_position, passed)), dim=1)
        return cos, sin


def permute_heads(rows: torch.Tensor, order: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``rows`` (a projection's weight [H·D, in] or bias [H·D], or a per-head norm weight [D]) with each head's
    D rows in ``order``: ``permute_heads(w, order, D)[h·D + j] == w[h·D + order[j]]``. Apply once."""
    return rows.unflatten(0, (-1, head_dim))[:, order].flatten(0, 1)


ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
"""The rope types nanostream runs."""


def rope_spec(
    params: dict[str, Any],
    *,
    head_dim: int,
    max_position_embeddings: int,
    allowed: tuple[str, ...],
    model: str,
    interleaved: bool = False,
    partial_rotary: bool = False,
) -> RopeSpec:
    """The ``RopeSpec`` of one rope-parameters dict (transformers 5's ``config.rope_parameters``; Gemma 3 has one
    per layer type, the caller passes one). ``allowed``: the rope types the family may declare; ``model`` names it
    in errors. ``interleaved``: the family rotates pairs (2i, 2i + 1). ``partial_rotary``: the family's rotation
    honours ``partial_rotary_factor`` (Phi-3, GLM-4); elsewhere one other than 1 is refused. Raises
    ``ModelLoadError`` naming what nanostream cannot run exactly: another rope type, a missing key, odd dims.

    >>> rope_spec({"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}, head_dim=256,
    ...           max_position_embeddings=131072, allowed=("default", "linear"), model="Gemma3ForCausalLM")
    RopeSpec(theta=1000000.0, scaling=LinearRopeScaling(factor=8.0), rotary_dim=None, interleaved=False)"""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in allowed or rope_type not in ROPE_TYPES:
        runs = ", ".join(t for t in allowed if t in ROPE_TYPES)
        raise ModelLoadError(f"rope type {rope_type!r} is not supported for {model}; nanostream runs {runs}")
    theta = float(_need(params, "rope_theta", rope_type, model))
    partial = params.get("partial_rotary_factor")
    rotary_dim = head_dim if partial is None else int(head_dim * partial)
    if rotary_dim != head_dim and not partial_rotary:
        raise ModelLoadError(f"{model} with partial_rotary_factor={partial} is not supported; it rotates whole heads")
    problem = _dims_problem(head_dim, rotary_dim)
    if problem is not None:
        raise ModelLoadError(f"{model} rotates {problem}, which nanostream does not run")
    if rope_type == "default":
        return RopeSpec(theta, None, None if rotary_dim == head_dim else rotary_dim, interleaved)
    original = params.get("original_max_position_embeddings", max_position_embeddings)
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise ModelLoadError(f"{model} with original_max_position_embeddings={original!r}: it must be a positive int")
    scaling = _READERS[rope_type](params, rotary_dim, original, max_position_embeddings, model)
    return RopeSpec(theta, scaling, None if rotary_dim == head_dim else rotary_dim, interleaved)


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


def apply_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference. q: [T, Hq, D], k: [T, Hkv, D], positions: [T]; cos, sin: [max_position, D/2] float32."""
    cos = cos[positions][:, None, :].to(q.dtype)  # [T, 1, D/2]
    sin = sin[positions][:, None, :].to(q.dtype)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RotaryEmbedding(nn.Module):
    """cos/sin tables [max_position, D/2] (float32, also read by the fused attention prologue) built from
    ``spec``, and ``kernel``, fixed at construction, that rotates with them. Where ``spec.head_order(head_dim)``
    is not None, q and k must come in that order (their projection rows permuted once, ``permute_heads``)."""

    def __init__(self, head_dim: int, max_position: int, spec: RopeSpec, kernel: RotaryFn = apply_rotary) -> None:
        super().__init__()
        self.spec = spec
        cos, sin = spec.tables(head_dim, max_position)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.kernel = kernel

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, Hq, D], k: [T, Hkv, D], positions: [T]
        return self.kernel(positions, q, k, self.cos, self.sin)
