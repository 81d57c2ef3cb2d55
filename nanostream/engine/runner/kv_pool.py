"""The KV pool: how many blocks fit (beside a recurrent model's state slots: ``plan_cache``), and the one
allocation that holds them all.

The pool is one tensor [2, num_layers, num_blocks, block_size, Hkv, D] (num_layers: the attention layers; the
recurrent ones keep their state in engine/runner/cache_pool.py's slots) in the KV cache's dtype
(``kv_dtype``: the model's, or float8 e4m3 with ``kv_cache_dtype="fp8"``, one byte an element: twice a
bfloat16 pool's blocks in the same bytes); each layer's ``KVCache`` is a view of it. An FP8 pool's V half
is laid out [num_layers, num_blocks, Hkv, D, block_size] under the same view (a block's rows fastest:
nanostream/kernels/fp8_kv.py says why). Its size is, in
order of precedence: ``num_kvcache_blocks``; ``kv_cache_memory_bytes``; on CUDA, what
``gpu_memory_utilization`` leaves after the worst step (measured by running it); on CPU, at most 1 GiB and
never more than the engine can ever fill. With tensor parallelism each rank sizes the pool
of its own KV heads on its own device, and the ranks then take the smallest block count (``ModelRunner``).

Also the start-up steps that run on a pool (kernels compile there, not mid-serving); the warning an engine
process logs for a kernel variant built after them is its entry point's (kernels/late_compiles.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from nanostream.config import EngineConfig
from nanostream.engine.sequence import Sequence
from nanostream.errors import ModelLoadError
from nanostream.kernels.fp8_kv import FP8_KV_DTYPE
from nanostream.layers.attention_backend import KVCache
from nanostream.models import DecoderSpec
from nanostream.sampling_params import SamplingParams

CPU_DEFAULT_KV_BYTES = 1 << 30


def kv_dtype(config: EngineConfig, spec: DecoderSpec | None = None) -> torch.dtype:
    """The KV pool's dtype for a resolved config: the model's (``kv_cache_dtype="auto"``) or float8 e4m3. With the
    model's ``spec``, an FP8 pool it cannot read is refused here, at construction (``ValueError``): layers that read
    another layer's pages (Gemma 4's KV-shared layers) do not read FP8 pages yet."""
    if config.kv_cache_dtype == "auto":
        return getattr(torch, config.dtype)
    shared = [i for i, source in enumerate(spec.kv_sources if spec is not None else ()) if source is not None]
    if shared:
        raise ValueError(
            f"kv_cache_dtype={config.kv_cache_dtype!r} is not supported for {spec.architecture} with KV-shared layers "
            f"(num_kv_shared_layers: layers {shared[0]}-{shared[-1]} read earlier layers' KV, which nanostream does "
            "not read from an FP8 cache yet); use kv_cache_dtype='auto'"
        )
    return FP8_KV_DTYPE


def allocate_kv_pool(
    spec: DecoderSpec,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    num_kv_heads: int | None = None,
) -> list[KVCache]:
    """One zeroed pool; a ``KVCache`` of views [num_blocks, block_size, Hkv, D] per layer (Hkv: this rank's)."""
    hkv = num_kv_heads or spec.num_kv_heads
    return kv_pool_views(spec.num_layers, num_blocks, block_size, hkv, spec.head_dim, dtype, device)


def kv_pool_views(
    num_layers: int, num_blocks: int, block_size: int, hkv: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> list[KVCache]:
    """One zeroed pool of ``num_layers`` layers' K and V; a ``KVCache`` of views [num_blocks, block_size, Hkv, D]
    per layer."""
    pool = torch.zeros(2, num_layers, num_blocks, block_size, hkv, head_dim, dtype=dtype, device=device)
    v = pool[1]
    if dtype == FP8_KV_DTYPE:  # the same bytes, [num_layers, num_blocks, Hkv, D, block_size] underneath
        v = v.view(num_layers, num_blocks, hkv, head_dim, block_size).permute(0, 1, 4, 2, 3)
    return [KVCache(pool[0, i], v[i]) for i in range(num_layers)]


def plan_num_kv_blocks(
    config: EngineConfig, block_bytes: int, device: torch.device, cuda_budget: Callable[[], int]
) -> int:
    """The pool's size in blocks. ``cuda_budget()`` measures the bytes CUDA leaves (``measure_cuda_kv_budget``)."""
    return plan_cache(config, block_bytes, 0, device, cuda_budget).num_blocks


class CachePlan(NamedTuple):
    num_blocks: int  # KV blocks
    num_snapshots: int  # state slots for the prefix cache, beside max_num_seqs live ones (recurrent layers)


SNAPSHOT_SHARE = 0.25
"""The most of a measured or given budget (after the live states) that state snapshots take by default."""


def plan_cache(
    config: EngineConfig,
    block_bytes: int,
    slot_bytes: int,
    device: torch.device,
    cuda_budget: Callable[[], int],
    num_groups: int = 1,
) -> CachePlan:
    """KV blocks of ``block_bytes`` and, for a model with recurrent layers, state slots of ``slot_bytes`` (one
    sequence's state of every such layer): a live one per running sequence and ``num_snapshots`` for the prefix
    cache. In order of precedence: ``num_kvcache_blocks`` (the states beside them); ``kv_cache_memory_bytes`` or,
    on CUDA, what ``gpu_memory_utilization`` leaves after the worst step (measured), shared: live states first,
    then snapshots (``max_state_snapshots``, else max_num_seqs within a quarter of what is left), blocks from the
    rest; on CPU, KV blocks of at most 1 GiB, the states beside them. Never more blocks than the engine can fill."""
    cfg = config
    live = cfg.max_num_seqs * slot_bytes
    snapshots = cfg.max_state_snapshots if cfg.max_state_snapshots is not None else cfg.max_num_seqs
    if not slot_bytes:
        snapshots = 0
    if cfg.num_kvcache_blocks is not None:
        return CachePlan(cfg.num_kvcache_blocks, snapshots)
    # Never more blocks than the engine can fill at once (a block table of max_model_len tokens per KV group of
    # each of max_num_seqs sequences): a small model on a large GPU would otherwise get tens of millions.
    most = cfg.max_num_seqs * -(-cfg.max_model_len // cfg.kvcache_block_size) * num_groups
    if cfg.kv_cache_memory_bytes is not None or device.type == "cuda":
        budget = cfg.kv_cache_memory_bytes if cfg.kv_cache_memory_bytes is not None else cuda_budget()
        left = budget - live
        if slot_bytes and cfg.max_state_snapshots is None:
            snapshots = min(snapshots, max(0, int(left * SNAPSHOT_SHARE) // slot_bytes))
        budget = left - snapshots * slot_bytes
    else:  # CPU memory is shared with everything else
        budget = min(CPU_DEFAULT_KV_BYTES, most * block_bytes)
    num_blocks = min(budget // block_bytes, most)
    if num_blocks < 1:
        states = f" after {cfg.max_num_seqs} sequences' states of {slot_bytes} bytes" if slot_bytes else ""
        raise ModelLoadError(
            f"no room for a single KV block of {block_bytes} bytes (budget {budget} bytes{states}); "
            "raise gpu_memory_utilization or kv_cache_memory_bytes, or lower kvcache_block_size or max_num_seqs"
        )
    return CachePlan(num_blocks, snapshots)


@dataclass(frozen=True)
class WarmupChunk:
    """A chunk of a made-up sequence (``step_inputs.Chunk``), for the warm-up step."""

    seq: Sequence
    start: int
    num_new_tokens: int
    samples: bool = True
    state: None = None  # no state of its own: a model's recurrent layers run it in slot 0 (``pack_states``)


def _warmup_chunk(i: int, num_tokens: int, blocks_per_seq: int, num_computed: int = 0) -> WarmupChunk:
    """Chunk ``i`` of a made-up sequence that owns blocks [i * blocks_per_seq, (i + 1) * blocks_per_seq)."""
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
    return WarmupChunk(seq, num_computed, num_tokens)


def worst_step(config: EngineConfig) -> tuple[int, list[WarmupChunk]]:
    """The step that peaks memory, as the scheduler makes them, and the KV blocks its chunks use.

    A mixed step: a decode row first, then prompts filling ``max_num_batched_tokens``. Running it also
    builds what a mixed step needs on first use (FlashAttention-4 compiles its decode and prefill
    variants, seconds each), at start-up and not in the middle of serving."""
    cfg, bs = config, config.kvcache_block_size
    seq_len = min(cfg.max_model_len, cfg.max_num_batched_tokens)
    num_seqs = max(1, min(cfg.max_num_batched_tokens // seq_len, cfg.max_num_seqs))
    blocks_per_seq = -(-seq_len // bs)
    chunks = [_warmup_chunk(i, seq_len, blocks_per_seq) for i in range(num_seqs)]
    if seq_len > 1 and num_seqs < cfg.max_num_seqs:
        # The decode row reads one token of context from the last prompt's blocks (not yet written:
        # only the kernels' shapes matter), and takes its token from the first prompt.
        last = _warmup_chunk(num_seqs - 1, 1, blocks_per_seq, num_computed=1)
        chunks = [last, _warmup_chunk(0, seq_len - 1, blocks_per_seq), *chunks[1:]]
    return num_seqs * blocks_per_seq, chunks


def short_chunk_steps(config: EngineConfig, num_blocks: int) -> list[list[WarmupChunk]]:
    """Steps of a decode row and one short prompt chunk (1, 2, 4, ... 64 tokens) each, within the first
    ``num_blocks`` blocks of the pool. Attention kernels size their tiles to a step's longest chunk, and
    each tile size is one more kernel to compile (a stall of ~0.3 s): run at start-up, these compile
    them there, not in the middle of serving when a short prompt or a prefix-cache hit first comes."""
    bs, steps = config.kvcache_block_size, []
    # The decode row's context is long enough to be split (the split kernels' merge compiles too),
    # where the pool and the model's length allow.
    context = min(_SPLIT_CONTEXT, config.max_model_len - 1, max(1, num_blocks // 2 * bs - 1))
    for n in (1, 2, 4, 8, 16, 32, 64):
        blocks = -(-(max(n, context) + 1) // bs)
        if n + 1 > min(config.max_model_len, config.max_num_batched_tokens) or 2 * blocks > num_blocks:
            break
        if config.max_num_seqs < 2:
            steps.append([_warmup_chunk(0, n, blocks)])
        else:
            steps.append([_warmup_chunk(1, 1, blocks, num_computed=context), _warmup_chunk(0, n, blocks)])
    return steps


_SPLIT_CONTEXT = 256  # tokens of context: a decode row the decode kernel splits (past 64 per split)


def measure_cuda_kv_budget(device: torch.device, utilization: float, run_worst_step: Callable[[], None]) -> int:
    """Bytes left for KV after the worst step: total * utilisation - (everything else at its peak).

    ``run_worst_step()`` allocates what it needs (a small KV pool too), runs the step and frees it all."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    run_worst_step()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    stats = torch.cuda.memory_stats(device)
    peak, current = stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]
    # Memory in use now (weights, other processes), plus what the worst forward pass adds at its peak.
    used = total - free + peak - current
    return int(total * utilization - used)
