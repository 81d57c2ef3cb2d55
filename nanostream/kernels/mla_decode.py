"""Paged multi-head latent attention decode (absorbed: layers/latent_ops.py), split over the context, and the store of
a step's latent entries.

Every head attends the same entries [c | k_pe] (C + R values a token): a program takes BLOCK_H heads of one sequence
as one [BLOCK_H, C + R] query tile, so each entry is read once per head block, not once per head (DeepSeek-V3 at
one GPU: 128 heads in 8 programs a split). A program folds tiles of BLOCK_N tokens of its split into a running
softmax: scores ``q_c . c + q_pe . k_pe`` (two dots), the output ``p . c`` [BLOCK_H, C] (the latent half only). With
more than one split each writes its partial output and log-sum-exp and kernels/decode_attention.py's merge kernel
combines them; the split count, a runtime argument, depends on the batch size and the context
bound only (CUDA graphs replay it). An FP8 cache (float8 e4m3) is read as stored values times the layer's k_scale,
folded into the scores' scale and the output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from nanostream.kernels._device import LOG2E, num_sms, pdl_launch
from nanostream.kernels.decode_attention import MAX_SPLITS, _merge_kernel
from nanostream.kernels.fp8_kv import FP8_KV_DTYPE
from nanostream.kernels.store_kv import quantize_fp8

if TYPE_CHECKING:
    from nanostream.layers.cache_spec import LatentCache

BLOCK_H = 16  # heads a program (tl.dot's smallest M)


@triton.jit(do_not_specialize=["stride_tb", "num_heads", "num_splits"])
def _mla_decode_kernel(
    q_ptr, cache_ptr, table_ptr, seq_lens_ptr, scale_ptr, out_ptr, part_ptr, lse_ptr,
    qk_scale,  # softmax scale * log2(e): base 2
    stride_qb, stride_qh, stride_cb, stride_cs, stride_tb, stride_ob, stride_oh, num_heads, num_splits,
    C: tl.constexpr, BLOCK_C: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, FP8: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    if FP8:  # the stored entries' scale joins the scores' (and the output's, below)
        qk_scale = qk_scale * tl.load(scale_ptr)
    seq_len = tl.load(seq_lens_ptr + b)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    c = tl.arange(0, BLOCK_C)
    r = tl.arange(0, BLOCK_R)
    h_mask, c_mask, r_mask = h < num_heads, c < C, r < R
    q_row = q_ptr + b * stride_qb + h[:, None] * stride_qh
    q_c = tl.load(q_row + c[None, :], mask=h_mask[:, None] & c_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_C]
    q_pe = tl.load(q_row + C + r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_R]

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        p_mask = pos < end
        block = tl.load(table_ptr + b * stride_tb + pos // PAGE, mask=p_mask, other=0)
        row = cache_ptr + block.to(tl.int64) * stride_cb + (pos % PAGE) * stride_cs  # [BLOCK_N] entry starts
        lat = tl.load(row[:, None] + c[None, :], mask=p_mask[:, None] & c_mask[None, :], other=0.0)
        pe = tl.load(row[:, None] + C + r[None, :], mask=p_mask[:, None] & r_mask[None, :], other=0.0)
        if FP8:  # e4m3 values are exact in the query's dtype
            lat, pe = lat.to(q_c.dtype), pe.to(q_c.dtype)
        if IEEE:  # float32 operands: exact products, not TF32 (token-exact float32 runs)
            s = tl.dot(q_c, tl.trans(lat), input_precision="ieee") + tl.dot(q_pe, tl.trans(pe), input_precision="ieee")
        else:
            s = tl.dot(q_c, tl.trans(lat)) + tl.dot(q_pe, tl.trans(pe))
        s = tl.where(p_mask[None, :], s * qk_scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m, tl.max(s, 1))  # finite: every tile holds a position of the split
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat)
        m = m_new

    empty = denom == 0.0  # a split past the end of a short sequence
    o = acc / tl.where(empty, 1.0, denom)[:, None]
    if FP8:
        o = o * tl.load(scale_ptr)
    out_mask = h_mask[:, None] & c_mask[None, :]
    if num_splits == 1:
        tl.store(out_ptr + b * stride_ob + h[:, None] * stride_oh + c[None, :], o, mask=out_mask)
    else:  # partials [B, H, num_splits, C] float32, lse [B, H, num_splits] (base 2)
        part_row = (b * num_heads + h) * num_splits + split  # [BLOCK_H]
        tl.store(part_ptr + part_row[:, None] * C + c[None, :], o, mask=out_mask)
        lse = tl.where(empty, float("-inf"), m + tl.log2(tl.where(empty, 1.0, denom)))
        tl.store(lse_ptr + part_row, lse, mask=h_mask)


def num_mla_splits(
    batch_size: int, num_heads: int, max_seq_len: int, device: torch.device, block_h: int = BLOCK_H
) -> int:
    """Splits per sequence: enough programs to fill the GPU about twice, never a split under 64 tokens."""
    want = -(-2 * num_sms(device) // (batch_size * -(-num_heads // block_h)))
    return max(1, min(want, -(-max_seq_len // 64), MAX_SPLITS))


def paged_mla_decode(
    q: torch.Tensor,
    latent: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    kv_lora_rank: int,
    k_scale: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    block_n: int = 32,
    block_h: int = BLOCK_H,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Absorbed latent attention of one query token per sequence over its paged entries (layers/latent_ops.py's
    ``LatentDecodeFn``; ``latent_decode_reference`` is its torch twin).

    q: [B, H, C + R] (the latent-space query, then the rotated rope query); latent: [num_blocks, block_size, C + R]
    (C = ``kv_lora_rank``); block_tables [B, W] int32; seq_lens [B] int32, each in [1, max_seq_len].
    ``max_seq_len`` only sizes the split (keep it fixed across CUDA-graph replays); ``num_splits`` overrides it
    (tests). ``k_scale``: [1] float32, with a float8_e4m3fn cache and only then. Returns [B, H, C] in q's dtype::

        o = paged_mla_decode(q, cache.latent, tables, lens, 0.07, 4096, 512)
    """
    batch, num_heads, width = q.shape
    rope = width - kv_lora_rank
    assert latent.dim() == 3 and latent.shape[2] == width and latent.stride(2) == 1, (latent.shape, q.shape)
    fp8 = latent.dtype == FP8_KV_DTYPE
    assert fp8 == (k_scale is not None) and (fp8 or latent.dtype == q.dtype), (latent.dtype, q.dtype)
    assert q.stride(2) == 1 and rope > 0, (q.stride(), rope)
    assert block_tables.dtype == torch.int32 and block_tables.shape[0] == batch and block_tables.stride(1) == 1
    assert seq_lens.dtype == torch.int32 and seq_lens.shape == (batch,) and seq_lens.is_contiguous()
    out = q.new_empty(batch, num_heads, kv_lora_rank)
    if batch == 0:
        return out
    splits = num_splits or num_mla_splits(batch, num_heads, max_seq_len, q.device, block_h)
    block_c = max(16, triton.next_power_of_2(kv_lora_rank))
    if splits > 1:
        part = torch.empty(batch, num_heads, splits, kv_lora_rank, dtype=torch.float32, device=q.device)
        lse = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=q.device)
    else:  # unread; float32 all the same, so that the kernel's signature, and its compiled variant, is one
        part = lse = torch.empty(1, dtype=torch.float32, device=q.device)
    stages = {} if num_stages is None else {"num_stages": num_stages}
    _mla_decode_kernel[(batch, -(-num_heads // block_h), splits)](
        q, latent, block_tables, seq_lens, k_scale if fp8 else q, out, part, lse,
        scale * LOG2E,
        q.stride(0), q.stride(1), latent.stride(0), latent.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1), num_heads, splits,
        C=kv_lora_rank, BLOCK_C=block_c, R=rope, BLOCK_R=max(16, triton.next_power_of_2(rope)), BLOCK_H=block_h,
        BLOCK_N=block_n, PAGE=latent.shape[1], FP8=fp8, IEEE=q.dtype == torch.float32, num_warps=num_warps, **stages,
    )  # fmt: skip
    if splits > 1:
        _merge_kernel[(batch, num_heads)](  # the decode kernel's merge: [B, H, splits, C] partials alike
            part, lse, out, out.stride(0), out.stride(1), num_heads, splits,
            D=kv_lora_rank, BLOCK_D=block_c, BLOCK_S=MAX_SPLITS, **pdl_launch(q.device),
        )  # fmt: skip
    return out


@triton.jit
def _store_kernel(
    x_ptr, cache_ptr, slot_ptr, scale_ptr, stride_xt, stride_cs, W: tl.constexpr, BLOCK: tl.constexpr,
    FP8: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:  # padding (a CUDA-graph batch filled up to its bucket)
        return
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + t * stride_xt + offs, mask=offs < W)
    if FP8:
        x = quantize_fp8(x, tl.load(scale_ptr))
    tl.store(cache_ptr + slot.to(tl.int64) * stride_cs + offs, x.to(cache_ptr.dtype.element_ty), mask=offs < W)


def store_latent_entries(
    cache: LatentCache, entries: torch.Tensor, slots: torch.Tensor, k_scale: torch.Tensor | None
) -> None:
    """``entries`` [T, C + R] at ``slots`` [T] (int64, -1: skip) of the cache (quantized by ``k_scale`` where it is
    FP8); no host synchronisation (layers/latent_ops.py's ``store_latent`` is the reference)."""
    pool = cache.latent
    num_tokens, width = entries.shape
    assert pool.is_contiguous() and pool.shape[2] == width and entries.stride(1) == 1, (pool.shape, entries.shape)
    assert slots.dtype == torch.int64 and slots.shape == (num_tokens,), (slots.dtype, slots.shape)
    fp8 = pool.dtype == FP8_KV_DTYPE
    assert fp8 == (k_scale is not None), (pool.dtype, k_scale)
    if num_tokens == 0:
        return
    _store_kernel[(num_tokens,)](
        entries, pool, slots, k_scale if fp8 else entries, entries.stride(0), width,
        W=width, BLOCK=triton.next_power_of_2(width), FP8=fp8,
    )  # fmt: skip
