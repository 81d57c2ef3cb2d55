"""The decoder shared by every supported architecture: the Llama-style stack of attention and MLP layers,
with what a family does differently (models/architectures.py) as fields of ``DecoderSpec``.

A ``DecoderLayer`` owns its forward in two steps around its attention call, ``attn_in`` (the norms before
attention, the qkv projection) and ``attn_out`` (the output projection, the norms and residual adds around
the MLP), so that where a family puts its norms (before each block as Llama, also after it as Gemma 3 and
GLM-4, only after it as OLMo 2: ``LayerNorms``) is the layer's business. Between layers the hidden state
travels as ``(x, residual)``, the layer input being their sum (the add fuses into the next norm).

Each layer's MLP is the dense ``MLP`` or, in the layers ``spec.moe`` names, the ``SparseMoE`` block
(layers/moe.py); each attention layer attends over its window (``spec.layer_windows``) with its rotary
table. Which kernels the layers run comes with ``LayerKernels`` at construction. Parameter names follow
the Hugging Face checkpoints; where a module sits elsewhere here (the fused ``qkv_proj`` and
``gate_up_proj``, the QK-norms and sinks inside the attention layer, the stacked experts)
``checkpoint_modules`` and the ``checkpoint_*`` maps below say where its tensors go.

With tensor parallelism (``tp``, distributed/group.py) every module is built for this rank's shard
(distributed/sharding.py): q/k/v and gate/up column-parallel (whole heads per rank), o_proj and down_proj
row-parallel (one all-reduce each), the embedding and LM head split by vocabulary. At one rank the layers
are the plain ones: no collective, no extra copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nanostream.distributed.group import SINGLE, TensorParallel
from nanostream.distributed.sharding import DecoderShard, shard_decoder
from nanostream.layers.activation import SiluAndMul
from nanostream.layers.attention import Attention, ForwardContext, HeadSinks
from nanostream.layers.fp8_linear import FP8
from nanostream.layers.layer_kernels import LayerKernels
from nanostream.layers.linear import MergedColumnLinear, row_parallel_linear
from nanostream.layers.moe import MoESpec, SparseMoE
from nanostream.layers.norm import RMSNorm
from nanostream.layers.rotary import RopeSpec, RotaryEmbedding, permute_heads
from nanostream.layers.vocab_parallel import lm_head, vocab_embedding
from nanostream.models.quantization import Fp8Spec


@dataclass(frozen=True)
class LayerNorms:
    """A layer's norms by where they sit, each its checkpoint name; None: the family has none there.

    ``attn_in`` before attention, ``attn_out`` on the attention's output before the residual add,
    ``mlp_in`` before the MLP, ``mlp_out`` on the MLP's output (Llama: the first and third)."""

    attn_in: str | None = "input_layernorm"
    attn_out: str | None = None
    mlp_in: str | None = "post_attention_layernorm"
    mlp_out: str | None = None


@dataclass(frozen=True)
class DecoderSpec:
    """The shape of a decoder, read from a Hugging Face config (models/architectures.py)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec  # the (full-attention) layers' rotary embedding
    max_position: int
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    mlp_bias: bool = False
    moe: MoESpec | None = None  # the mixture-of-experts layers; None: every MLP is dense
    norms: LayerNorms = LayerNorms()
    norm_weight_offset: float | None = None
    """How every norm rounds (layers/norm.py): None as Llama; 0.0 (OLMo 2, gpt-oss) or 1.0 (Gemma)."""
    qk_norm_whole: bool = False  # OLMo 2: the QK-norms span the whole q and k projections, not each head
    activation: str = "silu"  # the MLP's gated activation (layers/activation.py)
    embedding_multiplier: float | None = None  # Granite: the embeddings times this
    scale_embeddings: bool = False  # Gemma: the embeddings times sqrt(hidden_size), rounded to the dtype
    residual_multiplier: float | None = None  # Granite: each block's output times this before its add
    attention_scale: float | None = None  # the softmax scale; None: head_dim ** -0.5
    logits_divisor: float | None = None  # Granite's logits_scaling: the logits divided by it
    final_logit_softcap: float | None = None  # Gemma: cap * tanh(logits / cap)
    attention_sinks: bool = False  # gpt-oss: a learned logit per head in each softmax (``sinks``)
    layer_windows: tuple[int | None, ...] = ()
    """Each layer's sliding window (None: full attention); empty: every layer full."""
    sliding_rope: RopeSpec | None = None  # Gemma 3: the sliding layers' own rotary embedding
    rope_layers: tuple[bool, ...] = ()  # SmolLM3: which layers rotate; empty: all
    quantization: Fp8Spec | None = None
    """How the checkpoint's FP8 weights are stored (config.json's quantization_config); None: unquantized."""
    checkpoint_prefix: str = ""
    """Where a multimodal checkpoint keeps this decoder's tensors (``language_model.``); the rest is not loaded."""

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None


