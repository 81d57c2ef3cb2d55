"""CUDA graphs of the decode step: one graph per batch-size bucket, replayed on padded batches.

A decode step launches hundreds of small kernels (28 layers x ~15 for a 0.6B model); replaying a
captured graph removes their launch gaps. Every batch size up to ``max_num_seqs`` maps to the smallest
bucket that holds it (whatever ``max_num_seqs`` is); padding rows store their K/V nowhere (slot -1)
and attend to one token. All graphs share one memory pool and one set of static input buffers, whose
block-table width covers ``max_model_len`` (a slot mapping and block tables per KV group). A model with
recurrent layers (``states``) takes each row's state slot as one more input; padding rows have slot -1 and
touch no state. A step's snapshots are the caller's to copy after the replay (``StateMetadata.decode_copies``).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

from nanostream.layers.attention_backend import AttentionMetadata
from nanostream.layers.cache_spec import StateMetadata

log = logging.getLogger(__name__)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to and including ``max_num_seqs``."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return [*sizes, max_num_seqs]


class DecodeGraphs:
    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, StateMetadata | None], torch.Tensor],
        *,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        states: bool = False,
        num_groups: int = 1,
    ) -> None:
        """``forward(input_ids, positions, meta, states)`` -> hidden states [B, hidden]: the model, graph-safe;
        ``states``: the model keeps recurrent states (its forward gets a ``StateMetadata``); ``num_groups``: its KV
        groups (a slot mapping and block tables each: ``AttentionMetadata.kv_groups``)."""
        self.buckets = batch_buckets(max_num_seqs)
        self.max_model_len = max_model_len
        n, width = max_num_seqs, -(-max_model_len // block_size)
        i32, i64 = torch.int32, torch.int64
        self.input_ids = torch.zeros(n, dtype=i64, device=device)
        self.positions = torch.zeros(n, dtype=i64, device=device)
        self.slot_mapping = torch.full((num_groups, n), -1, dtype=i64, device=device)  # [G, n]
        self.seq_lens = torch.ones(n, dtype=i32, device=device)
        self.block_tables = torch.zeros(num_groups, n, width, dtype=i32, device=device)  # [G, n, width]
        self.cu_seqlens_q = torch.arange(n + 1, dtype=i32, device=device)
        self.state_slots = torch.full((n,), -1, dtype=i64, device=device) if states else None
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = torch.cuda.graph_pool_handle()
        start = time.perf_counter()
        for bs in reversed(self.buckets):  # largest first: the smaller graphs reuse its pool memory
            meta = self._meta(bs)
            slots = None if self.state_slots is None else StateMetadata(self.state_slots[:bs], [])
            forward(self.input_ids[:bs], self.positions[:bs], meta, slots)  # warm-up: autotuning, compilation
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = forward(self.input_ids[:bs], self.positions[:bs], meta, slots)
            self.graphs[bs] = (graph, hidden)
        torch.cuda.synchronize(device)
        log.info("captured %d decode CUDA graphs in %.1f s", len(self.graphs), time.perf_counter() - start)

    def _meta(self, bs: int, group: int = 0) -> AttentionMetadata:
        others = () if group else tuple(self._meta(bs, g) for g in range(1, self.slot_mapping.shape[0]))
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[group, :bs],
            cu_seqlens_q=self.cu_seqlens_q[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[group, :bs],
            max_seqlen_q=1,
            max_seqlen_k=self.max_model_len,  # an upper bound: the same kernels serve every replay
            cu_seqlens_q_host=list(range(bs + 1)),
            seq_lens_host=[1] * bs,
            kv_groups=others,
        )

    def can_run(self, meta: AttentionMetadata, states: StateMetadata | None = None) -> bool:
        fits = meta.is_decode and len(meta.seq_lens_host) <= self.buckets[-1]
        return fits and (states is None or states.decode_copies() is not None)

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        states: StateMetadata | None = None,
    ) -> torch.Tensor:
        """Replay the bucket's graph on this decode batch (device tensors); returns hidden [B, hidden]."""
        n = input_ids.shape[0]
        bs = self.buckets[bisect.bisect_left(self.buckets, n)]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:bs].fill_(1)
        for g in range(self.slot_mapping.shape[0]):
            group = meta.group(g)
            self.slot_mapping[g, :n].copy_(group.slot_mapping)
            self.slot_mapping[g, n:bs].fill_(-1)
            # Columns past a row's last block are never read: no need to clear them.
            self.block_tables[g, :n, : group.block_tables.shape[1]].copy_(group.block_tables)
        if self.state_slots is not None:
            self.state_slots[:n].copy_(states.slots)
            self.state_slots[n:bs].fill_(-1)
        graph, hidden = self.graphs[bs]
        graph.replay()
        return hidden[:n]
