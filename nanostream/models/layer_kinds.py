"""Reading a hybrid family's layers from its config.json: which token mixer each layer has (``layer_types``: a
``linear_attention`` layer is Gated DeltaNet, a ``full_attention`` one attends), the Gated DeltaNet layers' shape
(the ``linear_*`` keys) and the attention's output gate, refusing by name what nanostream does not run::

    mixers, gdn = token_mixers(hf_config, "Qwen3_5ForCausalLM", ARCHITECTURES["Qwen3_5ForCausalLM"])
    mixers[:4]   # ('gated_deltanet', 'gated_deltanet', 'gated_deltanet', 'attention')
"""

from __future__ import annotations

from typing import Any

from nanostream.errors import ModelLoadError
from nanostream.layers.delta_rule import GatedDeltaNetSpec
from nanostream.layers.short_conv import ShortConvSpec
from nanostream.models.declarations import Architecture

MIXER_OF_LAYER_TYPE = {"full_attention": "attention", "linear_attention": "gated_deltanet"}
"""config.json's ``layer_types`` of a hybrid family -> the token mixer (``spec.TOKEN_MIXERS``)."""


def short_conv_layers(hf_config: Any, name: str, arch: Architecture) -> tuple[tuple[str, ...], ShortConvSpec | None]:
    """Each layer's token mixer and the short convolution layers' shape (``layer_types``' ``conv`` layers); ((),
    None) for a family without them, or a config whose layers all attend."""
    if not arch.short_conv:
        return (), None
    kinds = {"full_attention": "attention", "conv": "short_conv"}
    types = hf_config.layer_types
    if len(types) != hf_config.num_hidden_layers or any(t not in kinds for t in types):
        raise ModelLoadError(f"{name} with layer_types {types!r}: nanostream runs {' and '.join(kinds)}, one a layer")
    mixers = tuple(kinds[t] for t in types)
    if "short_conv" not in mixers:
        return (), None
    return mixers, ShortConvSpec(hf_config.hidden_size, _size(hf_config, "conv_L_cache", name))


def token_mixers(hf_config: Any, name: str, arch: Architecture) -> tuple[tuple[str, ...], GatedDeltaNetSpec | None]:
    """Each layer's token mixer and the Gated DeltaNet layers' shape; ((), None) for a family without them, or a
    config whose layers all attend."""
    if arch.gated_deltanet is None:
        return (), None
    num_layers = hf_config.num_hidden_layers
    types = hf_config.layer_types
    unknown = sorted(set(types) - set(MIXER_OF_LAYER_TYPE))
    if unknown or len(types) != num_layers:
        raise ModelLoadError(
            f"{name} with layer_types {unknown or types!r}: nanostream runs {' and '.join(MIXER_OF_LAYER_TYPE)} "
            f"layers, one per layer ({num_layers})"
        )
    mixers = tuple(MIXER_OF_LAYER_TYPE[t] for t in types)
    if "gated_deltanet" not in mixers:
        return (), None
    act = getattr(hf_config, "hidden_act", "silu")
    if act not in ("silu", "swish"):  # transformers' conv takes hidden_act; nanostream's runs SiLU
        raise ModelLoadError(f"{name} with hidden_act={act!r} is not supported; its Gated DeltaNet conv runs silu")
    # the recurrent state is kept in float32, as transformers keeps it, whatever mamba_ssm_dtype asks (never less)
    sizes = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
    nk, nv, dk, dv = (_size(hf_config, key, name) for key in sizes)
    if nv % nk:
        raise ModelLoadError(
            f"{name} with linear_num_value_heads={nv} and linear_num_key_heads={nk}: nanostream needs the value "
            "heads a multiple of the key heads"
        )
    spec = GatedDeltaNetSpec(
        hidden_size=hf_config.hidden_size,
        num_k_heads=nk,
        num_v_heads=nv,
        head_k_dim=dk,
        head_v_dim=dv,
        conv_kernel=_size(hf_config, "linear_conv_kernel_dim", name),
        rms_norm_eps=hf_config.rms_norm_eps,
        fused_projections=arch.gated_deltanet.fused_projections,
    )
    return mixers, spec


def attention_output_gate(hf_config: Any, name: str, arch: Architecture) -> bool:
    """Whether the attention layers gate their output (the family's; a config that turns it off is refused)."""
    if not arch.attn_output_gate:
        return False
    if getattr(hf_config, "attn_output_gate", True) is not True:
        raise ModelLoadError(
            f"{name} with attn_output_gate={hf_config.attn_output_gate!r} is not supported; its q_proj holds each "
            "head's output gate, which nanostream always applies"
        )
    return True


def _size(hf_config: Any, key: str, name: str) -> int:
    value = getattr(hf_config, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelLoadError(f"{name} with {key}={value!r} is not supported; nanostream needs a positive integer")
    return value
