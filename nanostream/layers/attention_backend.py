"""Attention backends: store a step's new K/V and attend over the paged pool, and the types they share
(a step's ``AttentionMetadata``, a layer's ``KVCache``); layers/backends.py picks one (``get_backend``).

Backends: ``torch`` (reference, any device, here), ``triton`` (nanostream's kernels, layers/triton_attention.py)
and ``flash_attn`` (FlashAttention-4 or -2, layers/flash_attention.py). The ``Attention`` layer
(layers/attention.py) is built with one and calls it.

The pool is in the model's dtype, or in float8 e4m3 (``kv_cache_dtype="fp8"``): then each layer passes its
``k_scale`` and ``v_scale`` ([1] float32 tensors), and a backend stores ``quantize_kv(k, k_scale)`` and reads
``dequantize_kv(stored, k_scale)`` (likewise V), as the torch backend here does (the format: kernels/fp8_kv.py)."""

from __future__ import annotations

import functools
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanostream.kernels.fp8_kv import check_kv_scales, dequantize_kv, quantize_kv
from nanostream.layers.attention_masks import check_window, visible

log = logging.getLogger(__name__)


@dataclass
class AttentionMetadata:
    """What the attention layers need to know about one step's packed batch."""

    slot_mapping: torch.Tensor  # [T] int64: KV-pool slot of each new token
    cu_seqlens_q: torch.Tensor  # [B+1] int32: query token offsets
    seq_lens: torch.Tensor  # [B] int32: context length of each sequence, new tokens included
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    max_seqlen_q: int
    max_seqlen_k: int
    cu_seqlens_q_host: list[int]  # host copies, for backends that loop in Python
    seq_lens_host: list[int]
    q_last: torch.Tensor | None = None
    """[T] int32: each query's last visible key, where some see past their own (an image's tokens see the whole image:
    ``limits``); None: causal. ``q_last_windowed``: in windowed layers only (Gemma 4's), the others causal."""
    q_last_windowed: bool = False
    kv_groups: tuple[AttentionMetadata, ...] = ()
    """A model whose layers give KV blocks back by different rules has a block table per KV group
    (engine/block_manager.py): groups 1, 2, ...'s metadata, each with its own ``slot_mapping`` and ``block_tables``
    and this one's other fields. This one is group 0's."""

    def limits(self, window: int | None) -> torch.Tensor | None:
        """``q_last`` for a layer of ``window`` (None: full attention), or None where it attends causally."""
        return None if self.q_last_windowed and window is None else self.q_last

    def group(self, g: int) -> AttentionMetadata:
        """The metadata of KV group ``g`` (a layer's ``KVCache.group``)."""
        return self if g == 0 else self.kv_groups[g - 1]

    @property
    def is_decode(self) -> bool:
        return self.max_seqlen_q == 1

    @functools.cached_property
    def num_decodes(self) -> int:
        """How many leading sequences have one query token each (the scheduler puts decodes first). A mixed
        step sends them through a decode kernel: a prefill kernel's query tiles would be mostly empty."""
        cu = self.cu_seqlens_q_host
        return next((i for i in range(len(cu) - 1) if cu[i + 1] - cu[i] != 1), len(cu) - 1)

    @functools.cached_property
    def decode_split(self) -> tuple[AttentionMetadata, AttentionMetadata]:
        """A mixed step as (its ``num_decodes`` leading sequences, the rest), for two kernel calls; made
        once per step, whichever layer asks first. The rest's tensors are copies, so each starts at an
        allocation, as kernels that assume aligned pointers need."""
        n = self.num_decodes
        assert 0 < n < len(self.seq_lens_host), f"no split of {len(self.seq_lens_host)} sequences at {n}"
        decode = AttentionMetadata(
            slot_mapping=self.slot_mapping[:n],
            cu_seqlens_q=self.cu_seqlens_q[: n + 1],
            seq_lens=self.seq_lens[:n],
            block_tables=self.block_tables[:n],
            max_seqlen_q=1,
            max_seqlen_k=max(self.seq_lens_host[:n]),
            cu_seqlens_q_host=self.cu_seqlens_q_host[: n + 1],
            seq_lens_host=self.seq_lens_host[:n],
        )
        rest = AttentionMetadata(
            slot_mapping=self.slot_mapping[n:],  # K/V are stored before the split: not read
            cu_seqlens_q=self.cu_seqlens_q[n:] - n,  # row n starts at token n: one token per decode row
            seq_lens=self.seq_lens[n:].clone(),
            block_tables=self.block_tables[n:].clone(),
            max_seqlen_q=self.max_seqlen_q,
            max_seqlen_k=max(self.seq_lens_host[n:]),
            cu_seqlens_q_host=[c - n for c in self.cu_seqlens_q_host[n:]],
            seq_lens_host=self.seq_lens_host[n:],
            q_last=None if self.q_last is None else self.q_last[n:],  # decode rows see up to their own position
            q_last_windowed=self.q_last_windowed,
        )
        return decode, rest


