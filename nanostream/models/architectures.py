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
from typing import Any

from nanostream.models.latent_config import LatentAttentionLayers
from nanostream.models.moe_config import Experts
from nanostream.models.spec import LayerNorms

LLAMA_NORMS = LayerNorms()
GEMMA_NORMS = LayerNorms(
    "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"
)
GLM_NORMS = LayerNorms("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm")
OLMO2_NORMS = LayerNorms(None, "post_attention_layernorm", None, "post_feedforward_layernorm")
ROPES = ("default", "linear", "yarn")
"""The rope types of transformers' generic rotary embedding that a family's configs use."""


@dataclass(frozen=True)
class GatedDeltaNetLayers:
    """A hybrid family's ``linear_attention`` layers (config.json's ``layer_types``): Gated DeltaNet, sized by the
    config's ``linear_*`` keys (layers/gated_deltanet.py)."""

    fused_projections: bool = False
    """Its checkpoints' input projections are ``in_proj_qkvz`` and ``in_proj_ba``, rows grouped per key head
    (Qwen3-Next); else ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b`` and ``in_proj_a`` (Qwen3.5)."""


@dataclass(frozen=True)
class Architecture:
    qk_norm: bool = False
    """RMSNorm over each head's queries and keys before the rotary embedding."""
    qk_norm_key: str | None = None
    """The config key that, when true, turns ``qk_norm`` on (GLM-4.5's ``use_qk_norm``)."""
    qkv_bias: bool = False
    """Biases on q, k and v (not o) whatever the config says."""
    qkv_bias_key: str | None = None
    """The config key that, when true, puts biases on q, k and v (not o)."""
    attention_bias_key: str | None = None
    """The config key that, when true, puts biases on q, k, v and o."""
    mlp_bias_key: str | None = None
    """The config key that, when true, puts biases on gate, up and down."""
    rope_types: tuple[str, ...] = ("default",)
    """The rotary embeddings (``rope_type``) it may declare."""
    partial_rotary: bool = False
    """It honours partial_rotary_factor (Phi-3, GLM-4); elsewhere a factor other than 1 is refused."""
    interleaved_rotary: bool = False
    """It rotates pairs of neighbouring dims (GLM-4), not the two halves of a head."""
    sliding_window_switch: str | None = None
    """The config key that turns the config's ``sliding_window`` on; None: on whenever it is set."""
    experts: Experts | None = None
    """A mixture-of-experts family's MoE layers; None: a dense decoder."""
    norms: LayerNorms = LLAMA_NORMS
    """Where its norms sit in a layer, under their checkpoint names."""
    norm_weight_offset: float | None = None
    """How its norms round (layers/norm.py): None as Llama's; 0.0 or 1.0 (Gemma's 1 + w) in float32."""
    qk_norm_whole: bool = False
    """The QK-norms span the whole q and k projections (OLMo 2), not each head."""
    activation_key: str = "hidden_act"
    """The config key naming the MLP's activation."""
    scale_embeddings: bool = False
    """The embeddings times sqrt(hidden_size) (Gemma)."""
    multipliers: bool = False
    """Granite's embedding_multiplier, residual_multiplier, attention_multiplier and logits_scaling."""
    query_pre_attn_scalar: bool = False
    """The softmax scale is query_pre_attn_scalar ** -0.5 (Gemma), not head_dim ** -0.5."""
    final_logit_softcap: bool = False
    """The config's final_logit_softcapping caps the logits (Gemma)."""
    attention_sinks: bool = False
    """A learned sink logit per head in every softmax (gpt-oss)."""
    no_rope_layers: bool = False
    """The config's no_rope_layers (0: no rotary embedding in that layer) (SmolLM3)."""
    attn_output_gate: bool = False
    """q_proj gives each head's query and an output gate, [query D | gate D]; the attention output is times
    sigmoid(gate) before o_proj (Qwen3-Next, Qwen3.5)."""
    gated_deltanet: GatedDeltaNetLayers | None = None
    """Its ``linear_attention`` layers; None: every layer attends."""
    latent_attention: LatentAttentionLayers | None = None
    """Every layer attends through multi-head latent attention; None: softmax attention of its own K and V."""
    unused_tensors: tuple[str, ...] = ()
    """Prefixes of checkpoint tensors of parts nanostream does not run (multi-token prediction's ``mtp.``, a vision
    tower): not loaded, one log line each."""
    mtp_layers_key: str | None = None
    """The config key counting the multi-token-prediction layers a checkpoint appends to the decoder's, as
    ``model.layers.{num_hidden_layers + i}``: not loaded, one log line."""
    fixed_values: tuple[tuple[str, Any], ...] = ()
    """(config key, the one value nanostream runs, as transformers does whatever the config says): a config without
    the key, or with that value (a list: in every entry), loads; another value is refused, naming it."""


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
# M-RoPE (rope_parameters' mrope_section, mrope_interleaved) gives each frequency the text, height or width
# position of a token; for text those three are one position, so it is the 1-D rotary embedding, whatever its
# scaling: nanostream runs text (its multimodal checkpoints' language model), the keys are accepted and not read.
_HYBRID = dict(
    qk_norm=True,
    attention_bias_key="attention_bias",
    norm_weight_offset=1.0,
    partial_rotary=True,
    attn_output_gate=True,
    rope_types=ROPES,
)
_QWEN3_5_UNUSED = ("mtp.", "model.visual.")  # its multi-token prediction layer; a vision tower left in
ARCHITECTURES |= {
    "Qwen3NextForCausalLM": Architecture(
        **_HYBRID,
        gated_deltanet=GatedDeltaNetLayers(fused_projections=True),
        experts=Experts(shared_expert=True),
        unused_tensors=("mtp.",),
    ),
    "Qwen3_5ForCausalLM": Architecture(**_HYBRID, gated_deltanet=GatedDeltaNetLayers(), unused_tensors=_QWEN3_5_UNUSED),
    "Qwen3_5MoeForCausalLM": Architecture(
        **_HYBRID,
        gated_deltanet=GatedDeltaNetLayers(),
        experts=Experts(shared_expert=True, renormalize=True, sparse_layers=False),  # every layer's, no key for either
        unused_tensors=_QWEN3_5_UNUSED,
    ),
}
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
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


@dataclass(frozen=True)
class TextModel:
    """A multimodal checkpoint's language model, which nanostream serves on its own (text in, text out)."""

    architecture: str
    """The language model's architecture, one of ``ARCHITECTURES``."""
    prefixes: tuple[tuple[str, str], ...]
    """Where its tensors sit: (the checkpoint's prefix, the language model's); the vision tower and the projector,
    under none of them, are not loaded."""


_QWEN_VL_LAYOUT = (("model.language_model.", "model."), ("lm_head.", "lm_head."))
TEXT_MODELS = {
    "Gemma3ForConditionalGeneration": TextModel("Gemma3ForCausalLM", (("language_model.", ""),)),
    "Qwen3_5ForConditionalGeneration": TextModel("Qwen3_5ForCausalLM", _QWEN_VL_LAYOUT),
    "Qwen3_5MoeForConditionalGeneration": TextModel("Qwen3_5MoeForCausalLM", _QWEN_VL_LAYOUT),
}
"""Multimodal checkpoints whose language model nanostream serves on its own: the wrapper's architecture -> its
language model."""


def supported_list() -> str:
    return ", ".join(SUPPORTED_ARCHITECTURES)
