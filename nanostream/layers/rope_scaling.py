"""The rope types that scale RoPE's frequencies, transformers' (``rope_type``): linear, llama3, yarn, longrope,
proportional.

Each gives the angles a pair of dims turns by at each position (``RopeScaling.angles``) and the factor of the
cos/sin tables; ``RopeSpec.tables`` (layers/rotary.py) builds the tables from them, each step the same
float32 op on the same values as ``transformers.modeling_rope_utils``. Reading a config's parameters into one
is layers/rope_config.py's.

Each is a frozen msgspec struct tagged by its ``rope_type``: a ``DecoderSpec`` holding one crosses the control
channel to tensor-parallel workers (engine/tp/control.py) and decodes as the same type, which a ``Protocol`` or
an untagged union of dataclasses cannot.
"""

from __future__ import annotations

import math

import msgspec
import torch


def default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    # [dim/2]: theta^(-2i/dim), the angle pair i turns by per position
    return 1.0 / base_powers(theta, dim)


def base_powers(theta: float, dim: int) -> torch.Tensor:
    # [dim/2]: theta^(2i/dim), the positions pair i takes to turn by one radian
    return theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)


class _Scaling(msgspec.Struct, frozen=True, tag_field="rope_type"):
    """A rope type's frequencies. ``angles(positions [P] float32, theta, dim)`` -> [P, dim/2] radians;
    ``table_scale``: the factor cos and sin are multiplied by (transformers' ``attention_scaling``)."""

    @property
    def rope_type(self) -> str:  # transformers' name of it: the struct's tag
        return self.__struct_config__.tag

    @property
    def table_scale(self) -> float:
        return 1.0

    def angles(self, positions: torch.Tensor, theta: float, dim: int) -> torch.Tensor:
        raise NotImplementedError


class _Uniform(_Scaling, frozen=True):
    """A rope type whose frequencies are the same at every position: ``default_inv_freq(theta, dim)``."""

    def inv_freq(self, theta: float, dim: int) -> torch.Tensor:
        raise NotImplementedError

    def angles(self, positions: torch.Tensor, theta: float, dim: int) -> torch.Tensor:
        return positions[:, None] * self.inv_freq(theta, dim)[None, :]


class LinearRopeScaling(_Uniform, frozen=True, tag="linear"):
    """rope_type "linear": every frequency divided by ``factor`` (positions slowed by it)."""

    factor: float

    def inv_freq(self, theta: float, dim: int) -> torch.Tensor:
        return default_inv_freq(theta, dim) / self.factor


class Llama3RopeScaling(_Uniform, frozen=True, tag="llama3"):
    """rope_type "llama3" (Llama 3.1+): long wavelengths slowed by ``factor``, short ones kept, those between
    interpolated."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def inv_freq(self, theta: float, dim: int) -> torch.Tensor:
        inv_freq = default_inv_freq(theta, dim)
        old_len = self.original_max_position_embeddings
        low_freq_wavelen = old_len / self.low_freq_factor
        high_freq_wavelen = old_len / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (old_len / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)


class YarnRopeScaling(_Uniform, frozen=True, tag="yarn"):
    """rope_type "yarn" (gpt-oss, Qwen's long context): fast pairs kept (extrapolated), slow ones divided by
    ``factor`` (interpolated), a linear ramp between the dims that turn ``beta_fast`` and ``beta_slow`` times in
    ``original_max_position_embeddings``; cos and sin scaled by ``attention_factor``."""

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
        powers = base_powers(theta, dim)
        low, high = self._ramp_ends(theta, dim)
        if low == high:
            high += 0.001  # a ramp of no width
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        kept = 1 - ramp  # per pair: 1 extrapolated (fast pairs), 0 interpolated (slow)
        return 1.0 / (self.factor * powers) * (1 - kept) + 1.0 / powers * kept


class ProportionalRopeScaling(_Uniform, frozen=True, tag="proportional"):
    """rope_type "proportional" (Gemma 4's full layers): the first ``rotated_pairs`` pairs of the whole head turn at
    the default frequencies over the head's dims, divided by ``factor``; the other pairs do not turn (frequency 0:
    cos 1, sin 0). Unlike a partial rotary the pairs stay (i, i + D/2) of the whole head."""

    factor: float
    rotated_pairs: int

    def inv_freq(self, theta: float, dim: int) -> torch.Tensor:
        rotated = default_inv_freq(theta, dim)[: self.rotated_pairs]
        return torch.cat((rotated, torch.zeros(dim // 2 - self.rotated_pairs))) / self.factor


class LongRopeScaling(_Scaling, frozen=True, tag="longrope"):
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

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float

    @property
    def table_scale(self) -> float:
        return self.attention_factor

    def angles(self, positions: torch.Tensor, theta: float, dim: int) -> torch.Tensor:
        powers = base_powers(theta, dim)
        short = 1.0 / (torch.tensor(self.short_factor, dtype=torch.float32) * powers)
        long = 1.0 / (torch.tensor(self.long_factor, dtype=torch.float32) * powers)
        p = positions[:, None]
        return torch.where(p < self.original_max_position_embeddings, p * short[None, :], p * long[None, :])


RopeScaling = LinearRopeScaling | Llama3RopeScaling | YarnRopeScaling | LongRopeScaling | ProportionalRopeScaling
"""The rope types that scale the frequencies (the default rope type is no scaling: ``RopeSpec.scaling`` None)."""
