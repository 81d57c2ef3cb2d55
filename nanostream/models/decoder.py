"""The decoder shared by every supported architecture: the Llama-style stack of token-mixing and MLP layers,
with what a family does differently (models/architectures.py) as fields of ``DecoderSpec`` (models/spec.py).

Its layers are ``DecoderLayer``s (models/decoder_layer.py): attention (or, in a hybrid family's
``linear_attention`` layers, Gated DeltaNet) and an MLP (dense, or the MoE block in the layers ``spec.moe``
names) with the family's norms around them; each declares what it keeps between steps (``cache_specs``).
Between layers the hidden state travels as ``(x, residual)``, the layer input being their sum (the add fuses into
the next norm); each attention layer attends over its window (``spec.layer_windows``) with its rotary table, held
here, one per rotary kind. Which kernels the layers run comes with ``LayerKernels`` at construction. Parameter
names follow the Hugging Face checkpoints; where a module sits elsewhere here (the fused ``qkv_proj``,
``gate_up_proj`` and a Gated DeltaNet's ``in_proj``, the QK-norms and sinks inside the attention layer, the
stacked experts) ``checkpoint_modules`` and the ``checkpoint_*`` maps below say where its tensors go.

With tensor parallelism (``tp``, distributed/group.py) every module is built for this rank's shard
(models/sharding.py): q/k/v and gate/up column-parallel (whole heads per rank), o_proj and down_proj
row-parallel (one all-reduce each), the embedding and LM head split by vocabulary. At one rank the layers
are the plain ones: no collective, no extra copy.
"""

from __future__ import annotations

import torch
from torch import nn

from nanostream.distributed.group import SINGLE, TensorParallel
from nanostream.layers.attention import ForwardContext
from nanostream.layers.cache_spec import CacheSpec
from nanostream.layers.fp8_linear import FP8
from nanostream.layers.layer_kernels import LayerKernels
from nanostream.layers.norm import RMSNorm
from nanostream.layers.per_layer_inputs import PerLayerEmbedding
from nanostream.layers.rotary import RotaryEmbedding, permute_heads
from nanostream.layers.vocab_parallel import lm_head, vocab_embedding
from nanostream.models.decoder_layer import DecoderLayer
from nanostream.models.placeholder_embeds import PlaceholderEmbeds
from nanostream.models.sharding import DecoderShard, shard_decoder
from nanostream.models.spec import DecoderSpec


