"""The decoder shared by every supported architecture (Qwen3, Qwen2, Llama, Mistral, and the mixture-of-experts
Qwen3-MoE, Qwen2-MoE and Mixtral).

What one family does differently (QK-norm, biases, rope scaling, which layers are MoE, ...) is a field of
``DecoderSpec``, read from its config.json by the declarations of models/architectures.py. Each layer's
MLP is the dense ``MLP`` or, in the layers ``spec.moe`` names, the ``SparseMoE`` block (layers/moe.py).
Which kernels the layers run comes with ``LayerKernels`` at construction. Parameter names follow the
Hugging Face checkpoints; where a module sits elsewhere here (the fused ``qkv_proj`` and ``gate_up_proj``,
the QK-norms inside the attention layer, the stacked experts) ``checkpoint_modules`` and the
``checkpoint_*`` maps below say where its tensors go.

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
from nanostream.layers.attention import Attention, ForwardContext
from nanostream.layers.layer_kernels import LayerKernels
from nanostream.layers.linear import MergedColumnLinear, row_parallel_linear
from nanostream.layers.moe import MoESpec, SparseMoE
from nanostream.layers.norm import RMSNorm
from nanostream.layers.rotary import Llama3RopeScaling, RotaryEmbedding
from nanostream.layers.vocab_parallel import lm_head, vocab_embedding


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
    rope_theta: float
    max_position: int
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    mlp_bias: bool = False
    rope_scaling: Llama3RopeScaling | None = None
    moe: MoESpec | None = None  # the mixture-of-experts layers; None: every MLP is dense


def _head_rows(heads: range, head_dim: int) -> range:
    return range(heads.start * head_dim, heads.stop * head_dim)


class SelfAttention(nn.Module):
    """Fused q/k/v projection -> the attention layer -> output projection (this rank's heads); the decoder
    model calls the three in turn (``DecoderModel.forward``)."""

    def __init__(
        self,
        spec: DecoderSpec,
        layer_idx: int,
        rotary: RotaryEmbedding,
        kernels: LayerKernels,
        shard: DecoderShard,
        tp: TensorParallel,
    ) -> None:
        super().__init__()
        d = spec.head_dim
        q_rows, kv_rows = _head_rows(shard.heads, d), _head_rows(shard.kv_heads, d)
        q_total, kv_total = spec.num_heads * d, spec.num_kv_heads * d
        parts = {"q": (q_rows, q_total), "k": (kv_rows, kv_total), "v": (kv_rows, kv_total)}
        self.qkv_proj = MergedColumnLinear(spec.hidden_size, parts, spec.qkv_bias)
        self.attn = Attention(
            layer_idx,
            shard.num_heads,
            shard.num_kv_heads,
            spec.head_dim,
            rotary,
            kernels.attention,
            qk_norm_eps=spec.rms_norm_eps if spec.qk_norm else None,
            norm_kernel=kernels.rms_norm,
        )
        self.o_proj = row_parallel_linear(q_rows, spec.hidden_size, spec.o_bias, tp)


class MLP(nn.Module):
    def __init__(self, spec: DecoderSpec, kernels: LayerKernels, shard: DecoderShard, tp: TensorParallel) -> None:
        super().__init__()
        rows, total = shard.intermediate, spec.intermediate_size
        parts = {"gate": (rows, total), "up": (rows, total)}
        self.gate_up_proj = MergedColumnLinear(spec.hidden_size, parts, bias=spec.mlp_bias)
        self.act = SiluAndMul(kernels.silu_and_mul)
        self.down_proj = row_parallel_linear(rows, spec.hidden_size, spec.mlp_bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        spec: DecoderSpec,
        layer_idx: int,
        rotary: RotaryEmbedding,
        kernels: LayerKernels,
        shard: DecoderShard,
        tp: TensorParallel,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, kernels.rms_norm)
        self.self_attn = SelfAttention(spec, layer_idx, rotary, kernels, shard, tp)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, kernels.rms_norm)
        self.mlp = _mlp(spec, layer_idx, kernels, shard, tp)


def _mlp(
    spec: DecoderSpec, layer_idx: int, kernels: LayerKernels, shard: DecoderShard, tp: TensorParallel
) -> nn.Module:
    """Layer ``layer_idx``'s MLP: the MoE block in the layers ``spec.moe`` names, else the dense one."""
    if spec.moe is None or layer_idx not in spec.moe.layers:
        return MLP(spec, kernels, shard, tp)
    act = SiluAndMul(kernels.silu_and_mul)
    return SparseMoE(
        spec.hidden_size, spec.moe, shard.expert_intermediate, shard.shared_intermediate, kernels.moe, act, tp
    )


class DecoderModel(nn.Module):
    def __init__(self, spec: DecoderSpec, kernels: LayerKernels, shard: DecoderShard, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(shard.vocab, spec.hidden_size, tp)
        # One table for every layer (the attention layers hold it, as does this module).
        self.rotary = RotaryEmbedding(
            spec.head_dim, spec.max_position, spec.rope_theta, spec.rope_scaling, kernel=kernels.rotary
        )
        self.layers = nn.ModuleList(
            DecoderLayer(spec, i, self.rotary, kernels, shard, tp) for i in range(spec.num_layers)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, kernels.rms_norm)

    # The forward in pieces, cut at the attention calls: ``head``, then per layer ``attend`` and ``between``.
    # The pieces do not read the step's attention metadata, so the prefill CUDA graphs capture them alone
    # (engine/prefill_graphs.py) and run the attention between them.

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x, residual = self.head(input_ids)
        for i in range(len(self.layers)):
            x, residual = self.between(i, self.attend(i, positions, x, ctx), residual)
        return x

    def head(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The embedding and the first layer's input norm: (its qkv projection [T, qkv], the residual)."""
        x = self.embed_tokens(input_ids)
        first = self.layers[0]
        return first.self_attn.qkv_proj(first.input_layernorm(x)), x

    def attend(self, i: int, positions: torch.Tensor, qkv: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Layer ``i``'s attention: its qkv projection -> the attention output [T, heads x head_dim]."""
        return self.layers[i].self_attn.attn(positions, qkv, ctx)

    def between(
        self, i: int, attn_out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer ``i`` after its attention (output projection, norm, MLP), then the next layer's input norm
        and qkv projection: (that projection, the residual); after the last layer (the hidden states
        [T, hidden], None)."""
        layer = self.layers[i]
        x, residual = layer.post_attention_layernorm(layer.self_attn.o_proj(attn_out), residual)
        x = layer.mlp(x)
        if i + 1 == len(self.layers):
            return self.norm(x, residual)[0], None
        after = self.layers[i + 1]
        x, residual = after.input_layernorm(x, residual)
        return after.self_attn.qkv_proj(x), residual


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
    }
    checkpoint_aliases = {"block_sparse_moe": "mlp"}  # Mixtral's published name of its MoE block
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
    checkpoint_stacked_experts = {"gate_up_proj": ("w13", "gate_up"), "down_proj": ("w2", "down")}

    def __init__(self, spec: DecoderSpec, kernels: LayerKernels, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.spec = spec
        self.shard = shard_decoder(spec, tp.rank, tp.size)
        self.model = DecoderModel(spec, kernels, self.shard, tp)
        self.lm_head = lm_head(self.shard.vocab, spec.hidden_size, tp)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [B, V] in the model's dtype (the sampler upcasts where it must); with tensor parallelism on
        rank 0 only, None on the other ranks."""
        return self.lm_head(hidden)
