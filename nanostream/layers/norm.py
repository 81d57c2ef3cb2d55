"""RMSNorm, optionally fused with the residual add that precedes it.

Families round it two ways (both with float32 statistics): Llama's casts the normalised value to the model
dtype before the weight; OLMo 2's and gpt-oss's multiply by the weight in float32 and cast the product,
and Gemma's does the same with ``1 + weight``. ``weight_offset`` says which: None for Llama's, else the
offset added to the float32 weight (0.0 or 1.0).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

RMSNormFn = Callable[..., Any]
"""``(x, weight, eps, residual=None, weight_offset=None)`` -> ``norm(x)``, or with ``residual``
``(norm(x + residual), x + residual)``: this module's ``rms_norm``, a torch.compile'd form of it, or
``nanostream.kernels.norm_act.rms_norm``."""


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float | None = None) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight_offset is None:
        return weight * xf.to(x.dtype)
    return (xf * (weight.float() + weight_offset)).to(x.dtype)


def _add_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset=None):
    x = x + residual
    return _norm(x, weight, eps, weight_offset), x


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    weight_offset: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The reference: ``norm(x)``; with ``residual``: ``(norm(x + residual), x + residual)``. x: [..., H]."""
    if residual is None:
        return _norm(x, weight, eps, weight_offset)
    return _add_norm(x, residual, weight, eps, weight_offset)


def compiled_rms_norm(compile: Callable[[Callable], Callable]) -> RMSNormFn:
    """``rms_norm`` with each of its two forms compiled by ``compile`` on its own (so each has its own
    few variants: rank, a batch of one)."""
    norm, add_norm = compile(_norm), compile(_add_norm)

    def forward(x, weight, eps, residual=None, weight_offset=None):
        if residual is None:
            return norm(x, weight, eps, weight_offset)
        return add_norm(x, residual, weight, eps, weight_offset)

    return forward


class RMSNorm(nn.Module):
    """``kernel`` (fixed at construction) computes it: the torch reference unless the model was built with
    another (``nanostream.layers.layer_kernels.LayerKernels``)."""

    def __init__(self, size: int, eps: float, kernel: RMSNormFn = rms_norm, weight_offset: float | None = None) -> None:
        super().__init__()
        self.eps, self.weight_offset = eps, weight_offset
        self.weight = nn.Parameter(torch.ones(size))
        self.kernel = kernel

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``; with ``residual``: ``(norm(x + residual), x + residual)``."""
        return self.kernel(x, self.weight, self.eps, residual, self.weight_offset)
