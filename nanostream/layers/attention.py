"""The attention layer: a step's new tokens attend over their sequences' paged KV context.

A step's tokens are packed: sequence ``i`` contributes the query tokens
``q[cu_seqlens_q[i]:cu_seqlens_q[i+1]]``, which are the last ones of its ``seq_lens[i]`` tokens of
context; the earlier context lives in the KV pool at the blocks of ``block_tables[i]``. Prefill,
chunked prefill, prefix-cache hits and decode are all this one shape (decode: one query token).

``Attention`` takes the fused qkv projection's output and does everything up to the attention
output: QK-norm (where the model has it), rotary embedding, the store of the new K/V at
``slot_mapping`` (-1: a padding token, stored nowhere), attention through its backend
(layers/attention_backend.py). How is fixed when the layer is built: with a backend that brings a
fused prologue (Triton), one kernel norms, rotates and stores; otherwise the modules do, and the
backend stores. What changes per step (``AttentionMetadata``, the KV pool) comes in ``ForwardContext``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nanostream.layers.attention_backend import AttentionBackend, AttentionMetadata, KVCache
from nanostream.layers.norm import RMSNorm, RMSNormFn, rms_norm
from nanostream.layers.rotary import RotaryEmbedding


@dataclass
class ForwardContext:
    """Everything a forward pass needs beyond the token ids and positions, passed down explicitly."""

    attn: AttentionMetadata
    kv_caches: list[KVCache]  # one per layer, views of the KV pool


class Attention(nn.Module):
    """qkv [T, (Hq + 2 Hkv) D] of the step's new tokens -> attention output [T, Hq D].

    ``qk_norm_eps``: RMSNorm each head's q and k first (Qwen3's QK-norm; ``q_norm``/``k_norm`` hold the
    weights). ``rotary`` is the model's one table, shared by its layers. ``norm_kernel`` runs the QK-norm
    where no fused prologue does.
    """

    def __init__(
        self,
        layer_idx: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        qk_norm_eps: float | None = None,
        norm_kernel: RMSNormFn = rms_norm,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.split_sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        self.scale = head_dim**-0.5
        self.rotary = rotary
        self.backend = backend
        self.prologue = backend.prologue  # QK-norm, rotary and the store in one kernel, or None
        self.qk_norm = qk_norm_eps is not None
        if self.qk_norm:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, norm_kernel)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, norm_kernel)

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # positions: [T], qkv: [T, (Hq + 2 Hkv) D]
        cache = ctx.kv_caches[self.layer_idx]
        if self.prologue is not None:
            norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else (None, None, 0.0)
            q = self.prologue(
                qkv, positions, self.rotary.cos, self.rotary.sin, *norms, cache.k, cache.v, ctx.attn.slot_mapping,
                self.num_heads, self.num_kv_heads,
            )  # fmt: skip
            return self.backend.attend(q, cache, ctx.attn, self.scale).flatten(1)
        q, k, v = qkv.split(self.split_sizes, -1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return self.backend.forward(q, k, v, cache, ctx.attn, self.scale).flatten(1)
