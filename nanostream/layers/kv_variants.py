"""Attention layers whose K and V depart from the projections' (Gemma 4), each an ``Attention`` (layers/attention.py)
that changes what it stores or where it reads:

- ``NormedValueAttention``: V is RMS-normed without a weight before it is stored (``v_norm``); with
  ``values_from_keys`` the layer has no v projection and V is the k projection's output, taken before the keys'
  norm and rotation (``attention_k_eq_v``). Its input is [q | k] or [q | k | v].
- ``SharedKVAttention``: the layer has a q projection alone and attends to an earlier layer's pages (``SharedKV``:
  Gemma 4's KV-shared layers, ``num_kv_shared_layers``), which it reads and never writes; it costs no KV::

    attn = SharedKVAttention(5, 8, 2, 256, rotary, backend, eps, source=3)
    attn.cache_spec()   # SharedKV(source=3): the engine gives it layer 3's KVCache
"""

from __future__ import annotations

import torch

from nanostream.kernels.fp8_kv import FP8_KV_DTYPE
from nanostream.layers.attention import Attention, ForwardContext
from nanostream.layers.cache_spec import SharedKV
from nanostream.layers.norm import RMSNorm


class NormedValueAttention(Attention):
    def __init__(self, *args, values_from_keys: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.values_from_keys = values_from_keys
        self.projected_sizes = self.split_sizes[:2] if values_from_keys else self.split_sizes  # the input's parts
        eps = self.q_norm.eps if self.qk_norm else 1e-6
        self.v_norm = RMSNorm(self.head_dim, eps, weight_offset=0.0, learned=False)

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # qkv: [T, (Hq + Hkv) D] with values_from_keys, else [T, (Hq + 2 Hkv) D]
        q, k, *v = qkv.split(self.projected_sizes, -1)
        v = k if self.values_from_keys else v[0]
        v = self.v_norm(v.unflatten(-1, (self.num_kv_heads, self.head_dim))).flatten(1)
        return self._attend(positions, torch.cat((q, k, v), -1), ctx)


class SharedKVAttention(Attention):
    def __init__(self, *args, source: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.source = source
        self.split_sizes = self.split_sizes[:1]
        if self.qk_norm:
            del self.k_norm  # no keys of its own

    def cache_spec(self) -> SharedKV:
        return SharedKV(self.source)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # q: [T, Hq D] -> [T, Hq D], attending to the source layer's pages (its KVCache is this layer's view)
        q = q.view(-1, self.num_heads, self.head_dim)
        if self.qk_norm and not self.qk_norm_after_rotary:
            q = self.q_norm(q)
        if self.rotary is not None:
            q, _ = self.rotary(positions, q, q[:, :1])
        if self.qk_norm and self.qk_norm_after_rotary:
            q = self.q_norm(q)
        if self.temperature is not None:
            q = self.temperature(positions, q)
        cache = ctx.kv_caches[self.layer_idx]
        options = self._options if self.sinks is None else {**self._options, "sinks": self.sinks.weight}
        if cache.k.dtype == FP8_KV_DTYPE:  # the pages as the source stored them: its scales
            raise ValueError("an FP8 KV cache with KV-shared layers is not supported yet; use kv_cache_dtype='auto'")
        return self.backend.attend(q, cache, ctx.attn.group(cache.group), self.scale, **options).flatten(1)
