"""Linear layers that know how to load their weights from Hugging Face checkpoints.

Fused projections (q/k/v into one ``qkv_proj``, gate/up into one ``gate_up_proj``) keep one matmul
per group; their ``load_shard`` places each checkpoint tensor at its rows.
"""

from __future__ import annotations

import torch
from torch import nn


class MergedLinear(nn.Linear):
    """Several output projections of one input stacked along the output dimension."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (offset, size)
            offset += size

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: str) -> None:
        offset, size = self.shard_offsets[shard]
        if loaded.shape[0] != size:
            raise ValueError(f"shard {shard!r} has {loaded.shape[0]} rows, expected {size}")
        param.data[offset : offset + size].copy_(loaded)