@dataclass
class KVCache:
    """One layer's slice of the KV pool: [num_blocks, block_size, num_kv_heads, head_dim] each (an FP8 pool's
    ``v`` a view with the block's rows fastest: nanostream/engine/runner/kv_pool.py)."""

    k: torch.Tensor
    v: torch.Tensor
    group: int = 0  # its KV group: whose block tables address it (``AttentionMetadata.group``)

    @property
    def block_size(self) -> int:
        return self.k.shape[1]


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
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float,
        *, window: int | None = None, chunk: int | None = None, sinks: torch.Tensor | None = None,
        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """q: [T, Hq, D], k and v: [T, Hkv, D] (new tokens). Stores k/v in ``cache``; returns [T, Hq, D].

        ``window``: sliding-window attention, transformers' ``sliding_window``: a query at position p sees the keys at
        positions p - window < k <= p (``window`` of them, its own included); None: all up to p. ``chunk``: chunked
        local attention, transformers' ``attention_chunk_size``: a query at position p sees the keys of its chunk,
        p - p % chunk <= k <= p; None: no chunks. ``sinks``: [Hq] float32, gpt-oss's attention sinks: one logit per
        query head that joins each query's softmax denominator and carries no value, out = sum_k e^s_k v_k /
        (sum_k e^s_k + e^sink). ``k_scale``, ``v_scale``: [1] float32, given with an FP8 pool and only then: K/V are
        stored as ``quantize_kv(k, k_scale)`` and read as ``dequantize_kv``. All are the layer's, fixed for its life::

            out = backend.forward(q, k, v, cache, meta, head_dim**-0.5, window=128, sinks=layer.sinks)
        """

    def attend(
        self, q: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float,
        *, window: int | None = None, chunk: int | None = None, sinks: torch.Tensor | None = None,
        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """``forward`` for new tokens whose K/V are already in ``cache`` (a prologue stored them, or another layer whose
        pages these are: ``SharedKV``)."""
        raise NotImplementedError(f"the {self.name} backend stores K/V itself: call forward")


ALIGNED = 32
"""Query positions per attention call of the torch backend in the batch-invariant mode."""


class TorchAttention(AttentionBackend):
    """Reference backend: scaled-dot-product attention over K/V gathered from the pool. Any device.

    With ``sinks`` the softmax is written out (SDPA has no sink term): float32 logits, the sink as one
    more column, as transformers' gpt-oss eager attention computes it. An FP8 pool is read back
    dequantized in the model's dtype, then attended as a pool in that dtype would be. ``batch_invariant``:
    each query in its aligned block of positions (``_aligned``), so that its result depends on its position
    and context alone.
    """

    name = "torch"

    def __init__(self, *, batch_invariant: bool = False) -> None:
        self.batch_invariant = batch_invariant

    def forward(self, q, k, v, cache, meta, scale, *, window=None, chunk=None, sinks=None, k_scale=None, v_scale=None):
        check_window(window, chunk)
        fp8 = check_kv_scales(cache.k.dtype, k_scale, v_scale)
        bs = cache.block_size
        slots = meta.slot_mapping
        if fp8:  # (index_put_ has no float8 kernel on the CPU: the bytes are copied)
            cache.k.view(torch.uint8)[slots // bs, slots % bs] = quantize_kv(k, k_scale).view(torch.uint8)
            cache.v.view(torch.uint8)[slots // bs, slots % bs] = quantize_kv(v, v_scale).view(torch.uint8)
        else:
            cache.k[slots // bs, slots % bs] = k.to(cache.k.dtype)
            cache.v[slots // bs, slots % bs] = v.to(cache.v.dtype)
        return self.attend(q, cache, meta, scale, window=window, chunk=chunk, sinks=sinks, k_scale=k_scale,
                           v_scale=v_scale)  # fmt: skip

    def attend(self, q, cache, meta, scale, *, window=None, chunk=None, sinks=None, k_scale=None, v_scale=None):
        check_window(window, chunk)
        bs = cache.block_size
        if self.batch_invariant:
            assert meta.q_last is None, "the batch-invariant mode attends causally only"
            return self._aligned(q, cache, meta, scale, window, chunk, sinks, k_scale, v_scale)
        if meta.is_decode:
            return self._decode(q, cache, meta, scale, window, chunk, sinks, k_scale, v_scale)
        out = torch.empty_like(q)
        for i, seq_len in enumerate(meta.seq_lens_host):
            start, end = meta.cu_seqlens_q_host[i], meta.cu_seqlens_q_host[i + 1]
            slots = self._slots(meta.block_tables[i], seq_len, bs)
            # [1, H, L, D] views for SDPA
            qi = q[start:end].transpose(0, 1)[None]
            ki = self._gather(cache.k, slots, bs, k_scale, q.dtype).transpose(0, 1)[None]
            vi = self._gather(cache.v, slots, bs, v_scale, q.dtype).transpose(0, 1)[None]
            # Query j sits at position seq_len - q_len + j and sees keys at positions <= its own (or q_last's).
            q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)[:, None]
            k_pos = torch.arange(seq_len, device=q.device)[None, :]
            last = None if meta.limits(window) is None else meta.q_last[start:end, None]
            mask = visible(k_pos, q_pos, window, chunk, last)
            out[start:end] = self._attention(qi, ki, vi, mask, scale, sinks)[0].transpose(0, 1)
        return out

    def _aligned(self, q, cache, meta, scale, window, chunk, sinks, k_scale, v_scale):
        # The batch-invariant mode: a query at position p is attended in the block of ALIGNED positions
        # that holds it, [p0, p0 + ALIGNED) with p0 a multiple of ALIGNED, against the keys [0, p0 + ALIGNED)
        # (zeros past the context, masked), the block's other rows zeros or the neighbours' queries. Every
        # SDPA call then has a shape set by p alone: the same whether p is decoded, prefilled whole or in a
        # chunk of any length, in a batch of any size, or recomputed after a preemption.
        out = torch.empty_like(q)
        hq, d = q.shape[1:]
        bs = cache.block_size
        for i, seq_len in enumerate(meta.seq_lens_host):
            start, end = meta.cu_seqlens_q_host[i], meta.cu_seqlens_q_host[i + 1]
            first = seq_len - (end - start)  # the first query's position
            slots = self._slots(meta.block_tables[i], seq_len, bs)
            keys = self._gather(cache.k, slots, bs, k_scale, q.dtype)  # [seq_len, Hkv, D]
            values = self._gather(cache.v, slots, bs, v_scale, q.dtype)
            for p0 in range(first // ALIGNED * ALIGNED, seq_len, ALIGNED):
                p1, lo, hi = p0 + ALIGNED, max(p0, first), min(p0 + ALIGNED, seq_len)
                qi = q.new_zeros(ALIGNED, hq, d)
                qi[lo - p0 : hi - p0] = q[start + lo - first : start + hi - first]
                ki = F.pad(keys[:p1], (0, 0, 0, 0, 0, max(0, p1 - seq_len)))  # [p1, Hkv, D]
                vi = F.pad(values[:p1], (0, 0, 0, 0, 0, max(0, p1 - seq_len)))
                q_pos = torch.arange(p0, p1, device=q.device)[:, None]
                k_pos = torch.arange(p1, device=q.device)[None, :]
                mask = visible(k_pos, q_pos, window, chunk)
                o = self._attention(qi.transpose(0, 1)[None], ki.transpose(0, 1)[None], vi.transpose(0, 1)[None],
                                    mask, scale, sinks)  # fmt: skip
                out[start + lo - first : start + hi - first] = o[0].transpose(0, 1)[lo - p0 : hi - p0]
        return out

    @staticmethod
    def _gather(
        pool: torch.Tensor, slots: torch.Tensor, bs: int, scale: torch.Tensor | None, dtype: torch.dtype
    ) -> torch.Tensor:
        """The rows at ``slots`` of a [num_blocks, bs, Hkv, D] pool (either layout), dequantized to ``dtype``
        where the pool is FP8 (``scale`` given)."""
        return TorchAttention._read(pool[slots // bs, slots % bs], scale, dtype)

    @staticmethod
    def _read(stored: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """Values read from the pool as they are, or dequantized to ``dtype`` where it is FP8 (``scale`` given)."""
        return stored if scale is None else dequantize_kv(stored, scale, dtype)

    @staticmethod
    def _slots(block_table: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
        blocks = block_table[: -(-seq_len // block_size)].long()
        offsets = torch.arange(block_size, device=block_table.device)
        return (blocks[:, None] * block_size + offsets[None, :]).flatten()[:seq_len]

    @staticmethod
    def _attention(q, k, v, mask, scale, sinks):
        # q: [N, Hq, Lq, D], k and v: [N, Hkv, L, D]; mask: bool, broadcast to [N, Hq, Lq, L]
        if sinks is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        n, hq, lq, d = q.shape
        hkv = k.shape[1]
        dtype = torch.promote_types(q.dtype, torch.float32)  # float32 logits for bf16/fp16 models
        # The G = Hq / Hkv query heads of a KV head as one matrix of G * Lq rows: no copy of K/V per head.
        qg = q.to(dtype).reshape(n, hkv, hq // hkv * lq, d)
        s = (qg @ k.to(dtype).transpose(-1, -2)).view(n, hq, lq, -1) * scale
        s = s.masked_fill(~mask, float("-inf"))
        s = torch.cat([s, sinks.to(dtype).view(1, hq, 1, 1).expand(n, hq, lq, 1)], -1)
        p = torch.softmax(s - s.amax(-1, keepdim=True), -1)[..., :-1]  # the sink column carries no value
        out = p.reshape(n, hkv, hq // hkv * lq, -1) @ v.to(dtype)
        return out.view(n, hq, lq, d).to(q.dtype)

    def _decode(self, q, cache, meta, scale, window, chunk, sinks, k_scale, v_scale):
        # All sequences at once: each block table's blocks gathered, the positions the query cannot see masked.
        bs = cache.block_size
        num_blocks = -(-meta.max_seqlen_k // bs)
        tables = meta.block_tables[:, :num_blocks].long()  # [B, nb]
        k = self._read(cache.k[tables], k_scale, q.dtype).flatten(1, 2).transpose(1, 2)  # [B, Hkv, nb*bs, D]
        v = self._read(cache.v[tables], v_scale, q.dtype).flatten(1, 2).transpose(1, 2)
        pos = torch.arange(k.shape[2], device=q.device)[None, :]
        mask = visible(pos, meta.seq_lens[:, None] - 1, window, chunk)  # [B, L]: the query is the last token
        out = self._attention(q[:, :, None, :], k, v, mask[:, None, None, :], scale, sinks)  # [B, Hq, 1, D]
        return out[:, :, 0, :]
