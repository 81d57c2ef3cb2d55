"""The step both attention kernels share: fold one paged K/V tile into an online softmax."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def fold_kv_tile(
    q, m, denom, acc,
    k_cache_ptr, v_cache_ptr, table_row, kv_offs, d_mask, stride_slot, qk_scale,
    n0, kv_end, q_pos,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """Attend the queries ``q`` [M, BLOCK_D] to context positions [n0, n0 + BLOCK_N).

    K/V rows are gathered through the sequence's block table (``table_row``), any block size.
    (m, denom, acc): running max (base 2), running sum and unnormalised output, updated and returned.
    With MASK, positions at or past ``kv_end`` or after a query's own position ``q_pos`` [M] are left
    out; without it the caller guarantees the whole tile is visible to every query.
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
    if IEEE:  # noqa: SIM108 (float32 operands: exact products, not TF32, for token-exact float32 runs)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * qk_scale  # [M, BLOCK_N]
    if MASK:
        s = tl.where(n_mask[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    denom = denom * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, denom, acc
