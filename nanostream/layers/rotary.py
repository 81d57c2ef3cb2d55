"""Rotary position embedding (the rotate-half layout of Hugging Face's Llama/Qwen/Mistral models), with
Llama 3's frequency scaling where a model declares it."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

RotaryFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""``(positions, q, k, cos, sin)`` -> rotated (q, k): this module's ``apply_rotary`` or a compiled form of it."""


@dataclass(frozen=True)
class Llama3RopeScaling:
    """``rope_scaling`` of rope_type "llama3" (Llama 3.1+): long wavelengths slowed by ``factor``, short
    ones kept, those between interpolated."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        # The steps and roundings of transformers' _compute_llama3_parameters, so the tables match bit for bit.
        old_len = self.original_max_position_embeddings
        low_freq_wavelen = old_len / self.low_freq_factor
        high_freq_wavelen = old_len / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (old_len / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)


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
    """cos/sin tables [max_position, D/2] (float32, also read by the fused attention prologue) and
    ``kernel``, fixed at construction, that rotates with them."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        scaling: Llama3RopeScaling | None = None,
        kernel: RotaryFn = apply_rotary,
    ) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if scaling is not None:
            inv_freq = scaling.apply(inv_freq)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [P, D/2]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)
        self.kernel = kernel

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, Hq, D], k: [T, Hkv, D], positions: [T]
        return self.kernel(positions, q, k, self.cos, self.sin)
