"""Paged decode attention (one query token per sequence), split over the KV length (flash-decoding).

A program handles one (sequence, KV head, split): the G = Hq / Hkv query heads that share the KV head
are one [G, D] tile, so each K/V element is read from memory once per step, not once per query head.
With more than one split, each writes a partial output and its log-sum-exp and a second kernel merges
them. The split count depends only on the batch size and an upper bound of the context length, so a
CUDA graph captured at one batch size replays correctly for any context up to that bound. It is a
runtime argument, not a compile-time constant: a mixed step's decode rows come in every batch size and
context length, and each new constant would compile a kernel (a stall of ~0.3 s) in the serving loop.

A sliding window is a runtime argument too: a sequence attends only [max(0, seq_len - window), seq_len),
and that range is what the splits share, so their count follows min(context bound, window) and a window
of 128 tokens costs 128 tokens, whatever the context (the tiles start at multiples of BLOCK_N: the one that holds
the window's first position is masked). Attention sinks (one logit per query head) start
split 0's softmax, so the merge counts each sink once. An FP8 pool (float8 e4m3, with the layer's
k_scale and v_scale) is read as nanostream/kernels/attention_tile.py says; each split's output carries v_scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanostream.kernels._device import LOG2E, num_sms, pdl_launch, wait_for_producer
from nanostream.kernels.attention_tile import (
    fold_kv_tile,
    in_page,
    pool_strides,
    queries_for,
    softmax_start,
    window_arg,
)
from nanostream.kernels.fp8_kv import check_kv_scales

MAX_SPLITS = 64
TILE = (64, 4, 2)
"""(BLOCK_N, num_warps, num_stages): a pool in the model's dtype, and the batch-invariant mode."""
FP8_TILE = (128, 4, 2)
"""An FP8 pool's, where the block size is a multiple of 128: on an H200 at Qwen3-8B's heads (256 sequences of
~1,116 tokens) 171.1 us a layer, (128, 4, 3) 168.7, every other tile of the sweep 209 or more
(``apps/decode_kv_sweep.py``)."""


