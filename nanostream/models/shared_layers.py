"""Reading Gemma 4's departures from a config into ``DecoderSpec`` fields: layers of their own KV shape
(``per_layer_config``), KV-shared layers (``num_kv_shared_layers``: each reads the last earlier layer of its type
that has KV of its own, and with ``use_double_wide_mlp`` has an MLP twice as wide), values from keys
(``attention_k_eq_v``, the full layers), normed values, per-layer input embeddings and layer scalars::

    fields = shared_layer_fields(hf_config, "Gemma4ForCausalLM", ARCHITECTURES["Gemma4ForCausalLM"])
    fields["kv_sources"]   # (None, None, 0, 1): layers 2 and 3 read layers 0's and 1's pages
"""

from __future__ import annotations

from typing import Any

from nanostream.errors import ModelLoadError
from nanostream.models.declarations import Architecture
from nanostream.models.moe_config import count, positive_int


def shared_layer_fields(hf_config: Any, name: str, arch: Architecture) -> dict[str, Any]:
    """The ``DecoderSpec`` fields of these departures ({} for a family without them)."""
    n, out = hf_config.num_hidden_layers, {}
    types = list(getattr(hf_config, "layer_types", None) or ["full_attention"] * n)
    if arch.per_layer_shapes:
        layers = hf_config.per_layer_config
        shapes = tuple((layers[i].num_key_value_heads, layers[i].head_dim) for i in range(n))
        out["layer_shapes"] = shapes if len(set(shapes)) > 1 else ()
    if arch.kv_sharing:
        shared = count(hf_config, "num_kv_shared_layers", name)
        first = n - shared
        sources = []
        for i in range(n):
            owners = [j for j in range(first) if types[j] == types[i]]
            if i >= first and not owners:
                raise ModelLoadError(f"{name} with num_kv_shared_layers={shared}: no earlier {types[i]} layer has KV")
            sources.append(owners[-1] if i >= first else None)
        out["kv_sources"] = tuple(sources) if shared else ()
        wide = bool(getattr(hf_config, "use_double_wide_mlp", False))
        out["layer_intermediate"] = tuple(hf_config.intermediate_size * (2 if wide and s is not None else 1)
                                          for s in sources)  # fmt: skip
    if arch.value_norm:
        out["value_norm"] = True
        k_eq_v = bool(getattr(hf_config, "attention_k_eq_v", False))
        out["values_from_keys"] = tuple(k_eq_v and t == "full_attention" for t in types)
    if arch.per_layer_inputs and getattr(hf_config, "hidden_size_per_layer_input", None):
        size = positive_int(hf_config, "hidden_size_per_layer_input", name)
        pad = int(getattr(hf_config, "pad_token_id", None) or 0)  # an image token's per-layer input is the pad's
        out["per_layer_input"] = (positive_int(hf_config, "vocab_size_per_layer_input", name), size, pad)
    out["layer_scalar"] = arch.layer_scalar
    if arch.unit_attention_scale:
        out["attention_scale"] = 1.0
    return out
