"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2, Moonlight, GLM-4.7-Flash, Mistral 4): a token's keys
and values live in the cache as one compressed latent and one rope key shared by every head (layers/cache_spec.py's
``PagedLatent``), and are expanded per head only to attend (layers/latent_ops.py says how, both ways).

    x ─ qkv_proj ─┬─ q_a (q_lora_rank) ─ q_a_layernorm ─ q_b_proj ─┐   (or q_proj's rows: no q LoRA)
                  │                                                ├─ q [H, nope | rope] ─┐
                  └─ kv_a [c (kv_lora_rank) | k_pe (rope)] ─ kv_a_layernorm(c), rotate k_pe ─ cache [c | k_pe]
                                                                                           └─ attend ─ o_proj

``qkv_proj`` fuses the projections of x (``q_a_proj`` or ``q_proj``, and ``kv_a_proj_with_mqa``) into one GEMM.
The rope dims rotate as the family's config says: interleaved pairs (2i, 2i + 1), DeepSeek's ``rope_interleave``,
are gathered into the rotate-half order first (the same order for q and k, so q . k is unchanged). The softmax
scale is (nope + rope) ** -0.5, times DeepSeek's YaRN mscale(factor, mscale_all_dim) squared
(models/latent_config.py); Mistral 4 also scales each query by 1 + beta log(1 + floor(pos / original_max_pos)).

Prefill chunks attend expanded, decode rows absorbed (``LatentKernels.decode``: a Triton paged kernel, or the torch
reference). With tensor parallelism each rank holds whole heads (their rows of q_b_proj / q_proj and kv_b_proj,
their columns of o_proj: one all-reduce) and the whole latent path (q_a, kv_a, their norms, the cache entry).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nanostream.distributed.group import TensorParallel
from nanostream.kernels.fp8_kv import FP8_KV_DTYPE
from nanostream.layers.attention import ForwardContext, KVScales
from nanostream.layers.cache_spec import PagedLatent
from nanostream.layers.latent_ops import LatentKernels, attend_expanded
from nanostream.layers.linear import Gemm, MergedColumnLinear, row_parallel_linear
from nanostream.layers.norm import RMSNorm, RMSNormFn
from nanostream.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class LatentAttentionSpec:
    """The latent attention layers' shape, read from the config (models/latent_config.py)."""

    q_lora_rank: int | None  # None: q_proj straight from the hidden state (DeepSeek-V2-Lite)
    kv_lora_rank: int  # C: the latent's size
    qk_nope_head_dim: int
    qk_rope_head_dim: int  # R: the shared rope key's size, each head's rotated dims
    v_head_dim: int
    scale: float  # the softmax scale
    interleaved: bool = True  # the rope dims rotate in pairs (2i, 2i + 1)
    query_scale_beta: float | None = None  # Mistral 4's llama_4_scaling_beta; None: no per-position query scale
    query_scale_period: int = 1  # ... and its original_max_position_embeddings

    @property
    def width(self) -> int:
        """Values a token a layer in the cache."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def head_rows(heads: range, size: int) -> range:
    return range(heads.start * size, heads.stop * size)


class UpProjection(MergedColumnLinear):
    """kv_b_proj: the decode path reads its weight as W_UK and W_UV, so it stays in the model's dtype (an FP8
    checkpoint's is dequantized on load)."""

    def can_keep_fp8(self, block: tuple[int, int]) -> bool:
        return False


class LatentAttention(nn.Module):
    """qkv [T, q_in + C + R] (``qkv_proj``'s output) -> attention output [T, H v] before o_proj, H: this rank's
    ``heads`` of ``num_heads``."""

    def __init__(
        self,
        spec: LatentAttentionSpec,
        hidden_size: int,
        num_heads: int,
        heads: range,
        eps: float,
        layer_idx: int,
        rotary: RotaryEmbedding,
        kernels: LatentKernels,
        norm_kernel: RMSNormFn,
        gemm: Gemm,
        tp: TensorParallel,
    ) -> None:
        super().__init__()
        self.spec, self.layer_idx, self.rotary, self.kernels = spec, layer_idx, rotary, kernels
        self.num_heads = len(heads)
        nope, rope, c = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.kv_lora_rank
        qk = nope + rope
        q_part = {"q": (head_rows(heads, qk), num_heads * qk)}  # q_proj's rows of this rank's heads
        if spec.q_lora_rank is not None:
            q_part = {"q_a": (range(spec.q_lora_rank), spec.q_lora_rank)}  # whole on every rank
        self.q_in = len(next(iter(q_part.values()))[0])
        self.qkv_proj = MergedColumnLinear(hidden_size, {**q_part, "kv_a": (range(c + rope), c + rope)}, False, gemm)
        self.q_a_layernorm = self.q_b_proj = None
        if spec.q_lora_rank is not None:
            self.q_a_layernorm = RMSNorm(spec.q_lora_rank, eps, norm_kernel)
            rows = {"q_b": (head_rows(heads, qk), num_heads * qk)}
            self.q_b_proj = MergedColumnLinear(spec.q_lora_rank, rows, False, gemm)
        self.kv_a_layernorm = RMSNorm(c, eps, norm_kernel)
        kv_rows = {"kv_b": (head_rows(heads, nope + spec.v_head_dim), num_heads * (nope + spec.v_head_dim))}
        self.kv_b_proj = UpProjection(c, kv_rows, False, gemm)
        self.o_proj = row_parallel_linear(head_rows(heads, spec.v_head_dim), hidden_size, False, tp, gemm)
        self.kv_scales = KVScales(layer_idx)  # an FP8 cache's k_scale (the entry's; v_scale unread)
        order = None
        if spec.interleaved:  # pairs (2i, 2i + 1) -> the tables' (i, i + R/2)
            order = torch.cat((torch.arange(0, rope, 2), torch.arange(1, rope, 2)))
        self.register_buffer("rope_order", order, persistent=False)

    def cache_spec(self) -> PagedLatent:
        """What the layer keeps per token: the latent and the rope key, whole on every rank."""
        return PagedLatent(self.spec.width)

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # positions: [T]; qkv: [T, q_in + C + R]
        spec, h = self.spec, self.num_heads
        nope, rope, c = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.kv_lora_rank
        q, kv_a = qkv.split([self.q_in, c + rope], -1)
        if self.q_b_proj is not None:
            q = self.q_b_proj(self.q_a_layernorm(q.contiguous()))
        q = q.view(-1, h, nope + rope)  # [T, H, nope + R]
        latent = self.kv_a_layernorm(kv_a[:, :c].contiguous())  # [T, C]
        q_pe, k_pe = q[..., nope:], kv_a[:, None, c:]  # [T, H, R], [T, 1, R]
        if self.rope_order is not None:
            q_pe, k_pe = q_pe[..., self.rope_order], k_pe[..., self.rope_order]
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe)
        q = torch.cat((q[..., :nope], q_pe), -1)
        if spec.query_scale_beta is not None:  # Mistral 4: [T, 1, 1], computed as transformers does, then cast
            steps = torch.floor(positions.float() / spec.query_scale_period)
            q = q * (1 + spec.query_scale_beta * torch.log(1 + steps)).to(q.dtype)[:, None, None]
        cache = ctx.kv_caches[self.layer_idx]
        k_scale = self.kv_scales.scales()[0] if cache.latent.dtype == FP8_KV_DTYPE else None
        self.kernels.store(cache, torch.cat((latent, k_pe[:, 0]), -1), ctx.attn.slot_mapping, k_scale)
        meta = ctx.attn
        if meta.is_decode:
            return self._absorbed(q, cache, meta, k_scale).flatten(1)
        n = meta.num_decodes
        if n == 0:
            return self._expanded(q, cache, meta, k_scale).flatten(1)
        decode, rest = meta.decode_split
        out = torch.cat((self._absorbed(q[:n], cache, decode, k_scale), self._expanded(q[n:], cache, rest, k_scale)))
        return out.flatten(1)

    def _up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, C] and W_UV [H, v, C], views of kv_b_proj's weight."""
        nope = self.spec.qk_nope_head_dim
        w = self.kv_b_proj.weight.view(self.num_heads, -1, self.spec.kv_lora_rank)
        return w[:, :nope], w[:, nope:]

    def _absorbed(self, q, cache, meta, k_scale) -> torch.Tensor:
        # q: [B, H, nope + R], one token a sequence -> [B, H, v]
        nope = self.spec.qk_nope_head_dim
        w_uk, w_uv = self._up_weights()
        q_latent = torch.bmm(q[..., :nope].transpose(0, 1), w_uk).transpose(0, 1)  # [B, H, C]
        q_full = torch.cat((q_latent, q[..., nope:]), -1)  # [B, H, C + R]
        o = self.kernels.decode(
            q_full,
            cache.latent,
            meta.block_tables,
            meta.seq_lens,
            self.spec.scale,
            meta.max_seqlen_k,
            self.spec.kv_lora_rank,
            k_scale,
        )  # [B, H, C] fmt: skip
        return torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [B, H, v]

    def _expanded(self, q, cache, meta, k_scale) -> torch.Tensor:
        return attend_expanded(
            q, cache, meta, self.kv_b_proj, self.num_heads, self.spec.qk_nope_head_dim, self.spec.scale, k_scale
        )
