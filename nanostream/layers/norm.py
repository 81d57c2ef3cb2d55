"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))
        self.kernel: Callable[..., Any] | None = None  # set by the runner: nanostream.kernels.norm_act.rms_norm

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in float32, result cast back before the weight (as Hugging Face's Qwen models do).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``; with ``residual``: ``(norm(x + residual), x + residual)``."""
        if self.kernel is not None:
            return self.kernel(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
