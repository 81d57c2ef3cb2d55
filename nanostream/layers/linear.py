"""Linear layers that load their rows of Hugging Face checkpoints, and their tensor-parallel forms (Megatron).

- ``MergedColumnLinear``: several projections of one input stacked along the output (q/k/v into one
  ``qkv_proj``, gate/up into one ``gate_up_proj``), one matmul per group. Each part is a range of its
  checkpoint tensor's rows: all of them on one GPU, this rank's heads or features with tensor parallelism
  (column parallel: no communication, each rank's output is its own heads).
- ``RowParallelLinear``: the input features are split over the ranks (o_proj's heads, down_proj's
  intermediate features); each rank multiplies its columns and one all-reduce sums the parts.
  ``row_parallel_linear`` builds a plain ``nn.Linear`` at one rank, so a single GPU runs what it always ran.

``load_shard`` / ``load_weight`` take a safetensors slice (``safe_open(...).get_slice(name)``), so a rank
reads only its rows or columns of the file.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nanostream.distributed.group import TensorParallel

TensorSlice = Any
"""A safetensors slice (``get_slice``) or a tensor: ``x[a:b]``, ``x[:, a:b]`` and ``x[:]`` read that part."""


def _rows(loaded: TensorSlice) -> int:
    return loaded.get_shape()[0] if hasattr(loaded, "get_shape") else loaded.shape[0]


class MergedColumnLinear(nn.Linear):
    """Projections of one input stacked along the output dimension.

    ``parts`` maps each checkpoint projection to the rows of it this layer holds and that tensor's full
    row count: ``{"q": (range(0, 512), 1024), ...}`` is the first half of a 1024-row q_proj."""

    def __init__(self, in_features: int, parts: dict[str, tuple[range, int]], bias: bool) -> None:
        super().__init__(in_features, sum(len(rows) for rows, _ in parts.values()), bias=bias)
        self.shard_offsets: dict[str, int] = {}  # part -> its first row here
        self.parts = parts
        offset = 0
        for name, (rows, _) in parts.items():
            self.shard_offsets[name] = offset
            offset += len(rows)

    def load_shard(self, param: nn.Parameter, loaded: TensorSlice, shard: str) -> None:
        (rows, total), offset = self.parts[shard], self.shard_offsets[shard]
        if _rows(loaded) != total:
            raise ValueError(f"shard {shard!r} has {_rows(loaded)} rows, expected {total}")
        param.data[offset : offset + len(rows)].copy_(loaded[rows.start : rows.stop])

    def load_weight(self, param: nn.Parameter, loaded: TensorSlice) -> list[str]:
        """A checkpoint that fuses the parts already (Phi-3's ``qkv_proj``, GLM-4's ``gate_up_proj``): each
        part's rows, in ``parts`` order, from its place in the fused tensor; the parts it filled."""
        expected = sum(total for _, total in self.parts.values())
        if _rows(loaded) != expected:
            raise ValueError(f"a fused tensor of {_rows(loaded)} rows, expected {expected} ({', '.join(self.parts)})")
        start = 0
        for name, (rows, total) in self.parts.items():
            offset = self.shard_offsets[name]
            param.data[offset : offset + len(rows)].copy_(loaded[start + rows.start : start + rows.stop])
            start += total
        return list(self.parts)


class RowParallelLinear(nn.Linear):
    """``columns`` of a linear layer's input features; the partial products of the ranks are summed.

    The bias, whole on every rank, is added once, after the sum."""

    def __init__(self, columns: range, out_features: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__(len(columns), out_features, bias=bias)
        self.columns, self.tp = columns, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in / size] -> [T, out]
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y.add_(self.bias)

    def load_weight(self, param: nn.Parameter, loaded: TensorSlice) -> None:
        part = loaded[:, self.columns.start : self.columns.stop] if param is self.weight else loaded[:]
        if part.shape != param.shape:
            raise ValueError(f"checkpoint part of shape {tuple(part.shape)}, parameter {tuple(param.shape)}")
        param.data.copy_(part)


def row_parallel_linear(columns: range, out_features: int, bias: bool, tp: TensorParallel) -> nn.Linear:
    """``RowParallelLinear`` over ``columns``, or at one rank the plain layer (no collective)."""
    if tp.size == 1:
        return nn.Linear(len(columns), out_features, bias=bias)
    return RowParallelLinear(columns, out_features, bias, tp)
