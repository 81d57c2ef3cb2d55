"""The attention prologue in one kernel: per-head RMSNorm of q and k (Qwen3's QK-norm), rotary embedding,
and the K/V store into the paged pool, straight from the fused qkv projection's output.

Unfused, these are six kernels per layer (two norms, the cos/sin gather, two rotations, the store); at
decode batch sizes each is a few microseconds of launch-bound work, and 28 layers of them cost a
decode step about a third of a millisecond on an H200.

Into an FP8 pool the rotated k (rounded to the model's dtype first, as the unfused modules leave it) and
v go as k / k_scale and v / v_scale, saturated at +-448 (nanostream/kernels/store_kv.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanostream.kernels._device import pdl_launch, wait_for_producer
from nanostream.kernels.attention_tile import pool_strides
from nanostream.kernels.fp8_kv import check_kv_scales
from nanostream.kernels.store_kv import quantize_fp8


@triton.jit
def _norm_rope(
    x1, x2, w1, w2, cos, sin, eps, weight_offset,
    HEAD_DIM: tl.constexpr, NORM: tl.constexpr, F32_WEIGHT: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    # x1, x2: [H, HALF] float32 halves of each head. The roundings follow the unfused modules: the norm's
    # result is cast to the model dtype before the weight (Gemma's: times weight + 1 in float32), the
    # weighted result stored, then rotated.
    if NORM:
        r = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / HEAD_DIM + eps)[:, None]
        if F32_WEIGHT:
            x1 = (x1 * r * (w1[None, :] + weight_offset)).to(DTYPE).to(tl.float32)
            x2 = (x2 * r * (w2[None, :] + weight_offset)).to(DTYPE).to(tl.float32)
        else:
            x1 = (w1[None, :] * (x1 * r).to(DTYPE).to(tl.float32)).to(DTYPE).to(tl.float32)
            x2 = (w2[None, :] * (x2 * r).to(DTYPE).to(tl.float32)).to(DTYPE).to(tl.float32)
    return (x1 * cos - x2 * sin).to(DTYPE), (x2 * cos + x1 * sin).to(DTYPE)


@triton.jit
def _qkv_prologue_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, q_w_ptr, k_w_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    k_scale_ptr, v_scale_ptr,
    stride_t, stride_qo, stride_cs, stride_vb, stride_vs, stride_vh, stride_vd, stride_cos, eps, weight_offset,
    PAGE: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_HALF: tl.constexpr, NORM: tl.constexpr,
    F32_WEIGHT: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # Two programs per token: (t, 0) takes its q heads to q_out, (t, 1) its k (normed, rotated) and v heads to
    # slot `slot` (at decode batch sizes the two halves' latencies overlap instead of adding up).
    wait_for_producer(PDL)
    HALF: tl.constexpr = HEAD_DIM // 2
    DTYPE: tl.constexpr = q_out_ptr.dtype.element_ty
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    jm = j < HALF
    pos = tl.load(pos_ptr + t)
    # The cos/sin tables are float32; the unfused rotary casts them to the model dtype first.
    cos = tl.load(cos_ptr + pos * stride_cos + j, mask=jm).to(DTYPE).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cos + j, mask=jm).to(DTYPE).to(tl.float32)[None, :]
    row = qkv_ptr + t * stride_t
    if tl.program_id(1) == 0:
        # Without a norm the weight pointers are the cos table's, loaded and unused.
        w1 = tl.load(q_w_ptr + j, mask=jm).to(tl.float32)
        w2 = tl.load(q_w_ptr + HALF + j, mask=jm).to(tl.float32)
        h = tl.arange(0, BLOCK_H)[:, None]
        m = (h < NUM_HEADS) & jm[None, :]
        offs = h * HEAD_DIM + j[None, :]
        x1 = tl.load(row + offs, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(row + offs + HALF, mask=m, other=0.0).to(tl.float32)
        o1, o2 = _norm_rope(x1, x2, w1, w2, cos, sin, eps, weight_offset, HEAD_DIM, NORM, F32_WEIGHT, DTYPE)
        tl.store(q_out_ptr + t * stride_qo + offs, o1, mask=m)
        tl.store(q_out_ptr + t * stride_qo + offs + HALF, o2, mask=m)
        return

    slot = tl.load(slot_ptr + t)
    if slot < 0:  # padding (a CUDA-graph batch filled up to its bucket): nothing to store
        return
    h = tl.arange(0, BLOCK_KV)[:, None]
    m = (h < NUM_KV_HEADS) & jm[None, :]
    offs = h * HEAD_DIM + j[None, :]
    k_row = row + NUM_HEADS * HEAD_DIM
    kw1 = tl.load(k_w_ptr + j, mask=jm).to(tl.float32)
    kw2 = tl.load(k_w_ptr + HALF + j, mask=jm).to(tl.float32)
    x1 = tl.load(k_row + offs, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(k_row + offs + HALF, mask=m, other=0.0).to(tl.float32)
    o1, o2 = _norm_rope(x1, x2, kw1, kw2, cos, sin, eps, weight_offset, HEAD_DIM, NORM, F32_WEIGHT, DTYPE)
    v_row = k_row + NUM_KV_HEADS * HEAD_DIM
    v1 = tl.load(v_row + offs, mask=m)
    v2 = tl.load(v_row + offs + HALF, mask=m)
    if FP8:  # an FP8 pool: K and V divided by the layer's scales (unread otherwise)
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
        o1, o2 = quantize_fp8(o1, k_scale), quantize_fp8(o2, k_scale)
        v1, v2 = quantize_fp8(v1, v_scale), quantize_fp8(v2, v_scale)
    cache_ty = k_cache_ptr.dtype.element_ty
    tl.store(k_cache_ptr + slot * stride_cs + offs, o1.to(cache_ty), mask=m)
    tl.store(k_cache_ptr + slot * stride_cs + offs + HALF, o2.to(cache_ty), mask=m)
    v_at = v_cache_ptr + (slot // PAGE) * stride_vb + (slot % PAGE) * stride_vs + h * stride_vh + j[None, :] * stride_vd
    tl.store(v_at, v1.to(cache_ty), mask=m)
    tl.store(v_at + HALF * stride_vd, v2.to(cache_ty), mask=m)


def qkv_prologue(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    out: torch.Tensor | None = None,
    weight_offset: float | None = None,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The rotated (and, with norm weights, QK-normed) queries [T, Hq, D]; k and v go to the caches.

    qkv: [T, (Hq + 2 Hkv) D], the q, k, v projections side by side, rows with unit stride. positions:
    [T] int64. cos, sin: [max_position, D / 2] float32 (rotate-half layout). Norm weights: [D], both or
    neither. The caches: [num_blocks, block_size, Hkv, D], K contiguous, V as ``pool_strides`` takes it;
    slot_mapping [T] int64, -1 = skip.
    ``out``: where the queries go (contiguous), else a new tensor. ``weight_offset``: the norms' rounding
    (``nanostream.layers.norm``): None as Llama's, a number multiplies by weight + offset in float32.
    ``k_scale``, ``v_scale``: [1] float32, with float8_e4m3fn caches and only then (stored: k / k_scale).
    """
    num_tokens = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    assert qkv.dim() == 2 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim, (qkv.shape, num_heads)
    assert qkv.stride(1) == 1, f"qkv rows must be contiguous, got strides {qkv.stride()}"
    assert head_dim % 2 == 0, f"rotary embedding needs an even head_dim, got {head_dim}"
    assert positions.shape == (num_tokens,) and positions.dtype == torch.int64, (positions.shape, positions.dtype)
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64, slot_mapping.dtype
    assert cos.shape == sin.shape and cos.shape[1] == head_dim // 2 and cos.dtype == torch.float32, cos.shape
    assert cos.stride() == sin.stride() and cos.stride(1) == 1, (cos.stride(), sin.stride())
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and k_cache.is_contiguous(), k_cache.shape
    v_strides = pool_strides(k_cache, v_cache)[3:]
    assert v_cache.dtype == k_cache.dtype, (k_cache.dtype, v_cache.dtype)
    fp8 = check_kv_scales(k_cache.dtype, k_scale, v_scale)
    norm = q_norm_weight is not None
    assert (k_norm_weight is not None) == norm, "give both QK-norm weights or neither"
    if norm:
        assert q_norm_weight.shape == k_norm_weight.shape == (head_dim,), (q_norm_weight.shape, k_norm_weight.shape)
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device) if out is None else out
    assert q.shape == (num_tokens, num_heads, head_dim) and q.dtype == qkv.dtype and q.is_contiguous(), q.shape
    if num_tokens == 0:
        return q
    _qkv_prologue_kernel[(num_tokens, 2)](
        qkv, positions, cos, sin,
        q_norm_weight if norm else cos, k_norm_weight if norm else cos,  # unread without a norm
        q, k_cache, v_cache, slot_mapping,
        k_scale if fp8 else cos, v_scale if fp8 else cos,  # unread without FP8
        qkv.stride(0), q.stride(0), num_kv_heads * head_dim, *v_strides, cos.stride(0), eps,
        float(weight_offset or 0.0),
        PAGE=k_cache.shape[1], NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_KV=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2), NORM=norm, F32_WEIGHT=weight_offset is not None,
        FP8=fp8, **pdl_launch(qkv.device),
    )  # fmt: skip
    return q
