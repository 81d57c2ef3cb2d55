"""RMSNorm, optionally fused with the residual add that precedes it.

Families round it two ways (both with float32 statistics): Llama's casts the normalised value to the model
dtype before the weight; OLMo 2's and gpt-oss's multiply by the weight in float32 and cast the product,
and Gemma's does the same with ``1 + weight``. ``weight_offset`` says which: None for Llama's, else the
offset added to the float32 weight (0.0 or 1.0).

A norm over a vector split over tensor-parallel ranks (the QK-norms over the whole q and k projections of OLMo 2
and MiniMax-M2) is a ``ShardedRMSNorm`` per rank, normed together by ``sharded_qk_norms``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from nanostream.distributed.group import TensorParallel
    from nanostream.layers.linear import TensorSlice

RMSNormFn = Callable[..., Any]
"""``(x, weight, eps, residual=None, weight_offset=None)`` -> ``norm(x)``, or with ``residual``
``(norm(x + residual), x + residual)``: this module's ``rms_norm``, a torch.compile'd form of it, or
``nanostream.kernels.norm_act.rms_norm``."""


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float | None = None) -> torch.Tensor:
    xf = x.float()
    return _scaled(x, xf, xf.pow(2).mean(-1, keepdim=True), weight, eps, weight_offset)


def _scaled(x: torch.Tensor, xf: torch.Tensor, mean_square: torch.Tensor, weight: torch.Tensor, eps: float,
            weight_offset: float | None) -> torch.Tensor:  # fmt: skip
    xf = xf * torch.rsqrt(mean_square + eps)
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
    another (``nanostream.layers.layer_kernels.LayerKernels``). ``learned=False``: no weight to load (ones, a
    buffer: Llama 4's weightless QK-norm)."""

    def __init__(
        self, size: int, eps: float, kernel: RMSNormFn = rms_norm, weight_offset: float | None = None,
        *, learned: bool = True,
    ) -> None:  # fmt: skip
        super().__init__()
        self.eps, self.weight_offset = eps, weight_offset
        if learned:
            self.weight = nn.Parameter(torch.ones(size))
        else:
            self.register_buffer("weight", torch.ones(size), persistent=False)
        self.kernel = kernel

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``; with ``residual``: ``(norm(x + residual), x + residual)``."""
        return self.kernel(x, self.weight, self.eps, residual, self.weight_offset)


class ShardedRMSNorm(RMSNorm):
    """``rows`` of an RMSNorm over a vector split over ranks (all of them at one rank, where it is the plain norm):
    this rank's part of its weight, read from the checkpoint's whole one. ``sharded_qk_norms`` norms over ranks."""

    def __init__(self, rows: range, eps: float, kernel: RMSNormFn = rms_norm, weight_offset: float | None = None):
        super().__init__(len(rows), eps, kernel, weight_offset)
        self.rows = rows

    def load_weight(self, param: nn.Parameter, loaded: TensorSlice) -> None:
        part = loaded[self.rows.start : self.rows.stop]
        if tuple(part.shape) != tuple(param.shape):
            raise ValueError(f"a norm weight of shape {tuple(part.shape)} for this rank's {len(self.rows)} rows")
        param.data.copy_(part)


def sharded_qk_norms(
    q: torch.Tensor, k: torch.Tensor, q_norm: ShardedRMSNorm, k_norm: ShardedRMSNorm, tp: TensorParallel
) -> tuple[torch.Tensor, torch.Tensor]:
    """The QK-norms over the whole q and k projections, of this rank's rows q [T, Hq/n D] and k [T, Hkv/n D]: at one
    rank the norms themselves. Over ranks a vector's mean of squares is the ranks' mean of theirs, each holding as
    many of its dims (or, with fewer KV heads than ranks, each KV head as often): one all-reduce of [T, 2]."""
    if tp.size == 1:
        return q_norm(q), k_norm(k)
    qf, kf = q.float(), k.float()
    mean_square = tp.all_reduce(torch.stack((qf.pow(2).mean(-1), kf.pow(2).mean(-1)), dim=-1)) / tp.size  # [T, 2]
    return tuple(
        _scaled(x, xf, mean_square[:, i : i + 1], norm.weight, norm.eps, norm.weight_offset)
        for i, (x, xf, norm) in enumerate(((q, qf, q_norm), (k, kf, k_norm)))
    )
