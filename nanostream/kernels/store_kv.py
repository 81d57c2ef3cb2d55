"""KV store: write each new token's K and V into its slot of the paged pool.

An FP8 pool (float8 e4m3) stores k / k_scale and v / v_scale, saturated at +-448, as the torch backend's
``quantize_kv`` does; a pool in the model's dtype stores the values as they are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanostream.kernels.attention_tile import pool_strides
from nanostream.kernels.fp8_kv import FP8_KV_MAX, check_kv_scales

_FP8_MAX = tl.constexpr(FP8_KV_MAX)


@triton.jit
def quantize_fp8(x, scale):
    """``x / scale`` in float32, saturated at +-448, NaN as 0: the cast to e4m3 is then exact in range and
    no pool byte is NaN (the attention kernels multiply stale rows by 0: attention_tile.py)."""
    x = x.to(tl.float32) / scale
    return tl.minimum(tl.maximum(tl.where(x == x, x, 0.0), -_FP8_MAX), _FP8_MAX)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_vt, stride_cs, stride_vb, stride_vs, stride_vh, stride_vd,
    ROW: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    # One program per token: its K and V rows (Hkv * D contiguous elements each) go to slot `slot`: K's row
    # is contiguous in the pool, V's element (head h, column d) at the strides given.
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:  # padding (a CUDA-graph batch filled up to its bucket)
        return
    if FP8:  # an FP8 pool: each layer's two scales (unread otherwise)
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    for start in tl.static_range(0, ROW, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < ROW
        k = tl.load(k_ptr + t * stride_kt + offs, mask=mask)
        v = tl.load(v_ptr + t * stride_vt + offs, mask=mask)
        if FP8:
            k = quantize_fp8(k, k_scale)
            v = quantize_fp8(v, v_scale)
        tl.store(k_cache_ptr + slot * stride_cs + offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        v_at = (slot // PAGE) * stride_vb + (slot % PAGE) * stride_vs + (offs // D) * stride_vh + (offs % D) * stride_vd
        tl.store(v_cache_ptr + v_at, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store ``k``/``v`` [T, Hkv, D] at ``slot_mapping`` [T] (int64, -1 = skip) of the caches.

    The caches are [num_blocks, block_size, Hkv, D], K contiguous, V contiguous or row-fastest (an FP8 pool's:
    ``pool_strides``); slot = block * block_size + offset.
    ``k_scale``, ``v_scale``: [1] float32, with float8_e4m3fn caches and only then (stored: k / k_scale)::

        store_kv(k, v, k_cache, v_cache, slots, k_scale=layer_k_scale, v_scale=layer_v_scale)
    """
    num_tokens, num_heads, head_dim = k.shape
    assert v.shape == k.shape and slot_mapping.shape == (num_tokens,), (k.shape, v.shape, slot_mapping.shape)
    assert k_cache.shape[2:] == (num_heads, head_dim) and k_cache.is_contiguous(), (k_cache.shape, k.shape)
    v_strides = pool_strides(k_cache, v_cache)[3:]
    # Each token's [Hkv, D] row must be contiguous (a slice of a fused qkv output is, with a row stride).
    assert k.stride()[1:] == (head_dim, 1) and v.stride()[1:] == (head_dim, 1), (k.stride(), v.stride())
    assert slot_mapping.dtype == torch.int64, slot_mapping.dtype
    fp8 = check_kv_scales(k_cache.dtype, k_scale, v_scale)
    assert v_cache.dtype == k_cache.dtype, (k_cache.dtype, v_cache.dtype)
    if num_tokens == 0:
        return
    row = num_heads * head_dim
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k_scale if fp8 else k, v_scale if fp8 else v,  # unread without FP8
        k.stride(0), v.stride(0), row, *v_strides,
        ROW=row, D=head_dim, PAGE=k_cache.shape[1], BLOCK=min(triton.next_power_of_2(row), 1024), FP8=fp8,
    )  # fmt: skip
