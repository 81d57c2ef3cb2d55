"""The supported architectures, one declaration each (``ARCHITECTURES``), and the multimodal checkpoints whose
language model runs alone (``TEXT_MODELS``).

All of them run the one decoder of models/decoder.py; a declaration says only how its family departs
from it. Sizes, epsilon, rope theta, tied embeddings, sliding windows and which layers have them always
come from the config itself (models/config_reader.py reads them into a ``DecoderSpec``); so do the experts
of a mixture-of-experts family, under the config keys its ``Experts`` declaration names.
"""

from __future__ import annotations

from dataclasses import dataclass

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
class Experts:
    """How a mixture-of-experts family's config.json describes its MoE layers (layers/moe_spec.py)."""

    num_experts_key: str = "num_experts"
    intermediate_key: str = "moe_intermediate_size"
    """The config key of each expert's intermediate size."""
    renormalize: bool | None = None
    """Whether the top-k weights are divided by their sum; None: as the config's ``norm_topk_prob`` says."""
    shared_expert: bool = False
    """Qwen2-MoE's shared expert (``shared_expert_intermediate_size``), scaled by a sigmoid gate."""
    sparse_layers: bool = True
    """``decoder_sparse_step`` and ``mlp_only_layers`` pick the MoE layers (the others are dense); else all are."""
    float32_weights: bool = False
    """The routing weights and their sum stay float32 (transformers' Mixtral router), not the model's dtype."""
    gpt_oss: bool = False
    """gpt-oss's experts: a biased router whose softmax runs over the top k, biased experts with the clamped
    SwiGLU (``swiglu_alpha``, ``swiglu_limit``), stacked [E, H, 2I] checkpoint tensors with gate and up
    interleaved."""


@dataclass(frozen=True)
class Architecture:
    qk_norm: bool = False
    """RMSNorm over each head's queries and keys before the rotary embedding."""
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
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)

TEXT_MODELS = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
"""Multimodal checkpoints whose language model nanostream serves on its own (text in, text out): the wrapper's
architecture -> its text model's. The language model's tensors sit under ``language_model.``; the vision tower
and the projector are not loaded."""


def supported_list() -> str:
    return ", ".join(SUPPORTED_ARCHITECTURES)
