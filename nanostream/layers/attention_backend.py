"""Attention backends: store a step's new K/V and attend over the paged pool; ``get_backend`` picks one.

Backends: ``torch`` (reference, any device, here), ``triton`` (nanostream's kernels,
layers/triton_attention.py) and ``flash_attn`` (FlashAttention-4 or -2, layers/flash_attention.py).
The ``Attention`` layer (layers/attention.py) is built with one and calls it.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
import torch.nn.functional as F

from nanostream.layers.attention import AttentionMetadata, KVCache

log = logging.getLogger(__name__)


class AttentionBackend(ABC):
    name: str
    supports_cuda_graphs: bool = False
    """Decode runs without host synchronisation, reads only tensors (``max_seqlen_k`` is an upper bound)
    and skips slot -1, so it can be captured in a CUDA graph and replayed on padded batches."""
    prologue: Callable[..., torch.Tensor] | None = None
    """``nanostream.kernels.qkv_prologue.qkv_prologue`` where the backend runs Triton: an ``Attention`` layer
    built with it norms, rotates and stores the new tokens in one kernel, and calls ``attend`` instead of
    ``forward``. Where it is set, the model's norms and SiLU-and-mul run Triton kernels too (layer_kernels.py)."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """q: [T, Hq, D], k and v: [T, Hkv, D] (new tokens). Stores k/v in ``cache``; returns [T, Hq, D]."""

    def attend(self, q: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """``forward`` for new tokens whose K/V are already in ``cache`` (backends with a ``prologue``)."""
        raise NotImplementedError(f"the {self.name} backend stores K/V itself: call forward")


class TorchAttention(AttentionBackend):
    """Reference backend: scaled-dot-product attention over K/V gathered from the pool. Any device."""

    name = "torch"

    def forward(self, q, k, v, cache, meta, scale):
        k_pool = cache.k.view(-1, *cache.k.shape[2:])  # [num_slots, Hkv, D]
        v_pool = cache.v.view(-1, *cache.v.shape[2:])
        k_pool.index_copy_(0, meta.slot_mapping, k.to(k_pool.dtype))
        v_pool.index_copy_(0, meta.slot_mapping, v.to(v_pool.dtype))
        if meta.is_decode:
            return self._decode(q, cache, meta, scale)
        out = torch.empty_like(q)
        bs = cache.block_size
        for i, seq_len in enumerate(meta.seq_lens_host):
            start, end = meta.cu_seqlens_q_host[i], meta.cu_seqlens_q_host[i + 1]
            slots = self._slots(meta.block_tables[i], seq_len, bs)
            # [1, H, L, D] views for SDPA
            qi = q[start:end].transpose(0, 1)[None]
            ki, vi = k_pool[slots].transpose(0, 1)[None], v_pool[slots].transpose(0, 1)[None]
            # Query j sits at position seq_len - q_len + j and sees keys at positions <= its own.
            q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
            out[start:end] = self._sdpa(qi, ki, vi, mask, scale)[0].transpose(0, 1)
        return out

    @staticmethod
    def _slots(block_table: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
        blocks = block_table[: -(-seq_len // block_size)].long()
        offsets = torch.arange(block_size, device=block_table.device)
        return (blocks[:, None] * block_size + offsets[None, :]).flatten()[:seq_len]

    @staticmethod
    def _sdpa(q, k, v, mask, scale):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

    def _decode(self, q, cache, meta, scale):
        # All sequences at once: gather each block table's blocks, mask positions past seq_len.
        bs = cache.block_size
        num_blocks = -(-meta.max_seqlen_k // bs)
        tables = meta.block_tables[:, :num_blocks].long()  # [B, nb]
        k = cache.k[tables].flatten(1, 2).transpose(1, 2)  # [B, Hkv, nb*bs, D]
        v = cache.v[tables].flatten(1, 2).transpose(1, 2)
        mask = torch.arange(k.shape[2], device=q.device)[None, :] < meta.seq_lens[:, None]  # [B, L]
        out = self._sdpa(q[:, :, None, :], k, v, mask[:, None, None, :], scale)  # [B, Hq, 1, D]
        return out[:, :, 0, :]


def get_backend(
    name: str, device: torch.device, *, dtype: torch.dtype, block_size: int, head_dim: int
) -> AttentionBackend:
    """The backend called ``name``. ``auto``: on CUDA, FlashAttention when it is installed and supports
    this GPU and layout, else the Triton kernels, else torch; elsewhere torch."""
    from nanostream.layers.flash_attention import FlashAttention, flash_attn_unavailable_reason
    from nanostream.layers.triton_attention import TritonAttention, triton_unavailable_reason

    reasons = {
        "torch": lambda: None,
        "triton": lambda: triton_unavailable_reason(device),
        "flash_attn": lambda: flash_attn_unavailable_reason(device, dtype, block_size, head_dim),
    }
    classes = {"torch": TorchAttention, "triton": TritonAttention, "flash_attn": FlashAttention}
    if name == "auto":
        skipped = []
        for candidate in ("flash_attn", "triton") if device.type == "cuda" else ():
            reason = reasons[candidate]()
            if reason is None:
                log.info("attention backend: %s (auto)%s", candidate, "".join(f"; {s}" for s in skipped))
                return classes[candidate]()
            skipped.append(f"not {candidate}: {reason}")
        log.info("attention backend: torch (auto)%s", "".join(f"; {s}" for s in skipped))
        return TorchAttention()
    if name not in classes:
        raise ValueError(f"unknown attention backend {name!r}; choose one of auto, {', '.join(classes)}")
    reason = reasons[name]()
    if reason is not None:
        raise ValueError(f"attention_backend={name!r} cannot run here: {reason}; use attention_backend='auto'")
    return classes[name]()
