"""The supported architectures, one declaration each (``ARCHITECTURES``), and the multimodal checkpoints whose
language model runs alone (``TEXT_MODELS``).

All of them run the one decoder of models/decoder.py; a declaration says only how its family departs
from it. Sizes, epsilon, rope theta, tied embeddings, sliding windows and which layers have them always
come from the config itself (models/config_reader.py reads them into a ``DecoderSpec``); so do the experts
of a mixture-of-experts family, under the config keys its ``Experts`` declaration names (models/moe_config.py), a
latent-attention family's MLA shape (``LatentAttentionLayers``, models/latent_config.py), and
a hybrid family's Gated DeltaNet layers (``layer_types``' ``linear_attention``, sized by the ``linear_*`` keys:
models/layer_kinds.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from nanostream.models.declarations import GEMMA_NORMS, GLM_NORMS, OLMO2_NORMS, ROPES, Architecture, GatedDeltaNetLayers
from nanostream.models.latent_config import LatentAttentionLayers
from nanostream.models.moe_config import Experts
from nanostream.models.spec import LayerNorms
from nanostream.models.vl_decoders import VL_DECODERS

ARCHITECTURES: dict[str, Architecture] = {
    "Qwen3ForCausalLM": Architecture(
        qk_norm=True, attention_bias_key="attention_bias", sliding_window_switch="use_sliding_window", rope_types=ROPES
    ),
    "Qwen2ForCausalLM": Architecture(qkv_bias=True, sliding_window_switch="use_sliding_window", rope_types=ROPES),
    "LlamaForCausalLM": Architecture(
        attention_bias_key="attention_bias", mlp_bias_key="mlp_bias", rope_types=(*ROPES, "llama3")
    ),
    "MistralForCausalLM": Architecture(rope_types=ROPES),
    "Qwen3MoeForCausalLM": Architecture(
        qk_norm=True, attention_bias_key="attention_bias", sliding_window_switch="use_sliding_window", experts=Experts()
    ),
    "Qwen2MoeForCausalLM": Architecture(
        qkv_bias_key="qkv_bias", sliding_window_switch="use_sliding_window", experts=Experts(shared_expert=True)
    ),
    "Gemma3ForCausalLM": Architecture(
        qk_norm=True,
        attention_bias_key="attention_bias",
        norms=GEMMA_NORMS,
        norm_weight_offset=1.0,
        activation_key="hidden_activation",
        scale_embeddings=True,
        query_pre_attn_scalar=True,
        final_logit_softcap=True,
        rope_types=("default", "linear"),
    ),
    "Phi3ForCausalLM": Architecture(rope_types=("default", "longrope"), partial_rotary=True),
    "Olmo2ForCausalLM": Architecture(
        qk_norm=True, qk_norm_whole=True, attention_bias_key="attention_bias", norms=OLMO2_NORMS, norm_weight_offset=0.0
    ),
    "GraniteForCausalLM": Architecture(
        attention_bias_key="attention_bias", mlp_bias_key="mlp_bias", multipliers=True, rope_types=(*ROPES, "llama3")
    ),
    "SmolLM3ForCausalLM": Architecture(
        attention_bias_key="attention_bias",
        mlp_bias_key="mlp_bias",
        sliding_window_switch="use_sliding_window",
        no_rope_layers=True,
    ),
    "Glm4ForCausalLM": Architecture(
        qkv_bias_key="attention_bias", norms=GLM_NORMS, partial_rotary=True, interleaved_rotary=True
    ),
    "GptOssForCausalLM": Architecture(
        attention_bias_key="attention_bias",
        norm_weight_offset=0.0,
        attention_sinks=True,
        rope_types=("default", "yarn"),
        experts=Experts(
            num_experts_key="num_local_experts",
            intermediate_key="intermediate_size",
            renormalize=False,
            sparse_layers=False,
            gpt_oss=True,
        ),
    ),
    "MixtralForCausalLM": Architecture(
        experts=Experts(
            num_experts_key="num_local_experts",
            intermediate_key="intermediate_size",
            renormalize=True,
            sparse_layers=False,
            float32_weights=True,
        )
    ),
}
# Qwen3-Next and Qwen3.5 / Qwen3.6: three Gated DeltaNet layers to one of gated attention, whose (1 + w) norms
# (the DeltaNet's gated norm has a plain weight) and partial rotary (a quarter of each head) they share. Qwen3.5's
# M-RoPE (``mrope``) gives each frequency a token's temporal, height or width position; a text token's three are
# one, so [T] positions rotate text as the 1-D embedding does, and [3, T] ones place an image's tokens.
_HYBRID = dict(
    qk_norm=True,
    attention_bias_key="attention_bias",
    norm_weight_offset=1.0,
    partial_rotary=True,
    attn_output_gate=True,
    rope_types=ROPES,
)
_QWEN3_5_UNUSED = ("mtp.", "model.visual.")  # its multi-token prediction layer; its vision tower (models/vision/)
ARCHITECTURES |= {
    "Qwen3NextForCausalLM": Architecture(
        **_HYBRID,
        gated_deltanet=GatedDeltaNetLayers(fused_projections=True),
        experts=Experts(shared_expert=True),
        unused_tensors=("mtp.",),
    ),
    "Qwen3_5ForCausalLM": Architecture(
        **_HYBRID, mrope=(11, 11, 10), gated_deltanet=GatedDeltaNetLayers(), unused_tensors=_QWEN3_5_UNUSED
    ),
    "Qwen3_5MoeForCausalLM": Architecture(
        **_HYBRID,
        mrope=(11, 11, 10),
        gated_deltanet=GatedDeltaNetLayers(),
        experts=Experts(shared_expert=True, renormalize=True, sparse_layers=False),  # every layer's, no key for either
        unused_tensors=_QWEN3_5_UNUSED,
    ),
}
ARCHITECTURES |= VL_DECODERS  # vision-language checkpoints' language models (models/vl_decoders.py)
# DeepSeek's router (sigmoid scores, a correction bias that steers the choice alone, renormalised weights) on a
# Llama-style attention: GLM-4.5 with its partial rotary, optional per-head QK-norm, q/k/v biases, shared experts,
# groups and dense first layers; MiniMax-M2 with QK-norms over the whole q and k projections (``qk_norm_type``
# per_layer), partial rotary (``rotary_dim``), every layer MoE. Both append multi-token-prediction layers.
_MINIMAX_M2_FIXED = (  # attn_type_list 1: softmax attention in every layer (0: MiniMax-01's lightning attention)
    ("attn_type_list", 1), ("qk_norm_type", "per_layer"), ("use_qk_norm", True), ("use_routing_bias", True),
    ("shared_intermediate_size", 0), ("sliding_window", None),
)  # fmt: skip
ARCHITECTURES |= {
    "Glm4MoeForCausalLM": Architecture(
        qk_norm_key="use_qk_norm", qkv_bias_key="attention_bias", partial_rotary=True, rope_types=ROPES,
        mtp_layers_key="num_nextn_predict_layers",
        experts=Experts(
            num_experts_key="n_routed_experts", float32_weights=True, sparse_layers=False, router="grouped_topk",
            groups=True, scaling_key="routed_scaling_factor", float32_router=True,
            first_dense_key="first_k_dense_replace", shared_experts_key="n_shared_experts",
        ),
    ),
    "MiniMaxM2ForCausalLM": Architecture(
        qk_norm=True, qk_norm_whole=True, partial_rotary=True, rope_types=ROPES, mtp_layers_key="num_mtp_modules",
        fixed_values=_MINIMAX_M2_FIXED,
        experts=Experts(
            num_experts_key="num_local_experts", intermediate_key="intermediate_size", renormalize=True,
            float32_weights=True, sparse_layers=False, router="grouped_topk",
        ),
    ),
}  # fmt: skip
# The dense families of 2025: OLMo 3 (OLMo 2 with sliding and full layers, a rope per kind), EXAONE 4 (norms after
# each block only, per-head QK-norms, full layers without rotary embedding beside sliding ones), Apertus (an ungated
# xIELU MLP, QK-norms, Llama 3 rope), Seed-OSS (q/k/v biases, o's own key), HunYuan dense (QK-norms after the rotary
# embedding, NTK alpha), ERNIE 4.5 (interleaved rotary, one bias key for every linear; its MoE: DeepSeek's router
# scoring by a softmax, a correction bias, a float32 gate, shared experts, the MoE layers a range of them), and
# Ministral 3 (Mistral with attention temperature over its yarn rope's original context).
_ERNIE = dict(attention_bias_key="use_bias", mlp_bias_key="use_bias", interleaved_rotary=True)
ARCHITECTURES |= {
    "Olmo3ForCausalLM": Architecture(
        qk_norm=True, qk_norm_whole=True, attention_bias_key="attention_bias", norms=OLMO2_NORMS,
        norm_weight_offset=0.0, rope_types=(*ROPES, "llama3"),
    ),
    "Exaone4ForCausalLM": Architecture(
        qk_norm=True, norms=LayerNorms(None, "post_attention_layernorm", None, "post_feedforward_layernorm"),
        nope_full_attention=True, rope_types=(*ROPES, "llama3"),
    ),
    "ApertusForCausalLM": Architecture(
        qk_norm=True, attention_bias_key="attention_bias", gated_mlp=False, rope_types=(*ROPES, "llama3"),
        norms=LayerNorms("attention_layernorm", None, "feedforward_layernorm", None),
    ),
    "SeedOssForCausalLM": Architecture(
        qkv_bias_key="attention_bias", o_bias_key="attention_out_bias", mlp_bias_key="mlp_bias", rope_types=ROPES
    ),
    "HunYuanDenseV1ForCausalLM": Architecture(
        qk_norm=True, qk_norm_after_rotary=True, attention_bias_key="attention_bias", rope_types=("default", "dynamic")
    ),
    "Ernie4_5ForCausalLM": Architecture(**_ERNIE),
    "Ernie4_5_MoeForCausalLM": Architecture(
        **_ERNIE, unused_tensors=("model.mtp_",), fixed_values=(("moe_norm_min", 1e-12),),
        experts=Experts(
            renormalize=True, router="grouped_topk", scoring="softmax", float32_router=True,
            shared_experts_key="moe_num_shared_experts",
            layer_range_keys=("moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval"),
        ),
    ),
    "Ministral3ForCausalLM": Architecture(rope_types=ROPES, query_temperature=True),
}  # fmt: skip
# Llama 4 (Scout, Maverick): chunked local attention in the layers with rotary embedding (interleaved pairs), a NoPE
# layer every fourth with the queries' temperature, weightless QK-norms after the rotary embedding, and on the MoE
# layers the config lists a top-1 router whose sigmoid weight scales the token going in, beside one shared expert.
ARCHITECTURES |= {
    "Llama4ForCausalLM": Architecture(
        attention_bias_key="attention_bias", interleaved_rotary=True, rope_types=("default", "llama3"),
        no_rope_layers=True, chunked_attention=True, query_temperature=True,
        qk_norm_key="use_qk_norm", weightless_qk_norm=True, qk_norm_after_rotary=True,
        dense_intermediate_key="intermediate_size_mlp", fixed_values=(("num_experts_per_tok", 1),),
        experts=Experts(
            num_experts_key="num_local_experts", intermediate_key="intermediate_size", router="sigmoid",
            layers_key="moe_layers", weights_on_input=True, shared_expert_size_key="intermediate_size",
            transposed=True,
        ),
    ),
}  # fmt: skip
# LFM2: gated short convolutions (a conv state per sequence) beside attention with per-head QK-norms; its MLP's size
# adjusted from the config's.
ARCHITECTURES["Lfm2ForCausalLM"] = Architecture(
    qk_norm=True, short_conv=True, norm_eps_key="norm_eps", auto_adjust_ff_dim=True, rope_types=ROPES,
    norms=LayerNorms("operator_norm", None, "ffn_norm", None), fixed_values=(("conv_bias", False),),
)  # fmt: skip
# Multi-head latent attention (DeepSeek's MLA) in every layer, DeepSeek's router: DeepSeek-V3 (R1, V3.1, Kimi K2,
# Moonlight) with its groups, correction bias, dense first layers and multi-token-prediction layers; GLM-4.7-Flash
# picking its dense layers by name; DeepSeek-V2 (V2-Lite: no q LoRA) scoring by softmax, greedy, unnormalised (its
# complex rotation is interleaved pairs); Mistral 4 with softmax scores in groups, no bias, its per-position query
# scale.
_DEEPSEEK_EXPERTS = dict(
    num_experts_key="n_routed_experts", float32_weights=True, sparse_layers=False, router="grouped_topk",
    scaling_key="routed_scaling_factor", first_dense_key="first_k_dense_replace", shared_experts_key="n_shared_experts",
)  # fmt: skip
ARCHITECTURES |= {
    "DeepseekV3ForCausalLM": Architecture(
        latent_attention=LatentAttentionLayers(), rope_types=ROPES, mtp_layers_key="num_nextn_predict_layers",
        experts=Experts(**_DEEPSEEK_EXPERTS, groups=True, float32_router=True),
    ),
    "Glm4MoeLiteForCausalLM": Architecture(
        latent_attention=LatentAttentionLayers(), rope_types=ROPES, mtp_layers_key="num_nextn_predict_layers",
        experts=Experts(**_DEEPSEEK_EXPERTS, groups=True, float32_router=True, layer_types_key="mlp_layer_types"),
    ),
    "DeepseekV2ForCausalLM": Architecture(
        latent_attention=LatentAttentionLayers(interleave_key=None), rope_types=ROPES,
        fixed_values=(("norm_topk_prob", False),),  # transformers' DeepSeek-V2 never renormalises
        experts=Experts(**_DEEPSEEK_EXPERTS, renormalize=False, float32_router=True, scoring="softmax"),
    ),
    "Mistral4ForCausalLM": Architecture(
        latent_attention=LatentAttentionLayers(query_scale=True), rope_types=ROPES,
        experts=Experts(**_DEEPSEEK_EXPERTS, groups=True, scoring="softmax", correction_bias=False),
    ),
}  # fmt: skip
UNSUPPORTED_ARCHITECTURES = {
    "DeepseekV32ForCausalLM": "DeepSeek-V3.2's sparse attention (its lightning indexer choosing each query's keys) "
    "is not implemented in nanostream",
}
"""Architectures refused by name, with the reason."""
# Gemma 4 (text): Gemma's four norms (x * w, in float32), GeGLU, scaled embeddings, sliding and full layers, the
# full ones with their own head size, KV heads and proportional rope (and V from K where attention_k_eq_v), values
# normed, a softmax scale of 1, the last num_kv_shared_layers reading earlier layers' KV (double-wide MLPs there),
# per-layer input embeddings, a scalar per layer, the final logits soft-capped; with enable_moe_block (26B-A4B) GeGLU
# experts beside every layer's dense MLP, routed on the MLP block's input normed and scaled, each output normed.
ARCHITECTURES["Gemma4ForCausalLM"] = Architecture(
    qk_norm=True, attention_bias_key="attention_bias", norms=GEMMA_NORMS, norm_weight_offset=0.0,
    activation_key="hidden_activation", scale_embeddings=True, final_logit_softcap=True,
    rope_types=("default", "proportional"), per_layer_shapes=True, kv_sharing=True, value_norm=True,
    per_layer_inputs=True, layer_scalar=True, unit_attention_scale=True,
    experts=Experts(
        top_k_key="top_k_experts", switch_key="enable_moe_block", activation_key="hidden_activation",
        router="normed_softmax", renormalize=True, float32_weights=True, sparse_layers=False, beside_dense=True,
    ),
)  # fmt: skip
SUPPORTED_ARCHITECTURES = tuple(a for a in ARCHITECTURES if a not in VL_DECODERS)  # (those: inside their wrapper)


@dataclass(frozen=True)
class TextModel:
    """A multimodal checkpoint's language model, which nanostream serves on its own (text in, text out)."""

    architecture: str
    """The language model's architecture, one of ``ARCHITECTURES``."""
    prefixes: tuple[tuple[str, str], ...]
    """Where its tensors sit: (the checkpoint's prefix, the language model's); the vision tower and the projector,
    under none of them, are not loaded."""
    by_model_type: tuple[tuple[str, str], ...] = ()
    """Where the wrapper's language model varies: (its text_config's ``model_type``, the architecture it runs)."""

    def language_model(self, text_config: object) -> str:
        """The architecture of the language model that ``text_config`` describes."""
        return dict(self.by_model_type).get(getattr(text_config, "model_type", None), self.architecture)


