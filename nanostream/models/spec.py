"""``DecoderSpec``: the shape of the one decoder, read from a Hugging Face config (models/config_reader.py), and
``LayerNorms``, where a family's norms sit in a layer. Plain values: the decoder (models/decoder.py), its sharding
over tensor-parallel ranks (models/sharding.py) and the engine read them.

Each layer mixes tokens with one of ``TOKEN_MIXERS``: softmax attention (layers/attention.py), Gated DeltaNet
(layers/gated_deltanet.py, the ``linear_attention`` layers of Qwen3-Next and Qwen3.5), multi-head latent attention
(layers/latent_attention.py: DeepSeek's MLA) or a gated short convolution (layers/short_conv.py, LFM2's ``conv``
layers), each declaring its cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanostream.layers.delta_rule import GatedDeltaNetSpec
from nanostream.layers.latent_attention import LatentAttentionSpec
from nanostream.layers.moe_spec import MoESpec
from nanostream.layers.query_temperature import QueryTemperature
from nanostream.layers.rotary import RopeSpec
from nanostream.layers.short_conv import ShortConvSpec
from nanostream.models.quantization import Fp8Spec

TOKEN_MIXERS = ("attention", "gated_deltanet", "latent_attention", "short_conv")


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
    """The shape of a decoder, read from a Hugging Face config (models/config_reader.py)."""

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
    rope_layers: tuple[bool, ...] = ()  # SmolLM3, EXAONE 4, Llama 4: which layers rotate; empty: all
    qk_norm_after_rotary: bool = False  # the QK-norms on the rotated q and k (HunYuan; Llama 4's weightless L2 norm)
    mlp_gated: bool = True  # down(act(gate) * up); else down(act(up)) with no gate_proj (Apertus's xIELU MLP)
    query_temperature: QueryTemperature | None = None  # the queries scaled by position (layers/query_temperature.py)
    temperature_layers: tuple[bool, ...] = ()  # the layers ``query_temperature`` scales; empty: all
    layer_chunks: tuple[int | None, ...] = ()
    """Each layer's attention chunk (chunked local attention: a query sees its chunk only; None: none); empty: none."""
    qk_norm_layers: tuple[bool, ...] = ()  # the layers with QK-norms (where ``qk_norm``); empty: all
    qk_norm_weightless: bool = False  # the QK-norms have no weight (Llama 4's L2 norm)
    quantization: Fp8Spec | None = None
    """How the checkpoint's FP8 weights are stored (config.json's quantization_config); None: unquantized."""
    token_mixers: tuple[str, ...] = ()
    """Each layer's token mixer, one of ``TOKEN_MIXERS``; empty: attention in every layer."""
    gated_deltanet: GatedDeltaNetSpec | None = None  # the Gated DeltaNet layers' shape
    short_conv: ShortConvSpec | None = None  # the short convolution layers' shape (LFM2's ``conv`` layers)
    latent_attention: LatentAttentionSpec | None = None
    """The latent attention layers' shape (then ``head_dim`` is their rotated dims, qk_rope_head_dim)."""
    attn_output_gate: bool = False  # q_proj gives each head [query D | gate D]; the output times sigmoid(gate)
    checkpoint_prefixes: tuple[tuple[str, str], ...] = ()
    """Where a multimodal checkpoint keeps this decoder's tensors: (the checkpoint's prefix, this model's), as
    ``("model.language_model.", "model.")``; a tensor under none of them is not loaded. Empty: the names as they are."""
    unused_tensors: tuple[str, ...] = ()
    layer_shapes: tuple[tuple[int, int], ...] = ()
    """Each attention layer's (KV heads, head dim) where they differ by layer (Gemma 4's full layers); empty: all
    ``(num_kv_heads, head_dim)``."""
    kv_sources: tuple[int | None, ...] = ()
    """The earlier layer whose KV each layer reads instead of its own (Gemma 4's KV-shared layers); empty: none."""
    values_from_keys: tuple[bool, ...] = ()  # the layers whose V is their k projection (attention_k_eq_v)
    value_norm: bool = False  # V is RMS-normed without a weight before it is stored (Gemma 4's v_norm)
    layer_intermediate: tuple[int, ...] = ()  # each layer's dense MLP size where they differ (Gemma 4's double-wide)
    per_layer_input: tuple[int, int, int] | None = None
    """Gemma 4's per-layer input embeddings: (their vocabulary, their size a layer, the pad token id an image token's
    takes); None: none."""
    layer_scalar: bool = False  # each layer's output times a learned scalar (Gemma 4)
    """Prefixes of checkpoint tensors nanostream does not run (multi-token prediction's ``mtp.``, a vision tower):
    not loaded, one log line each."""

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    def kv_shape(self, layer: int) -> tuple[int, int]:
        """Layer ``layer``'s (KV heads, head dim)."""
        return self.layer_shapes[layer] if self.layer_shapes else (self.num_kv_heads, self.head_dim)

    def kv_source(self, layer: int) -> int | None:
        return self.kv_sources[layer] if self.kv_sources else None

    def chunk(self, layer: int) -> int | None:
        return self.layer_chunks[layer] if self.layer_chunks else None

    def has_qk_norm(self, layer: int) -> bool:
        return self.qk_norm and (not self.qk_norm_layers or self.qk_norm_layers[layer])

    def temperature(self, layer: int) -> QueryTemperature | None:
        """Layer ``layer``'s query temperature (layers/query_temperature.py), or None."""
        if self.temperature_layers and not self.temperature_layers[layer]:
            return None
        return self.query_temperature

    @property
    def kv_window(self) -> int | None:
        """The longest sliding window (or attention chunk: a query at p reads from p - p % chunk, within ``chunk``
        tokens) when every layer that keeps KV has one (the KV a sequence still reads is its last ``kv_window``
        tokens'); None when one attends to its whole context."""
        windows = [self._reach(i) for i in range(self.num_layers) if self.mixer(i) == "attention"]
        return max(windows) if windows and None not in windows else None

    def _reach(self, layer: int) -> int | None:
        """How many of its last tokens a query of layer ``layer`` may read: its window or its chunk; None: all."""
        reaches = [r for r in (self.window(layer), self.chunk(layer)) if r is not None]
        return min(reaches) if reaches else None

    def mixer(self, layer: int) -> str:
        """Layer ``layer``'s token mixer, one of ``TOKEN_MIXERS``."""
        return self.token_mixers[layer] if self.token_mixers else "attention"

    def name_in_model(self, checkpoint_name: str) -> str | None:
        """The name in the model of a checkpoint tensor; None where it is not this decoder's (a multimodal
        checkpoint's vision tower)."""
        if not self.checkpoint_prefixes:
            return checkpoint_name
        for theirs, ours in self.checkpoint_prefixes:
            if checkpoint_name.startswith(theirs):
                return ours + checkpoint_name.removeprefix(theirs)
        return None

    def name_in_checkpoint(self, model_name: str) -> str:
        """The checkpoint's name of a tensor or module of the model (``name_in_model``'s inverse)."""
        for theirs, ours in self.checkpoint_prefixes:
            if model_name.startswith(ours):
                return theirs + model_name.removeprefix(ours)
        return model_name
