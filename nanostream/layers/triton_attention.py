"""The ``triton`` attention backend: nanostream's own kernels (``nanostream.kernels``), any CUDA GPU; with an
FP8 KV cache, a GPU that converts float8 e4m3 (sm89 and newer: Ada, Hopper, Blackwell)."""

from __future__ import annotations

import os

import torch

from nanostream.kernels.fp8_kv import FP8_KV_DTYPE
from nanostream.layers.attention_backend import AttentionBackend, AttentionMetadata, KVCache, check_window

FP8_MIN_ARCH = (8, 9)  # Triton converts float8 e4m3 (its fp8e4nv) on sm89 and newer


def triton_unavailable_reason(device: torch.device, kv_cache_dtype: torch.dtype | None = None) -> str | None:
    """None when the Triton kernels can run on ``device`` with a KV pool of ``kv_cache_dtype`` (None: the
    model's dtype), else what is missing."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed (pip install triton)"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"the Triton kernels need a CUDA device, not {device.type} (or TRITON_INTERPRET=1 to interpret them)"
    if kv_cache_dtype == FP8_KV_DTYPE and device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < FP8_MIN_ARCH:
            return (
                f"the Triton kernels read an FP8 KV cache on sm89 or newer GPUs (Ada, Hopper, Blackwell), this one "
                f"is sm{major}{minor}; use kv_cache_dtype='auto' here"
            )
    return None


class TritonAttention(AttentionBackend):
    """Store the new K/V, then paged decode (flash-decoding) or paged varlen prefill attention."""

    name = "triton"
    supports_cuda_graphs = True

    def __init__(self, *, batch_invariant: bool = False) -> None:
        self.batch_invariant = batch_invariant
        from nanostream.kernels.decode_attention import paged_decode_attention
        from nanostream.kernels.prefill_attention import paged_prefill_attention
        from nanostream.kernels.qkv_prologue import qkv_prologue
        from nanostream.kernels.store_kv import store_kv

        self._store, self._decode, self._prefill = store_kv, paged_decode_attention, paged_prefill_attention
        self.prologue = qkv_prologue
        # The batch-invariant mode: both kernels compute a query's row from its position and context alone
        # (no split by the batch, one tile, every tile masked), and the same bits for the same row.
        self._decode_options = self._prefill_options = {"batch_invariant": True} if batch_invariant else {}

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float,
        *, window: int | None = None, chunk: int | None = None, sinks: torch.Tensor | None = None,
        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        self._store(k, v, cache.k, cache.v, meta.slot_mapping, k_scale=k_scale, v_scale=v_scale)
        extra = dict(window=window, chunk=chunk, sinks=sinks, k_scale=k_scale, v_scale=v_scale)
        return self.attend(q, cache, meta, scale, **extra)

    def attend(
        self, q: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float,
        *, window: int | None = None, chunk: int | None = None, sinks: torch.Tensor | None = None,
        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        check_window(window, chunk)
        extra = dict(window=window, chunk=chunk, sinks=sinks, k_scale=k_scale, v_scale=v_scale)
        if meta.is_decode:
            return self._decode(
                q, cache.k, cache.v, meta.block_tables, meta.seq_lens, scale, meta.max_seqlen_k, **extra,
                **self._decode_options,
            )  # fmt: skip
        if not meta.num_decodes:
            return self._prefill(
                q, cache.k, cache.v, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, meta.max_seqlen_q, scale,
                q_last=meta.limits(window), **extra, **self._prefill_options,
            )  # fmt: skip
        # A mixed step: the decode rows through the decode kernel, the prompt chunks through the prefill one.
        decode, rest = meta.decode_split
        n, out = meta.num_decodes, torch.empty_like(q)
        self._decode(
            q[:n], cache.k, cache.v, decode.block_tables, decode.seq_lens, scale, decode.max_seqlen_k, out[:n],
            **extra, **self._decode_options,
        )  # fmt: skip
        self._prefill(
            q[n:], cache.k, cache.v, rest.cu_seqlens_q, rest.seq_lens, rest.block_tables, rest.max_seqlen_q, scale,
            out[n:], q_last=rest.limits(window), **extra, **self._prefill_options,
        )  # fmt: skip
        return out
