"""Runs the model on a device: loads it, sizes and owns the KV pool, packs a step's batch, samples.

The runner knows nothing of scheduling: it gets the step's chunks (which tokens of which sequences
to compute) and returns the token sampled for every sequence whose chunk reached its end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nanostream.config import EngineConfig
from nanostream.engine.cuda_graphs import DecodeGraphs
from nanostream.engine.sampler import SamplerOutput, SamplingBatch, sample
from nanostream.engine.scheduler import ScheduledChunk
from nanostream.engine.sequence import PENDING, Sequence
from nanostream.errors import ModelLoadError
from nanostream.layers.attention import AttentionMetadata, KVCache, get_backend
from nanostream.layers.norm import RMSNorm
from nanostream.layers.rotary import RotaryEmbedding
from nanostream.models import build_model
from nanostream.models.loader import load_weights
from nanostream.models.qwen import ForwardContext, SiluAndMul
from nanostream.sampling_params import SamplingParams

log = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 1 << 30


@dataclass
class SampledToken:
    token_id: int
    logprobs: dict[int, float] | None  # sampled token and the top-N, when the request asked


@dataclass
class InFlight:
    """A launched step whose samples are still on the device."""

    seqs: list[Sequence]  # the sequences that sample, in row order
    rows: dict[str, int]  # request id -> row of ``out``
    out: SamplerOutput | None  # on the device (the next step reads pending tokens from it); None: no samples
    host: SamplerOutput | None = None  # the same, being copied into pinned host memory
    copied: torch.cuda.Event | None = None  # recorded after those copies (CUDA only)


def _copy_to_host(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config: Any, model_path: Path) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.dtype)
        self.block_size = config.kvcache_block_size
        with _default_dtype(self.dtype), torch.device(self.device):
            self.model = build_model(hf_config)
        load_weights(self.model, model_path)
        self.model.eval()
        self.spec = self.model.spec
        self.vocab_size = self.spec.vocab_size
        cuda = self.device.type == "cuda"
        self.backend = get_backend(
            config.attention_backend,
            self.device,
            dtype=self.dtype,
            block_size=self.block_size,
            head_dim=self.spec.head_dim,
        )
        if self.backend.prologue is not None:
            # Triton runs here: the norms and SiLU-and-mul take its kernels too (one launch each, where a
            # compiled module's call costs its guards on the host; the model runs eagerly at prefill), and
            # the prologue does the rotary embedding: nothing is left for torch.compile.
            from nanostream.kernels.norm_act import rms_norm, silu_and_mul

            for module in self.model.modules():
                if isinstance(module, RMSNorm):
                    module.kernel = rms_norm
                elif isinstance(module, SiluAndMul):
                    module.kernel = silu_and_mul
        elif cuda and config.torch_compile:
            # Elementwise chains (norms, rotary, SiLU-and-mul) fuse into one kernel each. The modules of a
            # class share one compile cache, and its variants (rank, residual or not, a batch of one) pass
            # dynamo's default limit of 8, past which calls silently run uncompiled.
            import torch._dynamo as dynamo

            dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, 64)
            for module in self.model.modules():
                if isinstance(module, RMSNorm | RotaryEmbedding | SiluAndMul):
                    module.compile(dynamic=True)
        self.graphs: DecodeGraphs | None = None  # captured once the KV pool exists
        self.num_kv_blocks = self._num_kv_blocks()
        self.kv_caches = self._allocate_kv(self.num_kv_blocks)
        if cuda and not config.enforce_eager and self.backend.supports_cuda_graphs:
            self.graphs = DecodeGraphs(
                self._forward,
                max_num_seqs=config.max_num_seqs,
                max_model_len=config.max_model_len,
                block_size=self.block_size,
                device=self.device,
            )

    # ---- KV pool -------------------------------------------------------------------------------

    @property
    def kv_block_bytes(self) -> int:
        s = self.spec
        return 2 * s.num_layers * self.block_size * s.num_kv_heads * s.head_dim * self.dtype.itemsize

    def _allocate_kv(self, num_blocks: int) -> list[KVCache]:
        s = self.spec
        shape = (2, s.num_layers, num_blocks, self.block_size, s.num_kv_heads, s.head_dim)
        pool = torch.zeros(shape, dtype=self.dtype, device=self.device)
        return [KVCache(pool[0, i], pool[1, i]) for i in range(s.num_layers)]

    def _num_kv_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kvcache_blocks is not None:
            return cfg.num_kvcache_blocks
        if cfg.kv_cache_memory_bytes is not None:
            budget = cfg.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = self._cuda_kv_budget()
        else:
            # CPU memory is shared with everything else: never more than the engine can ever fill.
            most = cfg.max_num_seqs * -(-cfg.max_model_len // self.block_size)
            budget = min(CPU_DEFAULT_KV_BYTES, most * self.kv_block_bytes)
        num_blocks = budget // self.kv_block_bytes
        if num_blocks < 1:
            raise ModelLoadError(
                f"no room for a single KV block of {self.kv_block_bytes} bytes (budget {budget} bytes); "
                "raise gpu_memory_utilization or kv_cache_memory_bytes, or lower kvcache_block_size"
            )
        return num_blocks

    def _cuda_kv_budget(self) -> int:
        """Bytes left for KV after the worst step: total * utilisation - (everything else at peak).

        The worst step is a mixed one, as the scheduler makes them: a decode row first, then prompts
        filling ``max_num_batched_tokens``. Running it also builds what a mixed step needs on first use
        (FlashAttention-4 compiles its decode and prefill variants, seconds each), here and not in the
        middle of serving."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        cfg = self.config
        seq_len = min(cfg.max_model_len, cfg.max_num_batched_tokens)
        num_seqs = max(1, min(cfg.max_num_batched_tokens // seq_len, cfg.max_num_seqs))
        blocks_per_seq = -(-seq_len // self.block_size)
        self.kv_caches = self._allocate_kv(num_seqs * blocks_per_seq)

        def warmup_chunk(i: int, num_tokens: int, num_computed: int = 0) -> ScheduledChunk:
            seq = Sequence(
                f"warmup-{i}",
                [0] * (num_computed + num_tokens),
                SamplingParams(),
                max_tokens=1,
                sampling_seed=0,
                stop_token_ids=frozenset(),
            )
            seq.num_computed_tokens = num_computed
            seq.block_table = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
            return ScheduledChunk(seq, num_tokens)

        chunks = [warmup_chunk(i, seq_len) for i in range(num_seqs)]
        if seq_len > 1 and num_seqs < cfg.max_num_seqs:
            # The decode row reads one token of context from the last prompt's blocks (not yet written:
            # only the kernels' shapes matter), and takes its token from the first prompt.
            decode = warmup_chunk(num_seqs - 1, 1, num_computed=1)
            chunks = [decode, warmup_chunk(0, seq_len - 1), *chunks[1:]]
        self.execute(chunks)
        del self.kv_caches
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        stats = torch.cuda.memory_stats(self.device)
        peak, current = stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]
        # Memory in use now (weights, other processes), plus what the worst forward pass adds at its peak.
        used = total - free + peak - current
        return int(total * cfg.gpu_memory_utilization - used)

    # ---- one step ------------------------------------------------------------------------------

    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        if self.device.type != "cuda":
            return torch.tensor(data, dtype=dtype, device=self.device)
        # Through pinned memory, so the copy is asynchronous: the step's only sync is reading the samples.
        return torch.tensor(data, dtype=dtype, pin_memory=True).to(self.device, non_blocking=True)

    def _tensors(self, dtype: torch.dtype, *parts: list) -> list[torch.Tensor]:
        """Flat host lists as device tensors of one dtype, sent in one copy; each a view of it that starts
        on a 16-element boundary (64 bytes or more), as kernels that assume aligned pointers need."""
        flat: list = []
        sizes = []
        for part in parts:
            sizes.append(len(part))
            flat += part
            flat += [0] * (-len(part) % 16)
        buffer = self._tensor(flat, dtype)
        views, offset = [], 0
        for n in sizes:
            views.append(buffer[offset : offset + n])
            offset += n + (-n % 16)
        return views

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, ForwardContext(meta, self.kv_caches, self.backend))

    def prepare(
        self, chunks: list[ScheduledChunk], prev: InFlight | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Pack the chunks into one varlen batch. A PENDING input token is read from ``prev``'s samples."""
        bs = self.block_size
        pending: list[tuple[int, int]] = []  # (row of input_ids, row of prev's samples)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_q, seq_lens, sample_rows = [0], [], []
        for chunk in chunks:
            seq, start = chunk.seq, chunk.start
            end = start + chunk.num_new_tokens
            for i in range(max(start, end - 2), end):  # only a sequence's last two tokens can be pending
                if seq.token_ids[i] == PENDING:
                    assert prev is not None, f"{seq} has a pending token but no step is in flight"
                    pending.append((len(input_ids) + i - start, prev.rows[seq.request_id]))
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            for b in range(start // bs, (end - 1) // bs + 1):  # slots, one block range at a time
                base = seq.block_table[b] * bs - b * bs
                slots += range(base + max(start, b * bs), base + min(end, (b + 1) * bs))
            cu_q.append(cu_q[-1] + chunk.num_new_tokens)
            seq_lens.append(end)
            if chunk.samples:
                sample_rows.append(cu_q[-1] - 1)
        width = max(len(c.seq.block_table) for c in chunks)
        tables: list[int] = []
        for c in chunks:
            tables += c.seq.block_table
            tables += [0] * (width - len(c.seq.block_table))
        for row, _ in pending:
            input_ids[row] = 0  # a placeholder id; the device copy below overwrites it
        rows, prev_rows = (list(x) for x in zip(*pending)) if pending else ([], [])
        # Two copies up, one per dtype, instead of one per tensor.
        ids, pos, slot_mapping, rows_t, prev_rows_t = self._tensors(
            torch.int64, input_ids, positions, slots, rows, prev_rows
        )
        cu_seqlens_q, seq_lens_t, block_tables = self._tensors(torch.int32, cu_q, seq_lens, tables)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            cu_seqlens_q=cu_seqlens_q,
            seq_lens=seq_lens_t,
            block_tables=block_tables.view(len(chunks), width),
            max_seqlen_q=max(c.num_new_tokens for c in chunks),
            max_seqlen_k=max(seq_lens),
            cu_seqlens_q_host=cu_q,
            seq_lens_host=seq_lens,
        )
        if pending:  # on the device, after the step in flight has sampled them: no host round trip
            ids[rows_t] = prev.out.token_ids[prev_rows_t]
        return ids, pos, meta, sample_rows

    @torch.inference_mode()
    def launch(self, chunks: list[ScheduledChunk], prev: InFlight | None = None) -> InFlight:
        """Queue the step on the device (inputs, model, sampling) without waiting for it."""
        input_ids, positions, meta, sample_rows = self.prepare(chunks, prev)
        if self.graphs is not None and self.graphs.can_run(meta):
            hidden = self.graphs.run(input_ids, positions, meta)
        else:
            hidden = self._forward(input_ids, positions, meta)
        seqs = [c.seq for c in chunks if c.samples]
        if not seqs:
            return InFlight([], {}, None)
        if len(sample_rows) < hidden.shape[0]:
            hidden = hidden[self._tensor(sample_rows, torch.int64)]
        logits = self.model.compute_logits(hidden)  # [B, V], the model's dtype
        out = sample(logits, self.sampling_batch(seqs))
        step = InFlight(seqs, {s.request_id: i for i, s in enumerate(seqs)}, out, out)
        if self.device.type == "cuda":
            # Start the copy back now and wait for this event alone in collect(): a plain .tolist() would
            # also wait for the step launched after this one, and nothing would overlap.
            fields = (getattr(out, f.name) for f in dataclasses.fields(out))  # (astuple would deep-copy them)
            step.host = SamplerOutput(*(None if t is None else _copy_to_host(t) for t in fields))
            step.copied = torch.cuda.Event()
            step.copied.record()
        return step

    def collect(self, step: InFlight) -> dict[str, SampledToken]:
        """Wait for a launched step; its sampled token (and logprobs) per sequence that sampled."""
        seqs, out = step.seqs, step.host
        if out is None:
            return {}
        if step.copied is not None:
            step.copied.synchronize()  # the step's one host synchronisation
        token_ids = out.token_ids.tolist()
        if out.logprobs is None:
            return {seq.request_id: SampledToken(t, None) for seq, t in zip(seqs, token_ids)}
        lps = out.logprobs.tolist()
        top_ids = out.top_ids.tolist() if out.top_ids is not None else [[] for _ in seqs]
        top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else [[] for _ in seqs]
        result = {}
        for i, seq in enumerate(seqs):
            n, logprobs = seq.params.logprobs, None
            if n is not None:  # the top-n and the sampled token (which may be among them)
                logprobs = dict(zip(top_ids[i][:n], top_lps[i][:n]))
                logprobs[token_ids[i]] = lps[i]
            result[seq.request_id] = SampledToken(token_ids[i], logprobs)
        return result

    def execute(self, chunks: list[ScheduledChunk]) -> dict[str, SampledToken]:
        """Compute the chunks and wait for their samples (no token of theirs may be pending)."""
        return self.collect(self.launch(chunks))

    def sampling_batch(self, seqs: list[Sequence]) -> SamplingBatch:
        p = [s.params for s in seqs]
        greedy = [x.greedy for x in p]
        vocab = self.vocab_size
        top_ks = [x.top_k if 0 < x.top_k < vocab else vocab for x in p]  # k >= the vocabulary keeps every token
        f32, i64 = torch.float32, torch.int64
        temperature, top_p, min_p = self._tensors(
            f32, [0.0 if g else x.temperature for g, x in zip(greedy, p)], [x.top_p for x in p], [x.min_p for x in p]
        )
        top_k, seeds, steps = self._tensors(
            i64,
            top_ks,
            [s.sampling_seed for s in seqs],
            [s.num_output_tokens for s in seqs],
        )
        batch = SamplingBatch(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            seeds=seeds,
            steps=steps,
            all_greedy=all(greedy),
            needs_top_k_p=any(k < vocab for k in top_ks) or any(x.top_p < 1 for x in p),
            needs_min_p=any(x.min_p > 0 for x in p),
            max_logprobs=max((x.logprobs for x in p if x.logprobs is not None), default=-1),
        )
        if any(x.has_penalties for x in p):
            batch.repetition_penalty = self._tensor([x.repetition_penalty for x in p], f32)
            batch.presence_penalty = self._tensor([x.presence_penalty for x in p], f32)
            batch.frequency_penalty = self._tensor([x.frequency_penalty for x in p], f32)
            batch.output_counts = self._token_rows([s.output_token_ids for s in seqs]).float()
            batch.prompt_mask = self._token_rows([s.prompt_token_ids for s in seqs]) > 0
        banned = [s.stop_token_ids if s.num_output_tokens < s.params.min_tokens else () for s in seqs]
        if any(banned):
            batch.banned = self._token_rows([list(b) for b in banned]) > 0
        return batch

    def _token_rows(self, rows: list[list[int]]) -> torch.Tensor:
        """[B, V] int32 counts of each token id in each row."""
        width = max(1, max(map(len, rows)))
        ids = self._tensor([r + [0] * (width - len(r)) for r in rows], torch.int64)
        ones = self._tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], torch.int32)
        counts = torch.zeros(len(rows), self.vocab_size, dtype=torch.int32, device=self.device)
        return counts.scatter_add_(1, ids, ones)
