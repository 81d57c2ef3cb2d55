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

import triton
import triton.language as tl

from nanostream.kernels._device import LOG2E

NO_WINDOW = 1 << 30
"""The ``window`` the kernels take for full causal attention: a runtime value (no variant of its own) that
no context reaches, far enough from the int32 limit that ``position - window`` cannot overflow."""

_LOG2E = tl.constexpr(LOG2E)


def window_arg(window: int | None) -> int:
    """The kernels' runtime ``window`` for a launcher's: NO_WINDOW for None (callers check it is positive)."""
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
    k_cache_ptr, v_cache_ptr, table_row, kv_offs, d_mask, stride_slot, qk_scale,
    n0, kv_end, q_pos, window,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, IEEE: tl.constexpr, FP8_KV: tl.constexpr,
):  # fmt: skip
    """Attend the queries ``q`` [M, BLOCK_D] to context positions [n0, n0 + BLOCK_N).

    K/V rows are gathered through the sequence's block table (``table_row``), any block size.
    (m, denom, acc): running max (base 2), running sum and unnormalised output, updated and returned.
    With MASK, positions at or past ``kv_end``, after a query's own position ``q_pos`` [M] or at or
    before ``q_pos - window`` are left out; without it the caller guarantees the whole tile is visible
    to every query. A row that has seen no visible key yet keeps max -inf and sum 0. FP8_KV: the pool is
    float8 e4m3, its tiles widened to q's dtype (float16 or float32: ``queries_for``; its scales are the
    caller's: ``qk_scale`` holds k_scale).
    """
    pos = n0 + tl.arange(0, BLOCK_N)
    if MASK:
        n_mask = pos < kv_end
        page = tl.load(table_row + pos // PAGE, mask=n_mask, other=0)
        kv_mask = n_mask[:, None] & d_mask[None, :]
    else:
        page = tl.load(table_row + pos // PAGE)
        kv_mask = d_mask[None, :]
    slot = (page.to(tl.int64) * PAGE + pos % PAGE) * stride_slot
    k = tl.load(k_cache_ptr + slot[:, None] + kv_offs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
    v = tl.load(v_cache_ptr + slot[:, None] + kv_offs, mask=kv_mask, other=0.0)
    if FP8_KV:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    if IEEE:  # noqa: SIM108 (float32 operands: exact products, not TF32, for token-exact float32 runs)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * qk_scale  # [M, BLOCK_N]
    if MASK:
        causal = pos[None, :] <= q_pos[:, None]
        in_window = pos[None, :] > q_pos[:, None] - window
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