_QWEN_VL_LAYOUT = (("model.language_model.", "model."), ("lm_head.", "lm_head."))
_EITHER_LAYOUT = (*_QWEN_VL_LAYOUT, ("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."))
"""transformers 5's layout of a multimodal checkpoint's language model, or the one its 4.x versions wrote."""
TEXT_MODELS = {
    "Gemma3ForConditionalGeneration": TextModel("Gemma3ForCausalLM", (("language_model.", ""),)),
    "Qwen3_5ForConditionalGeneration": TextModel("Qwen3_5ForCausalLM", _QWEN_VL_LAYOUT),
    "Qwen3_5MoeForConditionalGeneration": TextModel("Qwen3_5MoeForCausalLM", _QWEN_VL_LAYOUT),
    "Qwen3VLForConditionalGeneration": TextModel("Qwen3VLForCausalLM", _QWEN_VL_LAYOUT),
    "Qwen3VLMoeForConditionalGeneration": TextModel("Qwen3VLMoeForCausalLM", _QWEN_VL_LAYOUT),
    "Qwen2_5_VLForConditionalGeneration": TextModel("Qwen2_5_VLForCausalLM", (*_QWEN_VL_LAYOUT, ("model.", "model."))),
    # Mistral Small 3.1 (a Mistral language model) and Ministral 3
    "Mistral3ForConditionalGeneration": TextModel(
        "MistralForCausalLM", _EITHER_LAYOUT, by_model_type=(("ministral3", "Ministral3ForCausalLM"),)
    ),
    "Llama4ForConditionalGeneration": TextModel("Llama4ForCausalLM", _EITHER_LAYOUT),
    "Gemma4ForConditionalGeneration": TextModel("Gemma4ForCausalLM", _QWEN_VL_LAYOUT),
}
"""Multimodal checkpoints whose language model nanostream serves on its own: the wrapper's architecture -> its
language model."""


def supported_list() -> str:
    return ", ".join(SUPPORTED_ARCHITECTURES)
