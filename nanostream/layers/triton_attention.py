"""The ``triton`` attention backend: nanostream's own kernels (``nanostream.kernels``), any CUDA GPU."""

from __future__ import annotations

import os

import torch

from nanostream.layers.attention_backend import AttentionBackend, AttentionMetadata, KVCache, check_window


def triton_unavailable_reason(device: torch.device) -> str | None:
    """None when the Triton kernels can run on ``device``, else what is missing."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed (pip install triton)"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"the Triton kernels need a CUDA device, not {device.type} (or TRITON_INTERPRET=1 to interpret them)"
    return None


class TritonAttention(AttentionBackend):
    """Store the new K/V, then paged decode (flash-decoding) or paged varlen prefill attention."""

    name = "triton"
    supports_cuda_graphs = True

    def __init__(self) -> None:
        from nanostream.kernels.decode_attention import paged_decode_attention
        from nanostream.kernels.prefill_attention import paged_prefill_attention
        from nanostream.kernels.qkv_prologue import qkv_prologue
        from nanostream.kernels.store_kv import store_kv

        self._store, self._decode, self._prefill = store_kv, paged_decode_attention, paged_prefill_attention
        self.prologue = qkv_prologue

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float,
        *, window: int | None = None, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        self._store(k, v, cache.k, cache.v, meta.slot_mapping)
        return self.attend(q, cache, meta, scale, window=window, sinks=sinks)

    def attend(
        self, q: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float,
        *, window: int | None = None, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        check_window(window)
        extra = dict(window=window, sinks=sinks)
        if meta.is_decode:
            return self._decode(
                q, cache.k, cache.v, meta.block_tables, meta.seq_lens, scale, meta.max_seqlen_k, **extra
            )  # fmt: skip
        if not meta.num_decodes:
            return self._prefill(
                q, cache.k, cache.v, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, meta.max_seqlen_q, scale,
                **extra,
            )  # fmt: skip
        # A mixed step: the decode rows through the decode kernel, the prompt chunks through the prefill one.
        decode, rest = meta.decode_split
        n, out = meta.num_decodes, torch.empty_like(q)
        self._decode(
            q[:n], cache.k, cache.v, decode.block_tables, decode.seq_lens, scale, decode.max_seqlen_k, out[:n],
            **extra,
        )  # fmt: skip
        self._prefill(
            q[n:], cache.k, cache.v, rest.cu_seqlens_q, rest.seq_lens, rest.block_tables, rest.max_seqlen_q, scale,
            out[n:], **extra,
        )  # fmt: skip
        return out
