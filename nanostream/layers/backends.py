"""``get_backend``: the attention backend of a name (``auto``: the fastest that runs here)."""

from __future__ import annotations

import logging

import torch

from nanostream.layers.attention_backend import AttentionBackend, TorchAttention
from nanostream.layers.flash_attention import FlashAttention, flash_attn_unavailable_reason
from nanostream.layers.triton_attention import TritonAttention, triton_unavailable_reason

log = logging.getLogger(__name__)


def get_backend(
    name: str,
    device: torch.device,
    *,
    dtype: torch.dtype,
    block_size: int,
    head_dim: int,
    kv_cache_dtype: torch.dtype | None = None,
    batch_invariant: bool = False,
) -> AttentionBackend:
    """The backend called ``name``. ``auto``: on CUDA, FlashAttention when it is installed and supports
    this GPU, layout and KV pool (``kv_cache_dtype``, None: the model's ``dtype``), else the Triton kernels,
    else torch; elsewhere torch. ``batch_invariant``: the Triton or torch backend in the batch-invariant
    mode (FlashAttention splits its work by the batch: refused)."""
    reasons = {
        "torch": lambda: None,
        "triton": lambda: triton_unavailable_reason(device, kv_cache_dtype),
        "flash_attn": lambda: flash_attn_unavailable_reason(device, dtype, block_size, head_dim, kv_cache_dtype),
    }
    if batch_invariant:
        reasons["flash_attn"] = lambda: "FlashAttention splits its work by the batch (batch_invariant needs triton)"
    invariant = {"batch_invariant": True} if batch_invariant else {}
    classes = {
        "torch": lambda: TorchAttention(**invariant),
        "triton": lambda: TritonAttention(**invariant),
        "flash_attn": FlashAttention,
    }
    if name == "auto":
        skipped = []
        for candidate in ("flash_attn", "triton") if device.type == "cuda" else ():
            reason = reasons[candidate]()
            if reason is None:
                log.info("attention backend: %s (auto)%s", candidate, "".join(f"; {s}" for s in skipped))
                return classes[candidate]()
            skipped.append(f"not {candidate}: {reason}")
        log.info("attention backend: torch (auto)%s", "".join(f"; {s}" for s in skipped))
        return classes["torch"]()
    if name not in classes:
        raise ValueError(f"unknown attention backend {name!r}; choose one of auto, {', '.join(classes)}")
    reason = reasons[name]()
    if reason is not None:
        raise ValueError(f"attention_backend={name!r} cannot run here: {reason}; use attention_backend='auto'")
    return classes[name]()
