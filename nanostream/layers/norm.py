"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

RMSNormFn = Callable[..., Any]
"""``(x, weight, eps, residual=None)`` -> ``norm(x)``, or with ``residual`` ``(norm(x + residual), x + residual)``:
this module's ``rms_norm``, a torch.compile'd form of it, or ``nanostream.kernels.norm_act.rms_norm``."""


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Statistics in float32, result cast back before the weight (as Hugging Face's models do).
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _add_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    x = x + residual
    return _norm(x, weight, eps), x


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The reference: ``norm(x)``; with ``residual``: ``(norm(x + residual), x + residual)``. x: [..., H]."""
    return _norm(x, weight, eps) if residual is None else _add_norm(x, residual, weight, eps)


def compiled_rms_norm(compile: Callable[[Callable], Callable]) -> RMSNormFn:
    """``rms_norm`` with each of its two forms compiled by ``compile`` on its own (so each has its own
    few variants: rank, a batch of one)."""
    norm, add_norm = compile(_norm), compile(_add_norm)

    def forward(x, weight, eps, residual=None):
        return norm(x, weight, eps) if residual is None else add_norm(x, residual, weight, eps)

    return forward


class RMSNorm(nn.Module):
    """``kernel`` (fixed at construction) computes it: the torch reference unless the model was built with
    another (``nanostream.layers.layer_kernels.LayerKernels``)."""

    def __init__(self, size: int, eps: float, kernel: RMSNormFn = rms_norm) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))
        self.kernel = kernel

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``; with ``residual``: ``(norm(x + residual), x + residual)``."""
        return self.kernel(x, self.weight, self.eps, residual)
