"""Linear layers that load their rows of Hugging Face checkpoints, and their tensor-parallel forms (Megatron).

- ``MergedColumnLinear``: several projections of one input stacked along the output (q/k/v into one
  ``qkv_proj``, gate/up into one ``gate_up_proj``), one matmul per group. Each part is a range of its
  checkpoint tensor's rows: all of them on one GPU, this rank's heads or features with tensor parallelism
  (column parallel: no communication, each rank's output is its own heads).
- ``RowParallelLinear``: the input features are split over the ranks (o_proj's heads, down_proj's
  intermediate features); each rank multiplies its columns and one all-reduce sums the parts.
  ``row_parallel_linear`` builds a plain ``nn.Linear`` at one rank, so a single GPU runs what it always ran.

``load_shard`` / ``load_weight`` take a safetensors slice (``safe_open(...).get_slice(name)``), so a rank
reads only its rows or columns of the file. Each is a ``Linear``, whose weight may stay FP8 with its scales
(layers/fp8_linear.py: ``keep_fp8``); ``load_fp8`` then places a checkpoint's FP8 rows (or columns) and their
scales together, a block's scale with the block.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from nanostream.distributed.group import TensorParallel
from nanostream.layers.activation import SiluAndMul
from nanostream.layers.fp8_linear import fp8_linear, fp8_linear_add_norm, gemv_runs, norm_fuses
from nanostream.layers.norm import RMSNorm

if TYPE_CHECKING:
    from nanostream.kernels.fp8_gemv import PendingNorm

TensorSlice = Any
"""A safetensors slice (``get_slice``) or a tensor: ``x[a:b]``, ``x[:, a:b]`` and ``x[:]`` read that part."""

Gemm = Callable[..., torch.Tensor]
"""``(x, weight, bias=None)`` -> ``x @ weight.T + bias``: ``F.linear``, or the batch-invariant mode's
``layers.batch_invariant.invariant_linear`` (``LayerKernels.linear``)."""


def _rows(loaded: TensorSlice) -> int:
    return loaded.get_shape()[0] if hasattr(loaded, "get_shape") else loaded.shape[0]


class Linear(nn.Linear):
    """``nn.Linear`` whose weight may be FP8 (``keep_fp8``: ``weight_scale`` per ``fp8_block``); ``gemm``
    multiplies an unquantized one."""

    def __init__(self, in_features: int, out_features: int, bias: bool, gemm: Gemm = F.linear) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.register_parameter("weight_scale", None)
        self.fp8_block: tuple[int, int] | None = None
        self.gemm = gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor | PendingNorm, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.fp8_block is None:
            return self.gemm(x, self.weight, bias)
        return fp8_linear(x, self.weight, self.weight_scale, self.fp8_block, bias)

    def into_norm(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, then: Linear
    ) -> tuple[torch.Tensor | PendingNorm, torch.Tensor]:
        """``(self(x), residual)``; or, where this layer's one-token FP8 GEMV can end in the residual add and
        ``norm`` that follow it and ``then`` (the projection after ``norm``) runs one too (``norm_fuses``), the
        norm done here but for its 1 / rms, which ``then``'s GEMV applies: (a ``PendingNorm``, x + residual).
        A decoder layer's o_proj and down_proj: a batch-1 step's kernels between projections take ~2 us."""
        if (
            self.fp8_block is not None
            and then.fp8_block is not None
            and norm_fuses(x, residual, self.fp8_block, self.out_features, then.fp8_block)
        ):
            return fp8_linear_add_norm(x, self.weight, self.weight_scale, self.fp8_block, self.bias, residual, norm)
        return self(x), residual

    def can_keep_fp8(self, block: tuple[int, int]) -> bool:
        """Whether this layer's rows and columns of the checkpoint start and end on ``block``'s edges."""
        return True

    def load_fp8(self, loaded: TensorSlice, scale: torch.Tensor, block: tuple[int, int], shard: str | None) -> None:
        """A checkpoint's FP8 weight (``loaded`` [out, in]) and its ``scale`` per ``block`` into this kept layer."""
        self.put_fp8(loaded, scale, block, range(self.weight.shape[0]), 0)

    @torch.no_grad()
    def put_fp8(
        self, loaded: TensorSlice, scale: torch.Tensor, block: tuple[int, int], rows: range, at: int,
        columns: range | None = None,
    ) -> None:  # fmt: skip
        """``rows`` (and ``columns``) of an FP8 checkpoint weight to this layer's rows from ``at``, their scales
        (``scale`` per ``block``: the checkpoint's blocks, a row's or the tensor's) to those rows' scales."""
        part = (
            loaded[rows.start : rows.stop]
            if columns is None
            else loaded[rows.start : rows.stop, columns.start : columns.stop]
        )
        if tuple(part.shape) != (len(rows), self.weight.shape[1]):
            raise ValueError(
                f"checkpoint part of shape {tuple(part.shape)}, expected {(len(rows), self.weight.shape[1])}"
            )
        self.weight.data[at : at + len(rows)].copy_(part)
        bo, bi = self.fp8_block
        s = scale.float().reshape(scale.shape[-2:] if scale.dim() >= 2 else (1, 1))
        if bo == 1:  # one scale per row: a row's or the tensor's, for each of these rows
            s = s.repeat_interleave(block[0], dim=0)[rows.start : rows.stop]
        else:  # the checkpoint's blocks, whole (rows and columns start on their edges)
            s = s[rows.start // bo : -(-rows.stop // bo)]
            if columns is not None:
                s = s[:, columns.start // bi : -(-columns.stop // bi)]
        self.weight_scale.data[at // bo : at // bo + s.shape[0]].copy_(s)


class MergedColumnLinear(Linear):
    """Projections of one input stacked along the output dimension.

    ``parts`` maps each checkpoint projection to the rows of it this layer holds and that tensor's full
    row count: ``{"q": (range(0, 512), 1024), ...}`` is the first half of a 1024-row q_proj. Parts named
    ``name.*`` come from one checkpoint tensor (shard ``name``), one after the other in it: Qwen3.5's
    ``in_proj_qkv`` is parts ``qkv.q``, ``qkv.k``, ``qkv.v``, each split over the ranks on its own."""

    def __init__(
        self, in_features: int, parts: dict[str, tuple[range, int]], bias: bool, gemm: Gemm = F.linear
    ) -> None:
        super().__init__(in_features, sum(len(rows) for rows, _ in parts.values()), bias, gemm)
        self.shard_offsets: dict[str, int] = {}  # part -> its first row here
        self.parts = parts
        offset = 0
        for name, (rows, _) in parts.items():
            self.shard_offsets[name] = offset
            offset += len(rows)

    def activated(self, x: torch.Tensor, act: SiluAndMul) -> torch.Tensor:
        """``act(self(x))``: one kernel where an FP8 weight's one-token GEMV runs (the activation its epilogue,
        nanostream/kernels/fp8_gemv.py), else this layer's and the activation's."""
        if self.fp8_block is not None and gemv_runs(x, self.fp8_block):
            return fp8_linear(x, self.weight, self.weight_scale, self.fp8_block, self.bias, act.activation)
        return act(self(x))

    def can_keep_fp8(self, block: tuple[int, int]) -> bool:
        bo = block[0]
        return all(r.start % bo == 0 and len(r) % bo == 0 for r, _ in self.parts.values())

    def load_fp8(
        self, loaded: TensorSlice, scale: torch.Tensor, block: tuple[int, int], shard: str | None
    ) -> list[str]:
        """One checkpoint tensor's FP8 rows and scales (``shard``: a part or a group of them; None: a tensor that
        fuses every part); the parts filled."""
        names, start = self._group(shard), 0
        for name in names:
            rows, total = self.parts[name]
            self.put_fp8(loaded, scale, block, range(start + rows.start, start + rows.stop), self.shard_offsets[name])
            start += total
        return names

    def load_shard(self, param: nn.Parameter, loaded: TensorSlice, shard: str) -> list[str]:
        """The rows of ``shard`` (a part, or the parts ``shard.*`` of one tensor) from ``loaded``; the parts filled."""
        return self._load(param, loaded, self._group(shard))

    def load_weight(self, param: nn.Parameter, loaded: TensorSlice) -> list[str]:
        """A checkpoint that fuses the parts already (Phi-3's ``qkv_proj``, GLM-4's ``gate_up_proj``): each
        part's rows, in ``parts`` order, from its place in the fused tensor; the parts it filled."""
        return self._load(param, loaded, self._group(None))

    def _group(self, shard: str | None) -> list[str]:
        """The parts one checkpoint tensor holds, in order: ``shard`` or the parts ``shard.*``; None: every part."""
        if shard is None:
            return list(self.parts)
        names = [n for n in self.parts if n == shard or n.startswith(shard + ".")]
        if not names:
            raise ValueError(f"no part {shard!r} here, only {', '.join(self.parts)}")
        return names

    def _load(self, param: nn.Parameter, loaded: TensorSlice, names: list[str]) -> list[str]:
        expected = sum(self.parts[n][1] for n in names)
        if _rows(loaded) != expected:
            raise ValueError(f"a tensor of {_rows(loaded)} rows for {', '.join(names)}, expected {expected}")
        start = 0
        for name in names:
            (rows, total), offset = self.parts[name], self.shard_offsets[name]
            param.data[offset : offset + len(rows)].copy_(loaded[start + rows.start : start + rows.stop])
            start += total
        return names


class RowParallelLinear(Linear):
    """``columns`` of a linear layer's input features; the partial products of the ranks are summed.

    The bias, whole on every rank, is added once, after the sum."""

    def __init__(
        self, columns: range, out_features: int, bias: bool, tp: TensorParallel, gemm: Gemm = F.linear
    ) -> None:
        super().__init__(len(columns), out_features, bias, gemm)
        self.columns, self.tp = columns, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in / size] -> [T, out]
        y = self.tp.all_reduce(self.matmul(x))
        return y if self.bias is None else y.add_(self.bias)

    def into_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, then: Linear):
        return self(x), residual  # the residual adds the ranks' sum

    def can_keep_fp8(self, block: tuple[int, int]) -> bool:
        bi = block[1]
        return self.columns.start % bi == 0 and len(self.columns) % bi == 0

    def load_fp8(self, loaded: TensorSlice, scale: torch.Tensor, block: tuple[int, int], shard: str | None) -> None:
        self.put_fp8(loaded, scale, block, range(self.weight.shape[0]), 0, self.columns)

    def load_weight(self, param: nn.Parameter, loaded: TensorSlice) -> None:
        part = loaded[:, self.columns.start : self.columns.stop] if param is self.weight else loaded[:]
        if part.shape != param.shape:
            raise ValueError(f"checkpoint part of shape {tuple(part.shape)}, parameter {tuple(param.shape)}")
        param.data.copy_(part)


def row_parallel_linear(
    columns: range, out_features: int, bias: bool, tp: TensorParallel, gemm: Gemm = F.linear
) -> Linear:
    """``RowParallelLinear`` over ``columns``, or at one rank the plain layer (no collective)."""
    if tp.size == 1:
        return Linear(len(columns), out_features, bias, gemm)
    return RowParallelLinear(columns, out_features, bias, tp, gemm)
