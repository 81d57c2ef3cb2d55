"""Reading a latent-attention family's config.json (DeepSeek-V2/V3, GLM-4.7-Flash, Mistral 4) into the layers' shape
(``LatentAttentionSpec``, layers/latent_attention.py) and the rotary embedding of their rope dims, refusing by name
what nanostream does not run::

    mla, rope = latent_attention(hf_config, "DeepseekV3ForCausalLM", ARCHITECTURES["DeepseekV3ForCausalLM"])
    mla.width, rope.rope_type   # (576, 'yarn')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nanostream.errors import ModelLoadError
from nanostream.layers.latent_attention import LatentAttentionSpec
from nanostream.layers.rope_config import _yarn_mscale, rope_spec
from nanostream.layers.rotary import RopeSpec
from nanostream.models.moe_config import positive_int

if TYPE_CHECKING:
    from nanostream.models.declarations import Architecture


@dataclass(frozen=True)
class LatentAttentionLayers:
    """A family whose layers attend through multi-head latent attention (layers/latent_attention.py), shaped by the
    config's ``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim`` and ``v_head_dim``."""

    interleave_key: str | None = "rope_interleave"
    """The config key saying the rope dims rotate in pairs (2i, 2i + 1) (true when it is absent); None: they always
    do (DeepSeek-V2's complex rotation)."""
    query_scale: bool = False
    """Each query times 1 + beta log(1 + floor(pos / original_max_position_embeddings)) where the rope parameters give
    beta (Mistral 4's ``llama_4_scaling_beta``)."""


def latent_attention(
    hf_config: Any, name: str, arch: Architecture, params: dict[str, Any]
) -> tuple[LatentAttentionSpec, RopeSpec]:
    """The latent attention layers' shape and the rotation of their ``qk_rope_head_dim`` dims; ``params``: the
    config's rope parameters (rope_theta included)."""
    layers = arch.latent_attention
    assert layers is not None, f"{name} declares no latent attention"
    if getattr(hf_config, "attention_bias", False):
        raise ModelLoadError(f"{name} with attention_bias=True is not supported; its latent attention has no biases")
    nope, rope, v, c = (
        positive_int(hf_config, key, name)
        for key in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank")
    )
    q_lora = getattr(hf_config, "q_lora_rank", None)
    if q_lora is not None:
        q_lora = positive_int(hf_config, "q_lora_rank", name)
    params = dict(params)
    partial = params.pop("partial_rotary_factor", None)
    if partial is not None and round((nope + rope) * partial) != rope:  # Mistral 4 says it so: rope / (nope + rope)
        raise ModelLoadError(
            f"{name} with partial_rotary_factor={partial} is not supported; its heads rotate qk_rope_head_dim "
            f"({rope}) of their {nope + rope} dims"
        )
    rotary = rope_spec(
        params, head_dim=rope, max_position_embeddings=hf_config.max_position_embeddings,
        allowed=arch.rope_types, model=name,
    )  # fmt: skip
    interleaved = True if layers.interleave_key is None else bool(getattr(hf_config, layers.interleave_key, True))
    beta = period = None
    if layers.query_scale and params.get("llama_4_scaling_beta") is not None:
        # Mistral 4: each query times 1 + beta log(1 + floor(pos / original_max_position_embeddings))
        beta, period = params["llama_4_scaling_beta"], params.get("original_max_position_embeddings")
        if not isinstance(beta, int | float) or not isinstance(period, int) or period < 1:
            raise ModelLoadError(
                f"{name}'s rope parameters need llama_4_scaling_beta (a number) and original_max_position_embeddings "
                f"(a positive integer) with it, not {beta!r} and {period!r}"
            )
    spec = LatentAttentionSpec(
        q_lora_rank=q_lora,
        kv_lora_rank=c,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=v,
        scale=softmax_scale(nope + rope, params),
        interleaved=interleaved,
        query_scale_beta=None if beta is None else float(beta),
        query_scale_period=period or 1,
    )
    return spec, rotary


def softmax_scale(qk_head_dim: int, params: dict[str, Any]) -> float:
    """qk_head_dim ** -0.5; with DeepSeek's YaRN (``mscale_all_dim``) times its mscale(factor, mscale_all_dim)
    squared: YaRN's cos/sin factor reaches only the rope dims, this one every dim of q . k."""
    scale = qk_head_dim**-0.5
    rope_type = params.get("rope_type", params.get("type", "default"))
    mscale_all_dim = params.get("mscale_all_dim")
    if rope_type != "default" and mscale_all_dim:
        mscale = _yarn_mscale(float(params["factor"]), mscale_all_dim)
        scale = scale * mscale * mscale
    return scale
