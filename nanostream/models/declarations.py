"""What a family's declaration may say (``Architecture``, with its ``GatedDeltaNetLayers`` here, its ``Experts`` and
``LatentAttentionLayers`` beside their readers, models/moe_config.py and models/latent_config.py): how it departs
from the one decoder, by feature, never by family name. The declarations themselves are models/architectures.py's.
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
    mrope: tuple[int, int, int] | None = None
    """It rotates by M-RoPE, three positions a token (layers/rotary.py), over its rope parameters' mrope_section or,
    where they have none, this (t, h, w) split of the pairs (Qwen3.5's (11, 11, 10), as transformers defaults it)."""
    mrope_interleaved: bool = True
    """Its M-RoPE pairs take t, h, w in turn (Qwen3.5, Qwen3-VL); False: in three runs (Qwen2-VL, Qwen2.5-VL)."""
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
    short_conv: bool = False
    """Its ``layer_types``' ``conv`` layers are gated short convolutions (``conv_L_cache`` wide), beside attention."""
    norm_eps_key: str = "rms_norm_eps"
    """The config key of the RMSNorms' epsilon."""
    auto_adjust_ff_dim: bool = False
    """The config's ``block_auto_adjust_ff_dim`` shrinks the MLP's intermediate size to 2/3, times
    ``block_ffn_dim_multiplier``, rounded up to a multiple of ``block_multiple_of``."""
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
    o_bias_key: str | None = None
    """The config key that, when true, puts a bias on o_proj (``attention_out_bias``)."""
    qk_norm_after_rotary: bool = False
    """The QK-norms run on the rotated q and k, not before the rotary embedding."""
    nope_full_attention: bool = False
    """Where the config has a sliding window, its full-attention layers have no rotary embedding (global NoPE)."""
    gated_mlp: bool = True
    """The MLP is down(act(gate) * up); else down(act(up)), with no gate_proj."""
    chunked_attention: bool = False
    """The config's ``attention_chunk_size`` splits the sequence into chunks, and its ``layer_types``'
    ``chunked_attention`` layers attend within a query's chunk only (chunked local attention)."""
    weightless_qk_norm: bool = False
    """The QK-norms have no weight (an L2 norm of each head, scaled to RMS 1), in the layers with rotary embedding
    only; with ``qk_norm_key`` the config turns them on."""
    dense_intermediate_key: str = "intermediate_size"
    """The config key of the dense MLP's intermediate size."""
    query_temperature: bool = False
    """The queries times 1 + beta * log(1 + floor((position + offset) / floor_scale)) (attention temperature
    tuning): the config's ``attn_temperature_tuning`` (``attn_scale``, ``floor_scale``, offset 1, on the layers
    without rotary embedding), or its rope parameters' ``llama_4_scaling_beta`` (over
    ``original_max_position_embeddings``, offset 0, on every layer)."""
    per_layer_shapes: bool = False
    """The config's ``per_layer_config`` gives layers their own head_dim and num_key_value_heads (Gemma 4's full
    layers, ``global_head_dim``); their rope is read over their own head."""
    kv_sharing: bool = False
    """The last ``num_kv_shared_layers`` layers read the KV of the last earlier layer of their type, and with
    ``use_double_wide_mlp`` their MLP is twice as wide."""
    value_norm: bool = False
    """V is RMS-normed without a weight; with ``attention_k_eq_v`` the full layers' V is their k projection."""
    per_layer_inputs: bool = False
    """Per-layer input embeddings of ``hidden_size_per_layer_input`` (layers/per_layer_inputs.py)."""
    layer_scalar: bool = False
    """Each layer's output times a learned scalar (``layer_scalar``)."""
    unit_attention_scale: bool = False
    """The softmax scale is 1 (the QK-norms set the logits' size)."""
    fixed_values: tuple[tuple[str, Any], ...] = ()
    """(config key, the one value nanostream runs, as transformers does whatever the config says): a config without
    the key, or with that value (a list: in every entry), loads; another value is refused, naming it."""
