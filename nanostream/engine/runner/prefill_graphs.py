"""CUDA graphs of the steps that prefill: the model's work between its attention calls, captured per
token-count bucket and replayed around attention run eagerly.

A step with prompt tokens in it cannot replay a decode graph: its attention depends on how the tokens
split into sequences. Launched eagerly, its 28 layers x ~12 kernels of a 0.6B model take the host
longer than the device takes to run them (on an H200 host, 20-40 ms against ~20 ms for 8,192 tokens),
so a burst of prompts goes at the host's pace, and at the pace of whatever else that host runs.
Here each layer costs the host one graph replay and its attention launches. The pieces
(``DecoderModel.head`` and ``between``) read no attention metadata, so one graph per bucket and piece
serves every split of the tokens into sequences; padding rows compute rows nobody reads.

Inputs and outputs of the pieces live in static buffers shared by every bucket (a bucket's are their
first rows); everything a piece allocates inside comes from one graph memory pool. A step of more
than ``MAX_TOKENS`` tokens runs eagerly: its device time is long enough to cover its launches.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from nanostream.layers.attention import ForwardContext
from nanostream.models.decoder import DecoderModel

log = logging.getLogger(__name__)

MAX_TOKENS = 8192  # the largest bucket


def token_buckets(max_tokens: int) -> list[int]:
    """Multiples of 16 doubling up to 1,024, then in steps of a half or a third: 16, 32, ..., 1024,
    1536, 2048, 3072, 4096, 6144, 8192, capped at ``max_tokens`` (itself the last bucket)."""
    sizes, size = [], 16
    while size < max_tokens:
        sizes.append(size)
        size = size * 2 if size < 1024 else size + (size // 2 if size & (size - 1) == 0 else size // 3)
    return [*sizes, max_tokens]


class PrefillGraphs:
    def __init__(self, model: DecoderModel, *, max_tokens: int, device: torch.device) -> None:
        self.model = model
        self.num_layers = len(model.layers)
        self.buckets = token_buckets(min(max_tokens, MAX_TOKENS))
        n, dtype = self.buckets[-1], model.embed_tokens.weight.dtype
        attn = model.layers[0].self_attn
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.qkv = torch.zeros(n, attn.qkv_proj.out_features, dtype=dtype, device=device)
        self.residual = torch.zeros(n, model.embed_tokens.weight.shape[1], dtype=dtype, device=device)
        self.attn_out = torch.zeros(n, attn.o_proj.in_features, dtype=dtype, device=device)
        # bucket -> (its graphs: the head, then one after each layer's attention; the hidden states [T, hidden])
        self.graphs: dict[int, tuple[list[torch.cuda.CUDAGraph], torch.Tensor]] = {}
        pool = torch.cuda.graph_pool_handle()
        start = time.perf_counter()
        with torch.inference_mode():  # as steps run: a compiled function's guards see one grad mode
            for size in reversed(self.buckets):  # largest first: the smaller graphs reuse its pool memory
                self.graphs[size] = self._capture(size, pool)
            for graphs, _ in self.graphs.values():  # a graph's first launch uploads it: not in a step
                for graph in graphs:
                    graph.replay()
        torch.cuda.synchronize(device)
        log.info(
            "captured prefill CUDA graphs for %d token counts up to %d (%d graphs) in %.1f s",
            len(self.buckets), n, len(self.buckets) * (self.num_layers + 1), time.perf_counter() - start,
        )  # fmt: skip

    def _capture(self, size: int, pool) -> tuple[list[torch.cuda.CUDAGraph], torch.Tensor]:
        ids, qkv, residual, attn_out = (t[:size] for t in (self.input_ids, self.qkv, self.residual, self.attn_out))

        def head() -> None:
            x, r = self.model.head(ids)
            qkv.copy_(x)
            residual.copy_(r)

        def after(i: int) -> torch.Tensor | None:
            x, r = self.model.between(i, attn_out, residual)
            if r is None:
                return x
            qkv.copy_(x)
            residual.copy_(r)
            return None

        pieces = [head] + [lambda i=i: after(i) for i in range(self.num_layers)]
        graphs, hidden = [], None
        for piece in pieces:
            piece()  # warm-up: kernel variants, cuBLAS choices
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = piece()
            graphs.append(graph)
        return graphs, hidden

    def can_run(self, num_tokens: int) -> bool:
        return num_tokens <= self.buckets[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The model on this step's packed tokens (device tensors); returns hidden [T, hidden]."""
        n = input_ids.shape[0]
        graphs, hidden = self.graphs[self.buckets[bisect.bisect_left(self.buckets, n)]]
        self.input_ids[:n].copy_(input_ids)
        qkv, attn_out = self.qkv[:n], self.attn_out[:n]
        graphs[0].replay()
        for i in range(self.num_layers):
            attn_out.copy_(self.model.attend(i, positions, qkv, ctx))
            graphs[i + 1].replay()
        return hidden[:n]
