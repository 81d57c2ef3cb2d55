"""Attention temperature tuning: the queries of a long context scaled up, by a factor that grows with the log of
the position, so that attention stays sharp far past the trained lengths.

    scale(p) = 1 + beta * log(1 + floor((p + offset) / floor_scale))

Llama 4's NoPE layers (``attn_temperature_tuning``: beta ``attn_scale``, ``floor_scale``, offset 1) and every layer
of Ministral 3 (rope parameters' ``llama_4_scaling_beta`` over ``original_max_position_embeddings``, offset 0).
The factor multiplies the queries after the rotary embedding and QK-norms, in float32, as transformers'; the keys
are stored unscaled, so a cached prefix serves any later query.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QueryTemperature:
    beta: float
    floor_scale: float
    offset: int = 0

    def __call__(self, positions: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        # positions: [T], q: [T, H, D] or [T, H * D] -> q times each token's factor, in q's dtype
        steps = torch.floor((positions.float() + self.offset) / self.floor_scale)
        scale = 1.0 + self.beta * torch.log1p(steps)  # [T] float32
        return (q * scale.view(-1, *([1] * (q.dim() - 1)))).to(q.dtype)
