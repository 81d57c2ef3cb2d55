"""The supported architectures, one declaration each, and reading a config.json into a ``DecoderSpec``.

All of them run the one decoder of models/decoder.py; a declaration says only how its family departs
from it. Sizes, epsilon, rope theta and tied embeddings always come from the config itself; so do the
experts of a mixture-of-experts family, under the config keys its ``Experts`` declaration names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nanostream.errors import ModelLoadError
from nanostream.layers.moe import MoESpec
from nanostream.layers.rotary import Llama3RopeScaling
from nanostream.models.decoder import DecoderSpec


@dataclass(frozen=True)
class Experts:
    """How a mixture-of-experts family's config.json describes its MoE layers (layers/moe.py)."""

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
    sliding_window_switch: str | None = None
    """The config key that turns the config's ``sliding_window`` on; None: on whenever it is set."""
    experts: Experts | None = None
    """A mixture-of-experts family's MoE layers; None: a dense decoder."""


ARCHITECTURES: dict[str, Architecture] = {
    "Qwen3ForCausalLM": Architecture(
        qk_norm=True, attention_bias_key="attention_bias", sliding_window_switch="use_sliding_window"
    ),
    "Qwen2ForCausalLM": Architecture(qkv_bias=True, sliding_window_switch="use_sliding_window"),
    "LlamaForCausalLM": Architecture(
        attention_bias_key="attention_bias", mlp_bias_key="mlp_bias", rope_types=("default", "llama3")
    ),
    "MistralForCausalLM": Architecture(),
    "Qwen3MoeForCausalLM": Architecture(
        qk_norm=True, attention_bias_key="attention_bias", sliding_window_switch="use_sliding_window", experts=Experts()
    ),
    "Qwen2MoeForCausalLM": Architecture(
        qkv_bias_key="qkv_bias", sliding_window_switch="use_sliding_window", experts=Experts(shared_expert=True)
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


def supported_list() -> str:
    return ", ".join(SUPPORTED_ARCHITECTURES)


def _rope(hf_config: Any, arch_name: str, arch: Architecture) -> tuple[float, Llama3RopeScaling | None]:
    # transformers 5 keeps everything in rope_parameters; 4.x has rope_scaling (None by default) and rope_theta.
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in arch.rope_types:
        raise ModelLoadError(
            f"rope type {rope_type!r} is not supported for {arch_name}; nanostream runs {', '.join(arch.rope_types)}"
        )
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ModelLoadError("config.json gives no rope_theta")
    if rope_type != "llama3":
        return float(theta), None
    keys = ("factor", "low_freq_factor", "high_freq_factor")
    missing = [k for k in keys if k not in params]
    if missing:
        raise ModelLoadError(f"rope_scaling of type llama3 lacks {', '.join(missing)} in config.json")
    original = params.get("original_max_position_embeddings", hf_config.max_position_embeddings)
    scaling = Llama3RopeScaling(*(float(params[k]) for k in keys), original_max_position_embeddings=int(original))
    return float(theta), scaling


def _sliding_window(hf_config: Any, arch: Architecture) -> int | None:
    switch = arch.sliding_window_switch
    if switch is not None and not getattr(hf_config, switch, False):
        return None
    return getattr(hf_config, "sliding_window", None)


def _positive_int(hf_config: Any, key: str, arch_name: str, default: Any = None) -> int:
    value = getattr(hf_config, key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelLoadError(f"{arch_name} with {key}={value!r} is not supported; nanostream needs a positive integer")
    return value


def _moe(hf_config: Any, arch_name: str, experts: Experts) -> MoESpec | None:
    """The MoE layers a config declares, refusing what nanostream does not run; None: none (every MLP dense)."""
    num_experts = getattr(hf_config, experts.num_experts_key, None)
    if num_experts == 0 and experts.sparse_layers:  # transformers' Qwen MoE models: every layer dense
        return None
    num_experts = _positive_int(hf_config, experts.num_experts_key, arch_name)
    top_k = _positive_int(hf_config, "num_experts_per_tok", arch_name)
    if top_k > num_experts:
        raise ModelLoadError(
            f"{arch_name} routes each token to num_experts_per_tok={top_k} of {experts.num_experts_key}={num_experts} "
            "experts; it cannot pick more than there are"
        )
    num_layers = hf_config.num_hidden_layers
    layers = tuple(range(num_layers))
    if experts.sparse_layers:
        step = _positive_int(hf_config, "decoder_sparse_step", arch_name, default=1)
        only = getattr(hf_config, "mlp_only_layers", None) or []
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
            raise ModelLoadError(f"{arch_name} with mlp_only_layers={only!r}: nanostream needs a list of layer indices")
        layers = tuple(i for i in layers if i not in only and (i + 1) % step == 0)
    if not layers:
        return None
    shared = 0
    if experts.shared_expert:
        shared = getattr(hf_config, "shared_expert_intermediate_size", 0)
        if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
            raise ModelLoadError(f"{arch_name} with shared_expert_intermediate_size={shared!r} is not supported")
    renormalize = experts.renormalize
    if renormalize is None:
        renormalize = bool(getattr(hf_config, "norm_topk_prob", False))
    return MoESpec(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=_positive_int(hf_config, experts.intermediate_key, arch_name),
        renormalize=renormalize,
        float32_weights=experts.float32_weights,
        layers=layers,
        shared_expert_intermediate_size=shared,
    )


def decoder_spec(hf_config: Any, *, max_model_len: int) -> DecoderSpec:
    """Read the decoder's shape from a transformers config, refusing what the decoder cannot run.

    ``max_model_len``: the engine's (resolved) limit. Sliding-window attention is not implemented, but
    a window at least that long never hides a token: such a model runs, one with a shorter window is
    refused, saying to lower max_model_len to it."""
    architectures = getattr(hf_config, "architectures", None) or []
    name = next((a for a in architectures if a in ARCHITECTURES), None)
    if name is None:
        raise ModelLoadError(
            f"unsupported architecture {architectures or 'missing'} in config.json; nanostream runs {supported_list()}"
        )
    arch = ARCHITECTURES[name]
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"{name} with hidden_act={act!r} is not supported; nanostream's MLP runs silu")
    window = _sliding_window(hf_config, arch)
    if window is not None and window < max_model_len:
        raise ModelLoadError(
            f"{name} uses sliding-window attention over {window} tokens, which nanostream does not implement; "
            f"set max_model_len={window} (or less), where a window that long hides nothing"
        )
    rope_theta, rope_scaling = _rope(hf_config, name, arch)
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    attention_bias = bool(arch.attention_bias_key and getattr(hf_config, arch.attention_bias_key, False))
    qkv_bias = arch.qkv_bias or bool(arch.qkv_bias_key and getattr(hf_config, arch.qkv_bias_key, False))
    mlp_bias = bool(arch.mlp_bias_key and getattr(hf_config, arch.mlp_bias_key, False))
    return DecoderSpec(
        architecture=name,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rms_norm_eps=hf_config.rms_norm_eps,
        rope_theta=rope_theta,
        max_position=hf_config.max_position_embeddings,
        qkv_bias=qkv_bias or attention_bias,
        o_bias=attention_bias,
        qk_norm=arch.qk_norm,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        mlp_bias=mlp_bias,
        rope_scaling=rope_scaling,
        moe=_moe(hf_config, name, arch.experts) if arch.experts else None,
    )