class DecoderModel(nn.Module):
    def __init__(self, spec: DecoderSpec, kernels: LayerKernels, shard: DecoderShard, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(shard.vocab, spec.hidden_size, tp)
        self.embedding_multiplier = spec.embedding_multiplier
        # Gemma: sqrt(hidden_size) in the model's dtype, as it rounds it; None elsewhere
        scale = torch.tensor(spec.hidden_size**0.5) if spec.scale_embeddings else None
        self.register_buffer("embed_scale", scale, persistent=False)
        # One table per rotary kind (the attention layers hold theirs, as does this module); the full layers' head
        # may be of its own size (Gemma 4), the sliding layers' is head_dim.
        full_dim = next((spec.kv_shape(i)[1] for i in range(spec.num_layers) if spec.window(i) is None), spec.head_dim)
        self.rotary = RotaryEmbedding(full_dim, spec.max_position, spec.rope, kernel=kernels.rotary)
        self.sliding_rotary = None
        if spec.sliding_rope is not None:
            self.sliding_rotary = RotaryEmbedding(
                spec.head_dim, spec.max_position, spec.sliding_rope, kernel=kernels.rotary
            )
        self.layers = nn.ModuleList(
            DecoderLayer(spec, i, self._layer_rotary(spec, i), kernels, shard, tp) for i in range(spec.num_layers)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, kernels.rms_norm, spec.norm_weight_offset)
        for layer, after in zip(self.layers, self.layers[1:]):
            layer.feeds(after)
        self.per_layer_embedding = None
        if spec.per_layer_input is not None:  # Gemma 4's per-layer inputs (one rank: models/sharding.py)
            vocab, size, self.pad_token_id = spec.per_layer_input
            self.per_layer_embedding = PerLayerEmbedding(
                vocab, size, spec.num_layers, spec.hidden_size, spec.rms_norm_eps, kernels.rms_norm, kernels.linear
            )
        # the forward cuts into head / attend / between (the prefill CUDA graphs) where a layer's output is (x,
        # residual) alone; not where it needs the per-layer inputs or scales its sum
        self.piecewise = spec.per_layer_input is None and not spec.layer_scalar

    def _layer_rotary(self, spec: DecoderSpec, i: int) -> RotaryEmbedding | None:
        if spec.rope_layers and not spec.rope_layers[i]:
            return None
        if self.sliding_rotary is not None and spec.window(i) is not None:
            return self.sliding_rotary
        return self.rotary

    # The forward in pieces, cut at the attention calls: ``head``, then per layer ``attend`` and ``between``.
    # The pieces do not read the step's attention metadata, so the prefill CUDA graphs capture them alone
    # (engine/runner/prefill_graphs.py) and run the attention between them.

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
        embeds: PlaceholderEmbeds | None = None,
    ) -> torch.Tensor:  # fmt: skip
        # input_ids: [T]; positions: [T], or [3, T] where the rotary takes M-RoPE's; embeds: rows over some tokens'
        x, residual = self.embed(input_ids), None
        if embeds is not None:
            x = embeds.write_over(x)
        if self.per_layer_embedding is None:
            for i, layer in enumerate(self.layers):
                x, residual = layer(positions, x, residual, ctx)
                if embeds is not None and i < len(embeds.deepstack):  # Qwen3-VL's DeepStack: images' features
                    x, residual = embeds.add_level(i, x, residual), None
        else:  # Gemma 4's per-layer inputs, [T, L, P]: an image token's id there is the pad's
            ids = input_ids if embeds is None else input_ids.index_fill(0, embeds.index, self.pad_token_id)
            inputs = self.per_layer_embedding(ids, x)
            for i, layer in enumerate(self.layers):
                x, residual = layer(positions, x, residual, ctx, inputs[:, i])
        return self.norm(x) if residual is None else self.norm(x, residual)[0]

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
        """Layer ``i``'s mixing: its input projection -> its output before o_proj (attention's [T, heads x head_dim]);
        the only piece that reads the step's metadata and the layer's cache."""
        return self.layers[i].mixer(positions, qkv, ctx)

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
        # Gemma 4's per-layer inputs: the model's, each layer's
        **{
            name: (f"per_layer_embedding.{name}", None)
            for name in ("embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm")
        },
        **{
            name: (f"per_layer.{name}", None)
            for name in ("per_layer_input_gate", "per_layer_projection", "post_per_layer_input_norm")
        },
        "q_norm": ("attn.q_norm", None),
        "k_norm": ("attn.k_norm", None),
        "query_layernorm": ("attn.q_norm", None),  # HunYuan's names of its QK-norms, LFM2's
        "key_layernorm": ("attn.k_norm", None),
        "q_layernorm": ("attn.q_norm", None),
        "k_layernorm": ("attn.k_norm", None),
        "sinks": ("attn.sinks.weight", None),
        # a latent attention layer's down-projections of x, both in its qkv_proj (layers/latent_attention.py)
        "q_a_proj": ("qkv_proj", "q_a"),
        "kv_a_proj_with_mqa": ("qkv_proj", "kv_a"),
        "k_scale": ("attn.kv_scales.k_scale", None),  # an FP8 KV cache's scales (llm-compressor's, vLLM's names)
        "v_scale": ("attn.kv_scales.v_scale", None),
        # a Gated DeltaNet layer's input projections, all in its in_proj (layers/gated_deltanet.py)
        "in_proj_qkv": ("in_proj", "qkv"),
        "in_proj_z": ("in_proj", "z"),
        "in_proj_b": ("in_proj", "b"),
        "in_proj_a": ("in_proj", "a"),
        "in_proj_qkvz": ("in_proj", "qkvz"),
        "in_proj_ba": ("in_proj", "ba"),
    }
    # Mixtral's published name of its MoE block, gpt-oss's of its router, DeepSeek's of its shared experts, Llama 4's
    # of its MLP
    checkpoint_aliases = {
        "block_sparse_moe": "mlp", "router": "gate", "shared_experts": "shared_expert", "feed_forward": "mlp"
    }  # fmt: skip
    # A tensor's name ending, renamed: MiniMax-M2 keeps its router's correction bias on the MoE block, ERNIE 4.5 in
    # the MoE block's moe_statics
    checkpoint_suffixes = {
        **{f"{block}.e_score_correction_bias": f"{block}.gate.e_score_correction_bias"
           for block in ("block_sparse_moe", "mlp")},
        "mlp.moe_statics.e_score_correction_bias": "mlp.gate.e_score_correction_bias",
        # LFM2's names: its attention's output projection, its MLP's w1/w3/w2, its final norm
        "self_attn.out_proj.weight": "self_attn.o_proj.weight",
        **{f"feed_forward.{w}.weight": f"feed_forward.{n}.weight"
           for w, n in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))},
        "embedding_norm.weight": "norm.weight",
        "router.proj.weight": "router.weight",  # Gemma 4's router (on the layer: layers/moe_beside_mlp.py)
    }  # fmt: skip
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

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
        embeds: PlaceholderEmbeds | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Hidden states [T, hidden] of the step's T tokens. ``positions``: [T], or M-RoPE's [3, T] for a model whose
        rope declares it (Qwen3.5); ``embeds``: rows that replace some tokens' embeddings (an image's, at its
        placeholders: models/placeholder_embeds.py)."""
        return self.model(input_ids, positions, ctx, embeds)

    def cache_specs(self) -> list[CacheSpec]:
        """What each layer keeps between steps, in layer order, for this rank's shard (layers/cache_spec.py):
        ``PagedKV`` for an attention layer, ``RecurrentState`` for a Gated DeltaNet layer. ``ctx.kv_caches[i]``
        is then layer i's ``KVCache`` or ``StateCache``."""
        return [layer.cache_spec() for layer in self.model.layers]

    @torch.no_grad()
    def after_loading(self) -> None:
        """Put each head's q and k dims in the rotary tables' order (``RopeSpec.head_order``: partial and
        interleaved rotary, GLM-4, Phi-3, Qwen3-Next), once, after the weights are in: the q and k rows of
        ``qkv_proj`` (with an output gate, each head's query rows; its gate rows stay), their biases, FP8 scales
        per row, and QK-norm weights, per head or each head's of a whole-projection norm (an FP8 block holds whole
        heads; the norm's mean of squares is over the same values). q·k, so attention, is unchanged.
        Nothing to do for most families."""
        d = self.spec.head_dim
        order = self.spec.rope.head_order(d)
        if order is None:
            return
        if self.spec.sliding_rope is not None and not torch.equal(order, self.spec.sliding_rope.head_order(d)):
            raise ValueError("the sliding layers' rotary dims are ordered otherwise than the full layers'")
        order = order.to(self.model.embed_tokens.weight.device)
        q_order, q_d = order, d
        if self.spec.attn_output_gate:  # a head's q rows: [query D | gate D]
            q_order, q_d = torch.cat((order, torch.arange(d, 2 * d, device=order.device))), 2 * d
        for layer in self.model.layers:
            if layer.kind != "attention":
                continue
            proj, attn = layer.self_attn.qkv_proj, layer.self_attn.attn
            q, k = (range(o, o + len(proj.parts[p][0])) for p, o in proj.shard_offsets.items() if p in "qk")
            per_row_scale = proj.fp8_block is not None and proj.fp8_block[0] == 1  # else whole heads per block
            for param in (proj.weight, proj.bias, proj.weight_scale if per_row_scale else None):
                if param is not None:
                    data = param.view(torch.uint8) if param.dtype == FP8 else param  # FP8: its bytes moved
                    for rows, o, size in ((q, q_order, q_d), (k, order, d)):
                        data[rows.start : rows.stop] = permute_heads(data[rows.start : rows.stop], o, size)
            if attn.qk_norm_whole:  # a weight per dim of the whole projection: each head's D in order
                for norm in (attn.q_norm, attn.k_norm):
                    norm.weight.copy_(permute_heads(norm.weight, order, d))
            elif attn.qk_norm:
                for norm in (attn.q_norm, attn.k_norm):
                    norm.weight.copy_(norm.weight[order])

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
