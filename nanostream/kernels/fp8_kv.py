"""The FP8 KV cache's format (``kv_cache_dtype="fp8"``), shared by the Triton kernels and the torch backend
(layers/attention_backend.py): float8 e4m3 elements, each K or V element stored as ``x / scale`` saturated at
+-448 with a [1] float32 scale per layer and tensor; the references of the store and the read; the check of a
launch's scales. Torch only (no Triton): the layers import it at any time.

The pool's V is laid out with a block's rows fastest ([blocks, Hkv, D, block_size] under the [blocks,
block_size, Hkv, D] view the code indexes): the attention's P V product sums over rows, and its float16
operand then loads as 4 adjacent rows a word, where rows D apart would take a byte load each (on an H200 at
Qwen3-8B's heads, decode attention ran 1.6x faster this way). K keeps [blocks, block_size, Hkv, D]: Q K^T
sums over D.
"""

from __future__ import annotations

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_KV_MAX = torch.finfo(FP8_KV_DTYPE).max
"""448, e4m3's largest value: a stored K or V element saturates here (e4m3fn has no infinity, and a cast past
it would be NaN on some devices)."""


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` in float32, saturated at +-448, NaN as 0, as float8 e4m3 (``scale``: [1] float32): no
    pool byte is NaN, so the kernels may read a block's rows past a context's end and multiply them by 0."""
    return (x.float() / scale).nan_to_num_(0.0).clamp_(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV_DTYPE)


def dequantize_kv(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``stored * scale`` in float32, as ``dtype`` (the model's)."""
    return (stored.float() * scale).to(dtype)


def check_kv_scales(cache_dtype: torch.dtype, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> bool:
    """Whether the pool is FP8 (so K and V are scaled); raise ``ValueError`` unless [1] float32 scales come
    with an FP8 pool, and only with one."""
    fp8 = cache_dtype == FP8_KV_DTYPE
    if fp8 != (k_scale is not None) or fp8 != (v_scale is not None):
        raise ValueError(
            f"k_scale and v_scale go with a {FP8_KV_DTYPE} KV cache, and only with one; this cache is {cache_dtype}"
        )
    if fp8 and not all(s.shape == (1,) and s.dtype == torch.float32 for s in (k_scale, v_scale)):
        raise ValueError(f"k_scale and v_scale must be [1] float32 tensors, got {k_scale!r} and {v_scale!r}")
    return fp8
