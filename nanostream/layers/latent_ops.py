"""The latent cache's store and reads, and the torch reference of multi-head latent attention's two ways to attend
(layers/latent_attention.py is the layer that calls them).

A token's cache entry is ``[c | k_pe]``: the normed latent c (kv_lora_rank C values) and the rotated rope key
shared by every head (qk_rope_head_dim R values). Head h's key is ``[c W_UK[h] | k_pe]`` and its value
``c W_UV[h]`` (W_UK [nope, C] and W_UV [v, C]: head h's rows of kv_b_proj). Two ways to attend:

- expanded (prefill, ``attend_expanded``): K and V of every head computed from the entries of the chunk and its
  cached prefix, then softmax attention as a plain layer's. Its work grows with query tokens x context x heads.
- absorbed (decode, ``LatentDecodeFn``): ``q_nope W_UK[h]`` is a query in the latent space, so
  ``q . k = [q_nope W_UK[h] | q_pe] . [c | k_pe]``: every head attends the one entry a token, and the output
  ``sum_t p_t c_t`` goes through W_UV[h] once. Each entry is read once for all heads: a step reads C + R values a
  token, where an expanded cache would read H (nope + R + v).

An FP8 cache (``kv_cache_dtype="fp8"``) stores ``quantize_kv(entry, k_scale)`` (kernels/fp8_kv.py; the layer's
k_scale, 1.0 unless its checkpoint has one) and reads it back as ``stored * k_scale``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from nanostream.kernels.fp8_kv import FP8_KV_DTYPE, dequantize_kv, quantize_kv
from nanostream.layers.attention_backend import AttentionMetadata
from nanostream.layers.cache_spec import LatentCache


class LatentDecodeFn(Protocol):
    """``(q [B, H, C + R], latent [num_blocks, block_size, C + R], block_tables [B, W] int32, seq_lens [B] int32,
    scale, max_seq_len, kv_lora_rank; k_scale [1] float32 with an FP8 cache) -> [B, H, C]``: each query's softmax
    over its sequence's entries (scores against the whole entry), weighting their latents (the first C values):
    ``latent_decode_reference`` or ``nanostream.kernels.mla_decode.paged_mla_decode``."""

    def __call__(
        self, q: torch.Tensor, latent: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
        scale: float, max_seq_len: int, kv_lora_rank: int, k_scale: torch.Tensor | None = None,
    ) -> torch.Tensor: ...  # fmt: skip


def store_latent(cache: LatentCache, entries: torch.Tensor, slots: torch.Tensor, k_scale: torch.Tensor | None) -> None:
    """``entries`` [T, C + R] at ``slots`` [T] (-1: a padding token, stored nowhere); quantized where the cache is
    FP8 (``k_scale`` given). The reference: it reads the slots on the host (the Triton store does not, for CUDA
    graphs)."""
    keep = slots >= 0
    if not bool(keep.all()):
        entries, slots = entries[keep], slots[keep]
    bs = cache.block_size
    if cache.latent.dtype == FP8_KV_DTYPE:  # (index_put_ has no float8 kernel on the CPU: the bytes are copied)
        cache.latent.view(torch.uint8)[slots // bs, slots % bs] = quantize_kv(entries, k_scale).view(torch.uint8)
    else:
        cache.latent[slots // bs, slots % bs] = entries.to(cache.latent.dtype)


def read_latent(stored: torch.Tensor, k_scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Entries read from the cache as they are, or dequantized to ``dtype`` where it is FP8 (``k_scale`` given)."""
    return stored if k_scale is None else dequantize_kv(stored, k_scale, dtype)


def latent_decode_reference(
    q: torch.Tensor, latent: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    max_seq_len: int, kv_lora_rank: int, k_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """The absorbed attention of one query token per sequence (``LatentDecodeFn``), in torch: every sequence at
    once over its blocks' entries, positions past its length masked; float32 scores and softmax."""
    bs = latent.shape[1]
    num_blocks = -(-max_seq_len // bs)
    tables = block_tables[:, :num_blocks].long()  # [B, nb]
    entries = read_latent(latent[tables], k_scale, q.dtype).flatten(1, 2).float()  # [B, L, C + R]
    scores = torch.einsum("bhd,bld->bhl", q.float(), entries) * scale  # [B, H, L]
    pos = torch.arange(entries.shape[1], device=q.device)
    scores = scores.masked_fill((pos[None, :] >= seq_lens[:, None])[:, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    return torch.einsum("bhl,blc->bhc", p, entries[..., :kv_lora_rank]).to(q.dtype)  # [B, H, C]


@dataclass(frozen=True)
class LatentKernels:
    """What a latent attention layer stores and decodes with (``LayerKernels.latent``): the torch references, or
    the Triton kernels (nanostream/kernels/mla_decode.py) where the attention backend runs Triton."""

    store: Callable[[LatentCache, torch.Tensor, torch.Tensor, torch.Tensor | None], None] = store_latent
    decode: LatentDecodeFn = latent_decode_reference


def attend_expanded(
    q: torch.Tensor,
    cache: LatentCache,
    meta: AttentionMetadata,
    expand: torch.nn.Module,
    num_heads: int,
    nope_dim: int,
    scale: float,
    k_scale: torch.Tensor | None,
) -> torch.Tensor:
    """Softmax attention of the step's query tokens over K and V expanded from their sequences' entries.

    q: [T, H, nope + R] (each head's [q_nope | rotated q_pe]); ``expand``: kv_b_proj (this rank's heads), latent
    [L, C] -> [L, H (nope + v)]. Returns [T, H, v]."""
    bs, width = cache.block_size, cache.latent.shape[-1]
    rope_dim = q.shape[-1] - nope_dim
    c = width - rope_dim
    outs = []
    for i, seq_len in enumerate(meta.seq_lens_host):
        start, end = meta.cu_seqlens_q_host[i], meta.cu_seqlens_q_host[i + 1]
        blocks = meta.block_tables[i, : -(-seq_len // bs)].long()
        entries = read_latent(cache.latent[blocks].flatten(0, 1)[:seq_len], k_scale, q.dtype)  # [L, C + R]
        kv = expand(entries[:, :c]).view(seq_len, num_heads, -1)  # [L, H, nope + v]
        k_pe = entries[:, None, c:].expand(seq_len, num_heads, rope_dim)
        k = torch.cat((kv[..., :nope_dim], k_pe), -1)  # [L, H, nope + R]
        v = kv[..., nope_dim:]  # [L, H, v]
        # Query j sits at position seq_len - q_len + j and sees keys at positions <= its own.
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)[:, None]
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos
        o = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
        )  # [H, q_len, v]
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)