def _head_rows(heads: range, head_dim: int) -> range:
    return range(heads.start * head_dim, heads.stop * head_dim)


class SelfAttention(nn.Module):
    """Fused q/k/v projection -> the attention layer -> output projection (this rank's heads)."""

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
        d = spec.head_dim
        q_rows, kv_rows = _head_rows(shard.heads, d), _head_rows(shard.kv_heads, d)
        q_total, kv_total = spec.num_heads * d, spec.num_kv_heads * d
        parts = {"q": (q_rows, q_total), "k": (kv_rows, kv_total), "v": (kv_rows, kv_total)}
        self.qkv_proj = MergedColumnLinear(spec.hidden_size, parts, spec.qkv_bias, kernels.linear)
        self.attn = Attention(
            layer_idx,
            shard.num_heads,
            shard.num_kv_heads,
            spec.head_dim,
            rotary,
            kernels.attention,
            qk_norm_eps=spec.rms_norm_eps if spec.qk_norm else None,
            norm_kernel=kernels.rms_norm,
            norm_weight_offset=spec.norm_weight_offset,
            qk_norm_whole=spec.qk_norm_whole,
            scale=spec.attention_scale,
            window=spec.window(layer_idx),
            sinks=HeadSinks(shard.heads) if spec.attention_sinks else None,
        )
        self.o_proj = row_parallel_linear(q_rows, spec.hidden_size, spec.o_bias, tp, kernels.linear)


