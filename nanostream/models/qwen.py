"""The Qwen2 / Qwen3 decoder, one implementation for both.

Qwen3 adds RMSNorm on each head's queries and keys (QK-norm); Qwen2 has biases on q/k/v. Parameter
names follow the Hugging Face checkpoints, except the fused ``qkv_proj`` and ``gate_up_proj``
(see ``packed_modules``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanostream.layers.attention import AttentionBackend, AttentionMetadata, KVCache
from nanostream.layers.linear import MergedLinear
from nanostream.layers.norm import RMSNorm
from nanostream.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class DecoderSpec:
    """The shape of a decoder, read from a Hugging Face config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool


@dataclass
class ForwardContext:
    """Everything a forward pass needs beyond the token ids, passed down explicitly."""

    attn: AttentionMetadata
    kv_caches: list[KVCache]
    backend: AttentionBackend


class Attention(nn.Module):
    def __init__(self, spec: DecoderSpec, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.qkv_proj = MergedLinear(spec.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, spec.qkv_bias)
        self.o_proj = nn.Linear(q_size, spec.hidden_size, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.qk_norm = spec.qk_norm
        self.scale = spec.head_dim**-0.5

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext, rotary: RotaryEmbedding):
        # x: [T, hidden]
        qkv = self.qkv_proj(x)
        cache = ctx.kv_caches[self.layer_idx]
        if ctx.backend.prologue is not None:  # norm, rotary and the K/V store in one kernel
            norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else (None, None, 0.0)
            q = ctx.backend.prologue(
                qkv, positions, rotary.cos, rotary.sin, *norms, cache.k, cache.v, ctx.attn.slot_mapping,
                self.num_heads, self.num_kv_heads,
            )  # fmt: skip
            return self.o_proj(ctx.backend.attend(q, cache, ctx.attn, self.scale).flatten(1))
        q, k, v = qkv.split(
            [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim], -1
        )
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        out = ctx.backend.forward(q, k, v, cache, ctx.attn, self.scale)
        return self.o_proj(out.flatten(1))


class SiluAndMul(nn.Module):
    """silu(gate) * up of a fused [T, 2 * I] projection (a module so the runner can compile it, or give it
    ``kernel``: nanostream.kernels.norm_act.silu_and_mul)."""

    def __init__(self) -> None:
        super().__init__()
        self.kernel: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x)
        gate, up = x.chunk(2, -1)
        return F.silu(gate) * up


class MLP(nn.Module):
    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        size = spec.intermediate_size
        self.gate_up_proj = MergedLinear(spec.hidden_size, {"gate": size, "up": size}, bias=False)
        self.act = SiluAndMul()
        self.down_proj = nn.Linear(size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, layer_idx)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, positions, x, residual, ctx, rotary):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, ctx, rotary)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.rotary = RotaryEmbedding(spec.head_dim, spec.max_position, spec.rope_theta)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, ctx, self.rotary)
        x, _ = self.norm(x, residual)
        return x


class QwenForCausalLM(nn.Module):
    """``forward`` gives hidden states [T, hidden]; ``compute_logits`` turns selected rows into logits."""

    # checkpoint module name -> (fused module name, shard)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        self.spec = spec
        self.model = DecoderModel(spec)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # the model's dtype: the sampler upcasts where it must
