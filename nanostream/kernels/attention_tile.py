"""What both attention kernels share: the online softmax's start (with a sink or without) and the fold of
one paged K/V tile into it.

An FP8 pool's tiles are widened as they load, to float16 with 16-bit queries (one instruction a pair of
values on sm89 and newer; bfloat16 takes several) and to float32 with float32 ones, exactly either way: every
e4m3 value is a float16 value. 16-bit queries then enter the dots as float16 (``queries_for``: bfloat16's 8
significant bits fit in float16's 11, so a query in float16's normal range is unchanged, and the softmax's
weights keep 3 more bits than in bfloat16). The pool's scales are folded in where they cost one multiply, not
one a K/V element: k_scale into the logits' scale (q . k_stored * k_scale * softmax scale) and v_scale into
the output (sum p v_stored * v_scale)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import triton
import triton.language as tl

from nanostream.kernels._device import LOG2E

if TYPE_CHECKING:
    import torch

NO_WINDOW = 1 << 30
"""The ``window`` the kernels take for full causal attention: a runtime value (no variant of its own) that
no context reaches, far enough from the int32 limit that ``position - window`` cannot overflow."""

_LOG2E = tl.constexpr(LOG2E)


def window_arg(window: int | None) -> int:
    """The kernels' runtime ``window`` (or ``chunk``) for a launcher's: NO_WINDOW for None (callers check it is
    positive)."""
    assert window is None or (isinstance(window, int) and window >= 1), f"window {window!r}"
    return NO_WINDOW if window is None else min(window, NO_WINDOW)


@triton.jit
def queries_for(q, FP8_KV: tl.constexpr, IEEE: tl.constexpr):
    """The query tile as the dots take it: float16 (clamped to its range) against an FP8 pool unless float32."""
    if FP8_KV and not IEEE:
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return q


@triton.jit
def softmax_start(sinks_ptr, heads, use, HAS_SINKS: tl.constexpr):
    """(running max, running sum) before any key, one per row of ``heads`` (each row's query head).

    With sinks, a row where ``use`` holds starts from its head's sink: max = the sink's logit (base 2),
    sum = e^0 = 1, so the sink joins the denominator and adds nothing to the output. Otherwise (-inf, 0).
    """
    if HAS_SINKS:
        m = tl.load(sinks_ptr + heads, mask=use, other=float("-inf")).to(tl.float32) * _LOG2E
        denom = tl.where(m == float("-inf"), 0.0, 1.0)  # a sink of -inf is no sink
    else:
        m = tl.full(heads.shape, float("-inf"), tl.float32)
        denom = tl.zeros(heads.shape, tl.float32)
    return m, denom


@triton.jit
def fold_kv_tile(
    q, m, denom, acc,
    k_cache_ptr, v_cache_ptr, table_row, k_offs, v_offs, d_mask, stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
    n0, kv_end, q_hi, q_lo,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, IEEE: tl.constexpr, FP8_KV: tl.constexpr,
    IN_PAGE: tl.constexpr,
):  # fmt: skip
    """Attend the queries ``q`` [M, BLOCK_D] to context positions [n0, n0 + BLOCK_N).

    K/V rows are found through the sequence's block table (``table_row``): block ``b``'s row ``r`` of K is at
    ``b * stride_kb + r * stride_ks + k_offs`` ([1, BLOCK_D]: the head's columns), V's likewise. IN_PAGE: the
    tile lies inside one block (n0 a multiple of BLOCK_N, BLOCK_N dividing PAGE), so one page number serves
    it and its rows are read whole, contiguous in either layout of the pool (an FP8 pool's V is laid out
    rows fastest: nanostream/kernels/fp8_kv.py). A masked tile's rows past ``kv_end`` are then another
    moment's values: K's logits are masked, V's rows are masked out of the load, except in an FP8 pool,
    whose bytes are all finite (its stores write NaN as 0), so that p = 0 zeroes them (a masked load would
    not vectorize along rows). Otherwise any block size: a page number a row.
    (m, denom, acc): running max (base 2), running sum and unnormalised output, updated and returned.
    With MASK, positions at or past ``kv_end``, after a query's last visible one ``q_hi`` [M] (its own position, or
    its image's end) or before its first visible one ``q_lo`` [M] (its window's or its chunk's start) are left out;
    without it the caller guarantees the whole tile is visible to every query. A row that has seen no visible key
    yet keeps max -inf and sum 0. FP8_KV: the pool is float8 e4m3, its tiles widened to q's dtype (float16 or
    float32: ``queries_for``; its scales are the caller's: ``qk_scale`` holds k_scale).
    """
    pos = n0 + tl.arange(0, BLOCK_N)
    n_mask = pos < kv_end
    if IN_PAGE:
        page = tl.load(table_row + n0 // PAGE).to(tl.int64)
        rows = tl.multiple_of(n0 % PAGE, BLOCK_N) + tl.arange(0, BLOCK_N)
        k = tl.load(k_cache_ptr + page * stride_kb + rows[:, None] * stride_ks + k_offs, mask=d_mask[None, :])
        if MASK and not FP8_KV:  # rows past kv_end may hold NaN: kept out (an FP8 pool holds none)
            v = tl.load(v_cache_ptr + page * stride_vb + rows[:, None] * stride_vs + v_offs,
                        mask=n_mask[:, None] & d_mask[None, :], other=0.0)  # fmt: skip
        else:
            v = tl.load(v_cache_ptr + page * stride_vb + rows[:, None] * stride_vs + v_offs, mask=d_mask[None, :])
    else:
        if MASK:
            page = tl.load(table_row + pos // PAGE, mask=n_mask, other=0).to(tl.int64)
            kv_mask = n_mask[:, None] & d_mask[None, :]
        else:
            page = tl.load(table_row + pos // PAGE).to(tl.int64)
            kv_mask = d_mask[None, :]
        row = pos % PAGE
        k = tl.load(k_cache_ptr + (page * stride_kb + row * stride_ks)[:, None] + k_offs, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + (page * stride_vb + row * stride_vs)[:, None] + v_offs, mask=kv_mask, other=0.0)
    if FP8_KV:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    if IEEE:  # noqa: SIM108 (float32 operands: exact products, not TF32, for token-exact float32 runs)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * qk_scale  # [M, BLOCK_N]
    if MASK:
        causal = pos[None, :] <= q_hi[:, None]
        in_window = pos[None, :] >= q_lo[:, None]
        s = tl.where(n_mask[None, :] & causal & in_window, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    # A row whose keys are all masked so far: exp2 against 0 (giving 0 and 0), not -inf - -inf (NaN).
    if MASK:  # noqa: SIM108 (a constexpr branch: the unmasked tiles compile without the select)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m - m_ref)
    denom = denom * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, denom, acc


def pool_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, ...]:
    """The strides the kernels take of a pool's two [num_blocks, block_size, Hkv, D] tensors: K's first three
    (its rows contiguous in D) and V's four (V the same, or row-fastest: an FP8 pool's, kv_pool.py)."""
    assert k_cache.shape == v_cache.shape, (k_cache.shape, v_cache.shape)
    assert k_cache.stride(3) == 1 and 1 in (v_cache.stride(3), v_cache.stride(1)), (
        "KV caches need unit stride in head_dim (V: there or in block rows)", k_cache.stride(), v_cache.stride(),
    )  # fmt: skip
    return (*k_cache.stride()[:3], *v_cache.stride())


def in_page(page: int, block_n: int) -> bool:
    """Whether tiles of ``block_n`` keys from multiples of it lie inside blocks of ``page`` rows."""
    return page % block_n == 0
