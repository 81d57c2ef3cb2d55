"""Prefill attention over the paged KV pool: packed variable-length queries, causal.

Sequence i brings q_len new query tokens, the last of its seq_len tokens of context; the whole context
(a cached prefix from the prefix cache or from earlier chunks, plus the new tokens, already stored)
is read from the pool through the block table, tile by tile, never gathered into a contiguous copy.
A program computes BLOCK_M queries of one head (FlashAttention-2's online softmax). Key tiles entirely
before the first query need no mask; only the tiles that reach the diagonal are masked.

With a sliding window (a runtime argument: no variant per window) a query at p sees (p - window, p]: a program reads
from its first query's window start, masks the tiles before its last query's window start as well as the diagonal
ones, and needs no mask in between. Chunked local attention (``chunk``, a runtime argument too) is a window that
starts at the query's chunk, [p - p % chunk, p]: the same tiles. Attention sinks start each row's softmax from its
head's sink logit. Queries may see past their own position (``q_last``: Gemma 3's image tokens see their whole
image), as far as the tile's furthest one. An FP8 pool (float8 e4m3, with the layer's k_scale and v_scale) is read as
nanostream/kernels/attention_tile.py says.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanostream.kernels._device import LOG2E
from nanostream.kernels.attention_tile import (
    fold_kv_tile,
    in_page,
    pool_strides,
    queries_for,
    softmax_start,
    window_arg,
)
from nanostream.kernels.fp8_kv import check_kv_scales


# The block-table width changes every step, the window from layer to layer: neither compiles a variant.
@triton.jit(do_not_specialize=["stride_tb", "window", "chunk"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, table_ptr, cu_q_ptr, seq_lens_ptr, sinks_ptr, k_scale_ptr, v_scale_ptr,
    q_last_ptr, out_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_vd,
    stride_tb, stride_ot, stride_oh, window, chunk,
    G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, IEEE: tl.constexpr, HAS_SINKS: tl.constexpr, FP8_KV: tl.constexpr,
    ALL_MASKED: tl.constexpr, IN_PAGE: tl.constexpr, HAS_LAST: tl.constexpr,
):  # fmt: skip
    m_tile = tl.program_id(0)
    head = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    if m_tile * BLOCK_M >= q_len:
        return
    if FP8_KV:  # the stored keys' scale joins the logits' (the scale pointers are unread otherwise)
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    seq_len = tl.load(seq_lens_ptr + b)
    prefix = seq_len - q_len  # context tokens before the first query

    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the sequence
    m_mask = rows < q_len
    q_pos = prefix + rows  # each query's position in the context
    q_lo = tl.maximum(q_pos + 1 - window, q_pos - q_pos % chunk)  # its first visible key: window's, chunk's start
    if HAS_LAST:  # noqa: SIM108 (a constexpr branch) the last key each query sees, past its own in an image
        q_hi = tl.load(q_last_ptr + q_start + rows, mask=m_mask, other=0)
    else:
        q_hi = q_pos
    d = tl.arange(0, BLOCK_D)
    d_mask = d < D
    q = tl.load(
        q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
    )
    q = queries_for(q, FP8_KV, IEEE)
    k_offs = (head // G) * stride_kh + d[None, :]
    v_offs = (head // G) * stride_vh + d[None, :] * stride_vd
    table_row = table_ptr + b * stride_tb

    m, denom = softmax_start(sinks_ptr, tl.full([BLOCK_M], head, tl.int32), m_mask, HAS_SINKS)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Keys before this tile's first query, and inside its last query's window, are visible to all its
    # queries: whole tiles of them need no mask. The tiles from there to the last query's position are
    # masked (causal, and the context end), and so are those from the first query's window start to the
    # last one's (a window's or a chunk's start, whichever is later). Without either both starts are 0.
    first_q = prefix + m_tile * BLOCK_M
    kv_end = tl.minimum(first_q + BLOCK_M, seq_len)  # one past the last query's position
    full_end = first_q // BLOCK_N * BLOCK_N
    first_lo = tl.maximum(tl.maximum(first_q + 1 - window, first_q - first_q % chunk), 0)
    last_lo = tl.maximum(tl.maximum(kv_end - window, (kv_end - 1) - (kv_end - 1) % chunk), 0)
    kv_start = first_lo // BLOCK_N * BLOCK_N
    if HAS_LAST:  # queries that see past their own position: to the furthest one's last key (inside the context)
        kv_end = tl.minimum(tl.maximum(kv_end, tl.max(q_hi, 0) + 1), seq_len)
    full_start = tl.minimum(tl.cdiv(last_lo, BLOCK_N) * BLOCK_N, full_end)
    if ALL_MASKED:  # the batch-invariant mode: every tile through one code path (see paged_prefill_attention)
        full_start = kv_end
        full_end = kv_end
    for n0 in range(kv_start, full_start, BLOCK_N):
        m, denom, acc = fold_kv_tile(
            q, m, denom, acc, k_cache_ptr, v_cache_ptr, table_row, k_offs, v_offs, d_mask,
            stride_kb, stride_ks, stride_vb, stride_vs, qk_scale, n0, kv_end, q_hi, q_lo,
            PAGE=PAGE, BLOCK_N=BLOCK_N, MASK=True, IEEE=IEEE, FP8_KV=FP8_KV, IN_PAGE=IN_PAGE,
        )  # fmt: skip
    for n0 in range(full_start, full_end, BLOCK_N):
        m, denom, acc = fold_kv_tile(
            q, m, denom, acc, k_cache_ptr, v_cache_ptr, table_row, k_offs, v_offs, d_mask,
            stride_kb, stride_ks, stride_vb, stride_vs, qk_scale, n0, kv_end, q_hi, q_lo,
            PAGE=PAGE, BLOCK_N=BLOCK_N, MASK=False, IEEE=IEEE, FP8_KV=FP8_KV, IN_PAGE=IN_PAGE,
        )  # fmt: skip
    for n0 in range(full_end, kv_end, BLOCK_N):
        m, denom, acc = fold_kv_tile(
            q, m, denom, acc, k_cache_ptr, v_cache_ptr, table_row, k_offs, v_offs, d_mask,
            stride_kb, stride_ks, stride_vb, stride_vs, qk_scale, n0, kv_end, q_hi, q_lo,
            PAGE=PAGE, BLOCK_N=BLOCK_N, MASK=True, IEEE=IEEE, FP8_KV=FP8_KV, IN_PAGE=IN_PAGE,
        )  # fmt: skip

    # Rows past q_len saw only masked keys (denom = 0) and are not stored.
    o = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
    if FP8_KV:  # the stored values' scale, once an output element
        o = o * tl.load(v_scale_ptr)
    tl.store(
        out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + d[None, :],
        o,
        mask=m_mask[:, None] & d_mask[None, :],
    )


INVARIANT_TILE = (16, 64, 4, 2)
"""(BLOCK_M, BLOCK_N, num_warps, num_stages) of the batch-invariant mode: the decode kernel's tile (16 rows of
query heads, 64 keys, 4 warps)."""


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    out: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None,
    *,
    window: int | None = None,
    chunk: int | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    batch_invariant: bool = False,
    q_last: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries over their paged contexts.

    q: [T, Hq, D] packed, sequence i's queries at rows cu_seqlens_q[i]:cu_seqlens_q[i+1] ([B+1] int32);
    they are the last queries of its seq_lens[i] ([B] int32) context tokens, all already in the pool.
    k_cache, v_cache: [num_blocks, block_size, Hkv, D] (``pool_strides``); block_tables: [B, W] int32.
    ``max_seqlen_q`` bounds every q_len. Returns [T, Hq, D] in q's dtype (into ``out`` when given).
    ``config`` = (BLOCK_M, BLOCK_N, num_warps, num_stages) overrides the tile choice (benchmarks).
    ``window``: a query at position p sees only keys in (p - window, p] (None: all up to p). ``chunk``: only
    those of its chunk, [p - p % chunk, p] (chunked local attention; None: all). ``sinks``:
    [Hq], one softmax-denominator logit per query head (None: none). ``q_last``: [T] int32, the position of the
    last key each query sees (>= its own, inside its context; None: its own). ``k_scale``, ``v_scale``: [1] float32,
    with float8_e4m3fn caches and only then (K read as stored * k_scale). ``batch_invariant``: a query's result
    depends on its position and context alone, not on where its chunk starts nor on the longest chunk, and is
    the decode kernel's (``paged_decode_attention(batch_invariant=True)``) bit for bit: the tile of
    ``INVARIANT_TILE`` (the decode kernel's), and every key tile masked, since the compiler fuses an unmasked
    tile's scale and max subtraction into one rounding (an FMA) and a masked one's not::

        out = paged_prefill_attention(q, k_cache, v_cache, cu_q, lens, tables, 512, 0.125, window=128)
    """
    num_tokens, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    batch = seq_lens.shape[0]
    assert k_cache.shape[3] == head_dim, (q.shape, k_cache.shape)
    strides = pool_strides(k_cache, v_cache)
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads do not group over {num_kv_heads} KV heads"
    fp8 = check_kv_scales(k_cache.dtype, k_scale, v_scale)
    assert q.stride(2) == 1 and v_cache.dtype == k_cache.dtype and (fp8 or k_cache.dtype == q.dtype), (
        q.stride(), q.dtype, k_cache.dtype, v_cache.dtype,
    )  # fmt: skip
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q.shape == (batch + 1,), cu_seqlens_q.shape
    assert seq_lens.dtype == torch.int32 and seq_lens.is_contiguous()
    assert block_tables.dtype == torch.int32 and block_tables.shape[0] == batch and block_tables.stride(1) == 1
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(2) == 1, (out.shape, out.stride())
    window, chunk = window_arg(window), window_arg(chunk)
    if q_last is not None:
        assert q_last.dtype == torch.int32 and q_last.shape == (num_tokens,) and q_last.is_contiguous(), q_last.shape
    if sinks is not None:
        assert sinks.shape == (num_heads,) and sinks.is_contiguous() and sinks.is_floating_point(), sinks.shape
    if num_tokens == 0:
        return out
    block_d = max(16, triton.next_power_of_2(head_dim))
    fp32 = q.dtype == torch.float32
    # bf16/fp16 at head dim <= 128: 128 x 64 tiles, 8 warps; float32 (tests, parity runs) halves them.
    block_m, block_n = (64, 32) if fp32 or block_d > 128 else (128, 64)
    num_warps, num_stages = (8 if block_m >= 128 else 4), 2
    if config is not None or batch_invariant:
        block_m, block_n, num_warps, num_stages = INVARIANT_TILE if batch_invariant else config
    block_m = min(block_m, max(16, triton.next_power_of_2(max_seqlen_q)))
    _prefill_kernel[(triton.cdiv(max_seqlen_q, block_m), num_heads, batch)](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, q if sinks is None else sinks,
        k_scale if fp8 else q, v_scale if fp8 else q,  # unread without FP8
        seq_lens if q_last is None else q_last, out,
        scale * LOG2E,
        q.stride(0), q.stride(1), *strides, block_tables.stride(0), out.stride(0), out.stride(1), window, chunk,
        G=num_heads // num_kv_heads, D=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        PAGE=page, IEEE=fp32, HAS_SINKS=sinks is not None, FP8_KV=fp8, ALL_MASKED=batch_invariant,
        IN_PAGE=in_page(page, block_n), HAS_LAST=q_last is not None, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out