class MLP(nn.Module):
    def __init__(self, spec: DecoderSpec, kernels: LayerKernels, shard: DecoderShard, tp: TensorParallel) -> None:
        super().__init__()
        rows, total = shard.intermediate, spec.intermediate_size
        parts = {"gate": (rows, total), "up": (rows, total)}
        self.gate_up_proj = MergedColumnLinear(spec.hidden_size, parts, spec.mlp_bias, kernels.linear)
        self.act = SiluAndMul(kernels.gated(spec.activation))
        self.down_proj = row_parallel_linear(rows, spec.hidden_size, spec.mlp_bias, tp, kernels.linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """One attention block and one MLP block with the family's norms (``spec.norms``) around them.

    ``forward(positions, x, residual, ctx)`` is ``attn_in``, the attention, then ``attn_out``; the model
    calls the steps one by one where the prefill CUDA graphs cut at the attention."""

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
        self.self_attn = SelfAttention(spec, layer_idx, rotary, kernels, shard, tp)
        self.mlp = _mlp(spec, layer_idx, kernels, shard, tp)
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

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, residual = self.attn_in(x, residual)
        return self.attn_out(self.self_attn.attn(positions, qkv, ctx), residual)

    def attn_in(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer input ``x + residual`` (``x`` alone for the first layer) -> (its qkv projection, itself)."""
        norm = self._attn_in
        if norm is None:  # OLMo 2: no norm before attention
            h = x if residual is None else x + residual
            residual = h
        elif residual is None:
            h, residual = norm(x), x
        else:
            h, residual = norm(x, residual)
        return self.self_attn.qkv_proj(h), residual

    def attn_out(self, attn: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention output [T, heads x head_dim] -> the layer output as (x, residual) (their sum)."""
        h = self.self_attn.o_proj(attn)
        if self.residual_multiplier is not None:
            h = h * self.residual_multiplier
        if self._attn_out is not None:
            h = self._attn_out(h)
        if self._mlp_in is not None:
            x, residual = self._mlp_in(h, residual)
        else:  # OLMo 2: the MLP reads the sum itself
            x = residual = h + residual
        x = self.mlp(x)
        if self.residual_multiplier is not None:
            x = x * self.residual_multiplier
        if self._mlp_out is not None:
            x = self._mlp_out(x)
        return x, residual


def _mlp(
    spec: DecoderSpec, layer_idx: int, kernels: LayerKernels, shard: DecoderShard, tp: TensorParallel
) -> nn.Module:
    """Layer ``layer_idx``'s MLP: the MoE block in the layers ``spec.moe`` names, else the dense one."""
    if spec.moe is None or layer_idx not in spec.moe.layers:
        return MLP(spec, kernels, shard, tp)
    act = SiluAndMul(kernels.silu_and_mul)
    return SparseMoE(
        spec.hidden_size,
        spec.moe,
        shard.expert_intermediate,
        shard.shared_intermediate,
        kernels.moe,
        act,
        tp,
        kernels.linear,
    )


class DecoderModel(nn.Module):
    def __init__(self, spec: DecoderSpec, kernels: LayerKernels, shard: DecoderShard, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(shard.vocab, spec.hidden_size, tp)
        self.embedding_multiplier = spec.embedding_multiplier
        # Gemma: sqrt(hidden_size) in the model's dtype, as it rounds it; None elsewhere
        scale = torch.tensor(spec.hidden_size**0.5) if spec.scale_embeddings else None
        self.register_buffer("embed_scale", scale, persistent=False)
        # One table per rotary kind (the attention layers hold theirs, as does this module).
        self.rotary = RotaryEmbedding(spec.head_dim, spec.max_position, spec.rope, kernel=kernels.rotary)
        self.sliding_rotary = None
        if spec.sliding_rope is not None:
            self.sliding_rotary = RotaryEmbedding(
                spec.head_dim, spec.max_position, spec.sliding_rope, kernel=kernels.rotary
            )
        self.layers = nn.ModuleList(
            DecoderLayer(spec, i, self._layer_rotary(spec, i), kernels, shard, tp) for i in range(spec.num_layers)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, kernels.rms_norm, spec.norm_weight_offset)

    def _layer_rotary(self, spec: DecoderSpec, i: int) -> RotaryEmbedding | None:
        if spec.rope_layers and not spec.rope_layers[i]:
            return None
        if self.sliding_rotary is not None and spec.window(i) is not None:
            return self.sliding_rotary
        return self.rotary

    # The forward in pieces, cut at the attention calls: ``head``, then per layer ``attend`` and ``between``.
    # The pieces do not read the step's attention metadata, so the prefill CUDA graphs capture them alone
    # (engine/runner/prefill_graphs.py) and run the attention between them.

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x, residual = self.embed(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, ctx)
        return self.norm(x, residual)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        if self.embedding_multiplier is not None:
            x = x * self.embedding_multiplier
        return x

    def head(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The embedding and the first layer's ``attn_in``: (its qkv projection [T, qkv], the residual)."""
        return self.layers[0].attn_in(self.embed(input_ids), None)

    def attend(self, i: int, positions: torch.Tensor, qkv: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Layer ``i``'s attention: its qkv projection -> the attention output [T, heads x head_dim]."""
        return self.layers[i].self_attn.attn(positions, qkv, ctx)

    def between(
        self, i: int, attn_out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer ``i``'s ``attn_out``, then the next layer's ``attn_in``: (its qkv projection, the residual);
        after the last layer (the hidden states [T, hidden], None)."""
        x, residual = self.layers[i].attn_out(attn_out, residual)
        if i + 1 == len(self.layers):
            return self.norm(x, residual)[0], None
        return self.layers[i + 1].attn_in(x, residual)


class DecoderForCausalLM(nn.Module):
    """``forward`` gives hidden states [T, hidden]; ``compute_logits`` turns selected rows into logits.

    model = DecoderForCausalLM(decoder_spec(hf_config, max_model_len=4096), LayerKernels(TorchAttention()))

    ``tp``: this process's rank of a tensor-parallel group (distributed/group.py); it holds only its shard.
    """

    # checkpoint module name -> (module here, shard of it or None)
    checkpoint_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
        "q_norm": ("attn.q_norm", None),
        "k_norm": ("attn.k_norm", None),
        "sinks": ("attn.sinks.weight", None),
        "k_scale": ("attn.kv_scales.k_scale", None),  # an FP8 KV cache's scales (llm-compressor's, vLLM's names)
        "v_scale": ("attn.kv_scales.v_scale", None),
    }
    # Mixtral's published name of its MoE block, gpt-oss's of its router
    checkpoint_aliases = {"block_sparse_moe": "mlp", "router": "gate"}
    # One expert's tensor, ``{block}.experts.{e}.{name}.weight`` -> (parameter of ``Experts``, its part):
    # the published checkpoints' names (Qwen's gate/up/down_proj, Mixtral's w1/w3/w2).
    checkpoint_expert_tensors = {
        "gate_proj": ("w13", "gate"),
        "up_proj": ("w13", "up"),
        "down_proj": ("w2", "down"),
        "w1": ("w13", "gate"),
        "w3": ("w13", "up"),
        "w2": ("w2", "down"),
    }
    # Every expert's, stacked, ``{block}.experts.{name}``: what transformers' save_pretrained writes
    # with save_original_format=False (its default writes the published per-expert names).
    checkpoint_stacked_experts = {
        "gate_up_proj": ("w13", "gate_up"),
        "down_proj": ("w2", "down"),
        "gate_up_proj_bias": ("w13_bias", "gate_up"),  # gpt-oss's expert biases
        "down_proj_bias": ("w2_bias", "down"),
    }

    def __init__(self, spec: DecoderSpec, kernels: LayerKernels, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.spec = spec
        self.shard = shard_decoder(spec, tp.rank, tp.size)
        self.model = DecoderModel(spec, kernels, self.shard, tp)
        self.lm_head = lm_head(self.shard.vocab, spec.hidden_size, tp, kernels.linear)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)

    @torch.no_grad()
    def after_loading(self) -> None:
        """Put each head's q and k dims in the rotary tables' order (``RopeSpec.head_order``: partial and
        interleaved rotary, GLM-4, Phi-3), once, after the weights are in: the q and k rows of ``qkv_proj``, their
        biases, FP8 scales per row, and per-head QK-norm weights (an FP8 block holds whole heads). q·k, so
        attention, is unchanged. Nothing to do for most families."""
        d = self.spec.head_dim
        order = self.spec.rope.head_order(d)
        if order is None:
            return
        if self.spec.sliding_rope is not None and not torch.equal(order, self.spec.sliding_rope.head_order(d)):
            raise ValueError("the sliding layers' rotary dims are ordered otherwise than the full layers'")
        order = order.to(self.model.embed_tokens.weight.device)
        for layer in self.model.layers:
            proj, attn = layer.self_attn.qkv_proj, layer.self_attn.attn
            q, k = (range(o, o + len(proj.parts[p][0])) for p, o in proj.shard_offsets.items() if p in "qk")
            per_row_scale = proj.fp8_block is not None and proj.fp8_block[0] == 1  # else whole heads per block
            for param in (proj.weight, proj.bias, proj.weight_scale if per_row_scale else None):
                if param is not None:
                    data = param.view(torch.uint8) if param.dtype == FP8 else param  # FP8: its bytes moved
                    for rows in (q, k):
                        data[rows.start : rows.stop] = permute_heads(data[rows.start : rows.stop], order, d)
            if attn.qk_norm and not attn.qk_norm_whole:
                for norm in (attn.q_norm, attn.k_norm):
                    norm.weight.copy_(norm.weight[order])
            elif attn.qk_norm_whole:
                raise ValueError("whole-projection QK-norms with a permuted rotary layout are not supported")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [B, V] in the model's dtype (the sampler upcasts where it must); with tensor parallelism on
        rank 0 only, None on the other ranks."""
        logits = self.lm_head(hidden)
        if logits is None:
            return None
        if self.spec.logits_divisor is not None:
            logits = logits / self.spec.logits_divisor
        cap = self.spec.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