# The block-table width and the split count change from step to step, the window from layer to layer:
# none may compile a variant.
@triton.jit(do_not_specialize=["stride_tb", "num_splits", "window", "chunk"])
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, table_ptr, seq_lens_ptr, sinks_ptr, k_scale_ptr, v_scale_ptr,
    out_ptr, part_ptr, lse_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_vd,
    stride_tb, stride_ob, stride_oh, num_splits, window, chunk,
    G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, IEEE: tl.constexpr, HAS_SINKS: tl.constexpr,
    FP8_KV: tl.constexpr, ALL_MASKED: tl.constexpr, IN_PAGE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_producer(PDL)
    if FP8_KV:  # the stored keys' scale joins the logits' (the scale pointers are unread otherwise)
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    window = tl.minimum(window, (seq_len - 1) % chunk + 1)  # a chunk: the query sees its chunk's keys alone
    lo = tl.maximum(seq_len - window, 0)  # the window's first position (0 without one)
    base = lo // BLOCK_N * BLOCK_N  # tiles start at multiples of BLOCK_N: the one holding lo is masked
    split_len = tl.cdiv(tl.cdiv(seq_len - base, num_splits), BLOCK_N) * BLOCK_N
    start = base + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * G + g
    g_mask = g < G
    d_mask = d < D
    q_offs = b * stride_qb + heads[:, None] * stride_qh + d[None, :]
    q = queries_for(tl.load(q_ptr + q_offs, mask=g_mask[:, None] & d_mask[None, :]), FP8_KV, IEEE)  # [BLOCK_G, BLOCK_D]
    k_offs = kv_head * stride_kh + d[None, :]
    v_offs = kv_head * stride_vh + d[None, :] * stride_vd
    table_row = table_ptr + b * stride_tb
    # The query is the context's last token; every key of [lo, seq_len) is inside its window.
    q_pos = tl.full([BLOCK_G], 0, tl.int32) + (seq_len - 1)
    q_lo = q_pos + 1 - window

    # running max (base-2 logits) and sum of exp2; a sink joins split 0's only (the merge adds the splits')
    in_split_0 = tl.full([BLOCK_G], split, tl.int32) == 0  # a vector: the interpreter takes no scalar in a mask
    m, denom = softmax_start(sinks_ptr, heads, g_mask & in_split_0, HAS_SINKS)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    # An FP8 pool's tiles and the batch-invariant mode's (the prefill kernel's tiles) all take the masked path,
    # in one loop: an FP8 pool's kernel then needs fewer registers (more programs share an SM; its masks cost
    # ~3% of a tile). Otherwise the tile with keys before the window's start is masked, the whole tiles from
    # there are not, and the last, partial tile is.
    full_end = start
    if not (ALL_MASKED or FP8_KV):
        head_end = tl.where(start < lo, start + BLOCK_N, start)
        full_end = tl.maximum(head_end, end // BLOCK_N * BLOCK_N)
        for n0 in range(start, head_end, BLOCK_N):  # at most one tile
            m, denom, acc = fold_kv_tile(
                q, m, denom, acc, k_cache_ptr, v_cache_ptr, table_row, k_offs, v_offs, d_mask,
                stride_kb, stride_ks, stride_vb, stride_vs, qk_scale, n0, end, q_pos, q_lo,
                PAGE=PAGE, BLOCK_N=BLOCK_N, MASK=True, IEEE=IEEE, FP8_KV=FP8_KV, IN_PAGE=IN_PAGE,
            )  # fmt: skip
        for n0 in range(head_end, full_end, BLOCK_N):
            m, denom, acc = fold_kv_tile(
                q, m, denom, acc, k_cache_ptr, v_cache_ptr, table_row, k_offs, v_offs, d_mask,
                stride_kb, stride_ks, stride_vb, stride_vs, qk_scale, n0, end, q_pos, q_lo,
                PAGE=PAGE, BLOCK_N=BLOCK_N, MASK=False, IEEE=IEEE, FP8_KV=FP8_KV, IN_PAGE=IN_PAGE,
            )  # fmt: skip
    for n0 in range(full_end, end, BLOCK_N):
        m, denom, acc = fold_kv_tile(
            q, m, denom, acc, k_cache_ptr, v_cache_ptr, table_row, k_offs, v_offs, d_mask,
            stride_kb, stride_ks, stride_vb, stride_vs, qk_scale, n0, end, q_pos, q_lo,
            PAGE=PAGE, BLOCK_N=BLOCK_N, MASK=True, IEEE=IEEE, FP8_KV=FP8_KV, IN_PAGE=IN_PAGE,
        )  # fmt: skip

    out_mask = g_mask[:, None] & d_mask[None, :]
    empty = denom == 0.0  # a split past the end of a short sequence
    o = acc / tl.where(empty, 1.0, denom)[:, None]
    if FP8_KV:  # the stored values' scale, once an output element
        o = o * tl.load(v_scale_ptr)
    if num_splits == 1:
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :], o, mask=out_mask)
    else:
        # partials: [B, Hq, num_splits, D] float32; lse: [B, Hq, num_splits] (base 2)
        row = (b * G * tl.num_programs(1) + heads) * num_splits + split  # [BLOCK_G]
        tl.store(part_ptr + row[:, None] * D + d[None, :], o, mask=out_mask)
        lse = tl.where(empty, float("-inf"), m + tl.log2(tl.where(empty, 1.0, denom)))
        tl.store(lse_ptr + row, lse, mask=g_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(
    part_ptr, lse_ptr, out_ptr, stride_ob, stride_oh, num_heads, num_splits,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # One program per (sequence, query head): weight each split's output by its share of the mass.
    wait_for_producer(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = b * num_heads + h
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    lse = tl.load(lse_ptr + row * num_splits + s, mask=s < num_splits, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))  # the first split is never empty, so the max is finite
    mask = (s < num_splits)[:, None] & (d < D)[None, :]
    part = tl.load(part_ptr + (row * num_splits + s)[:, None] * D + d[None, :], mask=mask, other=0.0)
    o = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, o, mask=d < D)


def num_decode_splits(batch_size: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Splits per sequence: enough programs to fill the GPU about twice, never a split under 64 tokens."""
    want = -(-2 * num_sms(device) // (batch_size * num_kv_heads))
    return max(1, min(want, -(-max_seq_len // 64), MAX_SPLITS))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    out: torch.Tensor | None = None,
    *,
    window: int | None = None,
    chunk: int | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    batch_invariant: bool = False,
    tile: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context.

    q: [B, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D] (``pool_strides``); block_tables:
    [B, W] int32; seq_lens: [B] int32, each in [1, max_seq_len] and covered by its block table row.
    ``max_seq_len`` only sizes the split over the context (keep it fixed across CUDA-graph replays).
    ``window``: attend only the last ``window`` tokens (None: all). ``chunk``: only the tokens of the query's chunk
    of ``chunk`` positions (chunked local attention: [p - p % chunk, p]; None: all). ``sinks``: [Hq], one softmax-
    denominator logit per query head (None: none). ``k_scale``, ``v_scale``: [1] float32, with float8_e4m3fn
    caches and only then (K read as stored * k_scale). ``batch_invariant``: no split (each context in one
    program, whatever the batch) and the prefill kernel's arithmetic (``paged_prefill_attention``'s
    ``batch_invariant``), so that a preempted request's recomputed tokens are its decoded ones. ``tile``:
    (BLOCK_N, num_warps, num_stages) in place of TILE or FP8_TILE (benchmarks; not with ``batch_invariant``). Returns
    [B, Hq, D] in q's dtype (into ``out`` when given)::

        out = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, 4096, window=128, sinks=sinks)
    """
    batch, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    assert k_cache.shape[3] == head_dim, (q.shape, k_cache.shape)
    strides = pool_strides(k_cache, v_cache)
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads do not group over {num_kv_heads} KV heads"
    fp8 = check_kv_scales(k_cache.dtype, k_scale, v_scale)
    assert q.stride(2) == 1 and v_cache.dtype == k_cache.dtype and (fp8 or k_cache.dtype == q.dtype), (
        q.stride(), q.dtype, k_cache.dtype, v_cache.dtype,
    )  # fmt: skip
    assert block_tables.dtype == torch.int32 and block_tables.shape[0] == batch and block_tables.stride(1) == 1
    assert seq_lens.dtype == torch.int32 and seq_lens.shape == (batch,) and seq_lens.is_contiguous()
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(2) == 1, (out.shape, out.stride())
    window, chunk = window_arg(window), window_arg(chunk)
    if sinks is not None:
        assert sinks.shape == (num_heads,) and sinks.is_contiguous() and sinks.is_floating_point(), sinks.shape
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    block_n, warps, stages = tile or (FP8_TILE if fp8 and in_page(page, 128) and not batch_invariant else TILE)
    assert not (tile and batch_invariant), "the batch-invariant mode takes the prefill kernel's tiles"
    splits = 1 if batch_invariant else num_decode_splits(batch, num_kv_heads, min(max_seq_len, window, chunk), q.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    if splits > 1:
        part = torch.empty(batch, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=q.device)
    else:  # unused; float32 all the same, so that the kernel's signature, and its compiled variant, is one
        part = lse = torch.empty(1, dtype=torch.float32, device=q.device)
    _decode_kernel[(batch, num_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, q if sinks is None else sinks,
        k_scale if fp8 else q, v_scale if fp8 else q,  # unread without FP8
        out, part, lse,
        scale * LOG2E,
        q.stride(0), q.stride(1), *strides, block_tables.stride(0), out.stride(0), out.stride(1), splits, window, chunk,
        G=group, BLOCK_G=max(16, triton.next_power_of_2(group)), D=head_dim, BLOCK_D=block_d,
        BLOCK_N=block_n, PAGE=page, IEEE=q.dtype == torch.float32, HAS_SINKS=sinks is not None, FP8_KV=fp8,
        ALL_MASKED=batch_invariant, IN_PAGE=in_page(page, block_n), num_warps=warps, num_stages=stages,
        **pdl_launch(q.device),
    )  # fmt: skip
    if splits > 1:
        _merge_kernel[(batch, num_heads)](
            part, lse, out, out.stride(0), out.stride(1), num_heads, splits,
            D=head_dim, BLOCK_D=block_d, BLOCK_S=MAX_SPLITS, **pdl_launch(q.device),
        )  # fmt: skip
    return out
