"""The embedding table and the LM head split by vocabulary over tensor-parallel ranks.

Each rank holds the rows of ``vocab`` (a contiguous range of token ids). The embedding looks up the
tokens it holds, gives zeros for the others, and one all-reduce sums the ranks' lookups; the LM head
multiplies the hidden states by its rows and one gather puts the logits side by side on rank 0, the rank
that samples. ``vocab_embedding`` and ``lm_head`` build the plain layers at one rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanostream.distributed.group import TensorParallel
from nanostream.layers.linear import Gemm, TensorSlice


def _load_rows(param: nn.Parameter, loaded: TensorSlice, vocab: range) -> None:
    part = loaded[vocab.start : vocab.stop]
    if part.shape != param.shape:
        raise ValueError(f"checkpoint rows of shape {tuple(part.shape)}, parameter {tuple(param.shape)}")
    param.data.copy_(part)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab: range, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.vocab, self.tp = vocab, tp
        self.weight = nn.Parameter(torch.empty(len(vocab), hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, hidden]; masks, no branches: capturable in a CUDA graph
        local = input_ids - self.vocab.start
        outside = (local < 0) | (local >= len(self.vocab))
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill_(outside[:, None], 0))

    def load_weight(self, param: nn.Parameter, loaded: TensorSlice) -> None:
        _load_rows(param, loaded, self.vocab)


class LMHead(nn.Module):
    """hidden [B, H] -> logits [B, V] by ``gemm`` (``F.linear``, or the batch-invariant mode's)."""

    def __init__(self, vocab_size: int, hidden_size: int, gemm: Gemm = F.linear) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        self.gemm = gemm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.gemm(hidden, self.weight)  # None only from ParallelLMHead's other ranks


class ParallelLMHead(LMHead):
    """``forward``: logits [B, V] on rank 0, None on the other ranks (their rows went to rank 0)."""

    def __init__(self, vocab: range, hidden_size: int, tp: TensorParallel, gemm: Gemm = F.linear) -> None:
        super().__init__(len(vocab), hidden_size, gemm)
        self.vocab, self.tp = vocab, tp

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        # hidden: [B, hidden] -> this rank's logits [B, V / size] -> [B, V] on rank 0
        return self.tp.gather_last_dim(self.gemm(hidden, self.weight))

    def load_weight(self, param: nn.Parameter, loaded: TensorSlice) -> None:
        _load_rows(param, loaded, self.vocab)


def vocab_embedding(vocab: range, hidden_size: int, tp: TensorParallel) -> nn.Module:
    return nn.Embedding(len(vocab), hidden_size) if tp.size == 1 else VocabParallelEmbedding(vocab, hidden_size, tp)


def lm_head(vocab: range, hidden_size: int, tp: TensorParallel, gemm: Gemm = F.linear) -> LMHead:
    return LMHead(len(vocab), hidden_size, gemm) if tp.size == 1 else ParallelLMHead(vocab, hidden_size, tp, gemm)
