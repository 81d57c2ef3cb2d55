"""One layer of the shared decoder (models/decoder.py): a token mixer and an MLP, with the family's norms.

The token mixer is the layer's kind (``spec.mixer(i)``): self-attention, a Gated DeltaNet layer
(layers/gated_deltanet.py: Qwen3-Next's and Qwen3.5's ``linear_attention``) or latent attention
(layers/latent_attention.py: DeepSeek's MLA, its q/kv down-projections fused), each in three pieces: its input
projection (``mixer_in``), the mixing over the step's sequences, which alone reads the step's metadata and the
layer's cache (``mixer``), and its output projection (``mixer_out``). A ``DecoderLayer`` owns its forward in two
steps around the mixing, ``attn_in`` (the norms before it, the input projection) and ``attn_out`` (the output
projection, the norms and residual adds around the MLP), so that where a family puts its norms (before each
block as Llama, also after it as Gemma 3 and GLM-4, only after it as OLMo 2: ``LayerNorms``) is the layer's
business. Its MLP is the dense ``MLP`` or, in the layers ``spec.moe`` names, the ``SparseMoE`` block
(layers/moe.py), or the dense MLP with Gemma 4's experts beside it (layers/moe_beside_mlp.py): models/mlps.py.
Every module is built for this rank's shard (models/sharding.py): q/k/v and gate/up column-parallel, o_proj and
down_proj row-parallel; a Gated DeltaNet layer by key heads.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from nanostream.distributed.group import TensorParallel
from nanostream.layers.attention import Attention, ForwardContext, HeadSinks, WholeProjectionNorms
from nanostream.layers.cache_spec import CacheSpec
from nanostream.layers.gated_deltanet import GatedDeltaNet
from nanostream.layers.kv_variants import NormedValueAttention, SharedKVAttention
from nanostream.layers.latent_attention import LatentAttention
from nanostream.layers.layer_kernels import LayerKernels
from nanostream.layers.linear import MergedColumnLinear, row_parallel_linear
from nanostream.layers.norm import RMSNorm
from nanostream.layers.per_layer_inputs import PerLayerInput
from nanostream.layers.rotary import RotaryEmbedding
from nanostream.layers.short_conv import ShortConv
from nanostream.models.mlps import MLP, experts_beside_mlp, layer_mlp
from nanostream.models.sharding import DecoderShard, kv_split
from nanostream.models.spec import DecoderSpec

if TYPE_CHECKING:
    from nanostream.kernels.fp8_gemv import PendingNorm


def _head_rows(heads: range, head_dim: int) -> range:
    return range(heads.start * head_dim, heads.stop * head_dim)


class SelfAttention(nn.Module):
    """Fused q/k/v projection -> the attention layer -> output projection (this rank's heads). With
    ``spec.attn_output_gate`` each head's q rows are the checkpoint's [query D | gate D] (q_proj of 2 Hq D rows)."""

    def __init__(
        self,
        spec: DecoderSpec,
        layer_idx: int,
        rotary: RotaryEmbedding | None,
        kernels: LayerKernels,
        shard: DecoderShard,
        tp: TensorParallel,
    ) -> None:
        super().__init__()
        hkv, d = spec.kv_shape(layer_idx)  # a layer may have its own (Gemma 4's full layers)
        kv_heads = kv_split(hkv, shard.rank, shard.size)
        q_d = 2 * d if spec.attn_output_gate else d
        q_rows, kv_rows = _head_rows(shard.heads, q_d), _head_rows(kv_heads, d)
        q_total, kv_total = spec.num_heads * q_d, hkv * d
        source, from_keys = spec.kv_source(layer_idx), bool(spec.values_from_keys and spec.values_from_keys[layer_idx])
        names = ("q",) if source is not None else ("q", "k") if from_keys else ("q", "k", "v")
        parts = {name: (q_rows, q_total) if name == "q" else (kv_rows, kv_total) for name in names}
        self.qkv_proj = MergedColumnLinear(spec.hidden_size, parts, spec.qkv_bias, kernels.linear)
        attention, variant = Attention, {}
        if source is not None:
            attention, variant = SharedKVAttention, {"source": source}
        elif spec.value_norm:
            attention, variant = NormedValueAttention, {"values_from_keys": from_keys}
        self.attn = attention(
            layer_idx,
            shard.num_heads,
            len(kv_heads),
            d,
            rotary,
            kernels.attention,
            qk_norm_eps=spec.rms_norm_eps if spec.has_qk_norm(layer_idx) else None,
            norm_kernel=kernels.rms_norm,
            norm_weight_offset=spec.norm_weight_offset,
            qk_norm_whole=WholeProjectionNorms(_head_rows(shard.heads, d), kv_rows, tp) if spec.qk_norm_whole else None,
            scale=spec.attention_scale,
            window=spec.window(layer_idx),
            sinks=HeadSinks(shard.heads) if spec.attention_sinks else None,
            output_gate=spec.attn_output_gate,
            qk_norm_after_rotary=spec.qk_norm_after_rotary,
            temperature=spec.temperature(layer_idx),
            chunk=spec.chunk(layer_idx),
            qk_norm_weightless=spec.qk_norm_weightless,
            **variant,
        )
        self.o_proj = row_parallel_linear(_head_rows(shard.heads, d), spec.hidden_size, spec.o_bias, tp, kernels.linear)


class DecoderLayer(nn.Module):
    """One token-mixing block (attention or Gated DeltaNet) and one MLP block with the family's norms
    (``spec.norms``) around them.

    ``forward(positions, x, residual, ctx)`` is ``attn_in``, ``mixer``, then ``attn_out``; the model
    calls the steps one by one where the prefill CUDA graphs cut at the mixing."""

    def __init__(
        self,
        spec: DecoderSpec,
        layer_idx: int,
        rotary: RotaryEmbedding | None,
        kernels: LayerKernels,
        shard: DecoderShard,
        tp: TensorParallel,
    ) -> None:
        super().__init__()
        self.kind = spec.mixer(layer_idx)
        if self.kind == "gated_deltanet":
            gdn = GatedDeltaNet(
                spec.gated_deltanet, layer_idx, shard.linear_k_heads, tp, kernels.linear, kernels.delta_rule,
                kernels.delta_decode,
            )  # fmt: skip
            self.linear_attn = gdn
            pieces = (gdn.in_proj, gdn.mix, gdn.out_proj, gdn)
        elif self.kind == "short_conv":
            conv = ShortConv(spec.short_conv, layer_idx, shard.conv_channels, tp, kernels.linear, kernels.conv_decode)
            self.conv = conv
            pieces = (conv.in_proj, conv.mix, conv.out_proj, conv)
        elif self.kind == "latent_attention":
            mla = LatentAttention(
                spec.latent_attention, spec.hidden_size, spec.num_heads, shard.heads, spec.rms_norm_eps, layer_idx,
                rotary, kernels.latent, kernels.rms_norm, kernels.linear, tp,
            )  # fmt: skip
            self.self_attn = mla
            pieces = (mla.qkv_proj, mla, mla.o_proj, mla)
        else:
            attn = SelfAttention(spec, layer_idx, rotary, kernels, shard, tp)
            self.self_attn = attn
            pieces = (attn.qkv_proj, attn.attn, attn.o_proj, attn.attn)
        # the mixer's pieces by their place (not a second registration of its modules)
        for place, piece in zip(("mixer_in", "mixer", "mixer_out", "_cache_owner"), pieces, strict=True):
            object.__setattr__(self, place, piece)
        self.mlp = layer_mlp(spec, layer_idx, kernels, shard, tp)
        beside = experts_beside_mlp(spec, layer_idx, kernels, shard, tp)  # Gemma 4's MoE block, None elsewhere
        for name, module in beside.named_children() if beside is not None else ():
            self.add_module(name, module)  # under the checkpoint's names, on the layer
        object.__setattr__(self, "_beside", beside)  # (not a second registration of its modules)
        # Each norm under its checkpoint name, and by its place.
        places = ("attn_in", "attn_out", "mlp_in", "mlp_out")
        for place in places:
            name = getattr(spec.norms, place)
            norm = None
            if name is not None:
                norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, kernels.rms_norm, spec.norm_weight_offset)
                self.add_module(name, norm)
            object.__setattr__(self, f"_{place}", norm)  # not a second registration of the module
        self.residual_multiplier = spec.residual_multiplier
        self.per_layer = self.layer_scalar = None  # Gemma 4: its per-layer input, its output's scalar
        if spec.per_layer_input is not None:
            act = functools.partial(F.gelu, approximate="tanh") if spec.activation == "gelu_tanh" else F.silu
            self.per_layer = PerLayerInput(spec.hidden_size, spec.per_layer_input[1], spec.rms_norm_eps, act,
                                           kernels.rms_norm, kernels.linear)  # fmt: skip
        if spec.layer_scalar:
            self.layer_scalar = nn.Parameter(torch.ones(1))
        # Llama's plan (the norms before each block only, a dense MLP): o_proj may end in mlp_in's norm and
        # down_proj in the next layer's attn_in (Linear.into_norm), a batch-1 step's FP8 GEMVs do
        self._plain = (
            self.residual_multiplier is None
            and self._attn_out is None
            and self._mlp_out is None
            and self._mlp_in is not None
            and isinstance(self.mlp, MLP)
        )
        self._next: tuple[RMSNorm, MergedColumnLinear] | None = None

    def feeds(self, layer: DecoderLayer) -> None:
        """``layer`` comes next: this one's down_proj may end in its attn_in norm (``Linear.into_norm``)."""
        self._next = (layer._attn_in, layer.mixer_in) if layer._attn_in is not None else None

    def cache_spec(self) -> CacheSpec:
        """What the layer keeps between steps (this rank's): its mixer's ``PagedKV``, ``PagedLatent`` or
        ``RecurrentState``."""
        return self._cache_owner.cache_spec()

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext,
        per_layer_input: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        projected, residual = self.attn_in(x, residual)
        x, residual = self.attn_out(self.mixer(positions, projected, ctx), residual)
        if self.per_layer is None and self.layer_scalar is None:
            return x, residual
        out = x + residual  # Gemma 4: the output itself, its per-layer input added, times its scalar
        if self.per_layer is not None:
            out = self.per_layer(out, per_layer_input)
        return (out if self.layer_scalar is None else out * self.layer_scalar), None

    def attn_in(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer input ``x + residual`` (``x`` alone for the first layer) -> (its mixer's input projection, itself).
        ``x`` may be a ``PendingNorm`` (the layer before's down_proj did the add and this norm, ``attn_out``)."""
        norm = self._attn_in
        if not isinstance(x, torch.Tensor):
            h = x
        elif norm is None:  # OLMo 2: no norm before attention
            h = x if residual is None else x + residual
            residual = h
        elif residual is None:
            h, residual = norm(x), x
        else:
            h, residual = norm(x, residual)
        return self.mixer_in(h), residual

    def attn_out(self, attn: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor | PendingNorm, torch.Tensor]:
        """The mixer's output before its output projection ([T, heads x head_dim] of attention) -> the layer output
        as (x, residual) (their sum); or, where down_proj ended in the next layer's attn_in norm, (a
        ``PendingNorm``, the sum)."""
        if self._plain:
            x, residual = self.mixer_out.into_norm(attn, residual, self._mlp_in, self.mlp.gate_up_proj)
            if isinstance(x, torch.Tensor):
                x, residual = self._mlp_in(x, residual)
            x = self.mlp.gate_up_proj.activated(x, self.mlp.act)
            if self._next is None:
                return self.mlp.down_proj(x), residual
            return self.mlp.down_proj.into_norm(x, residual, *self._next)
        h = self.mixer_out(attn)
        if self.residual_multiplier is not None:
            h = h * self.residual_multiplier
        if self._attn_out is not None:
            h = self._attn_out(h)
        if self._mlp_in is not None:
            x, residual = self._mlp_in(h, residual)
        else:  # OLMo 2: the MLP reads the sum itself
            x = residual = h + residual
        x = self.mlp(x)
        if self._beside is not None:  # the routed experts on the MLP block's input, beside the dense MLP
            x = self._beside(x, residual)
        if self.residual_multiplier is not None:
            x = x * self.residual_multiplier
        if self._mlp_out is not None:
            x = self._mlp_out(x)
        return x, residual
