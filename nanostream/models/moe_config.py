"""Reading a mixture-of-experts family's experts from its config.json into a ``MoESpec`` (layers/moe_spec.py), under
the keys its ``Experts`` declaration names (the class is here, each family's in models/architectures.py), refusing
by name what nanostream does not run::

    moe = moe_spec(hf_config, "Glm4MoeForCausalLM", ARCHITECTURES["Glm4MoeForCausalLM"].experts)
    moe.router, moe.layers, moe.scaling   # ('grouped_topk', (1, 2, 3), 2.5)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from nanostream.errors import ModelLoadError
from nanostream.kernels.expert_ops import GATED_ACTIVATIONS, ClampedSwiGLU
from nanostream.layers.activation import ACTIVATIONS
from nanostream.layers.moe_spec import SCORINGS, MoESpec, group_problem


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
    router: str = "softmax"
    """The router's kind (layers/moe_spec.py's ``ROUTERS``; ``sigmoid``: the top-k logits, each weight its sigmoid).
    ``grouped_topk``, DeepSeek's (layers/grouped_router.py): the config's ``scoring_func`` (sigmoid when it has
    none) and ``topk_method`` (``noaux_tc`` when it has none: a correction bias steers the choice; ``greedy``: none,
    no groups)."""
    groups: bool = False
    """The config's ``n_group`` and ``topk_group`` limit the choice to the best groups of experts (grouped_topk)."""
    scaling_key: str | None = None
    """The config key of the factor the routing weights are multiplied by (``routed_scaling_factor``)."""
    float32_router: bool = False
    """The router's weight and correction bias are float32 and its GEMM runs in float32 (transformers' DeepSeek-V3
    and GLM-4.5); else the model's dtype."""
    first_dense_key: str | None = None
    """The config key counting the dense layers before the first MoE one (``first_k_dense_replace``)."""
    shared_experts_key: str | None = None
    """The config key counting DeepSeek's shared experts (``n_shared_experts``), each of the routed experts' size,
    run as one ungated MLP beside them (checkpoint name ``shared_experts``)."""
    layer_types_key: str | None = None
    """The config key listing each layer's MLP, ``dense`` or ``sparse`` (GLM-4.7-Flash's ``mlp_layer_types``)."""
    scoring: str | None = None
    """grouped_topk: how the family's router always scores (DeepSeek-V2's and Mistral 4's softmax); None: the
    config's ``scoring_func``."""
    correction_bias: bool = True
    """grouped_topk: its ``noaux_tc`` choice adds ``e_score_correction_bias``; False: the family has none (Mistral 4:
    groups on the plain scores)."""
    layer_range_keys: tuple[str, str, str] | None = None
    """The config keys of the first MoE layer, the last one (-1: the last layer) and the step between them
    (``moe_layer_start_index``, ``moe_layer_end_index``, ``moe_layer_interval``); None: ``sparse_layers`` decides."""
    layers_key: str | None = None
    """The config key listing the MoE layers (``moe_layers``); None: ``sparse_layers`` decides."""
    weights_on_input: bool = False
    """A token's routing weight scales its input to its one expert, not the expert's output (top-1 routing)."""
    shared_expert_size_key: str | None = None
    """The config key of the intermediate size of one ungated shared expert beside the routed ones (Llama 4's
    ``intermediate_size``, the routed experts' own)."""
    transposed: bool = False
    """The checkpoint's stacked experts are [E, H, 2I] and [E, I, H], inputs first (gate and up halves)."""
    top_k_key: str = "num_experts_per_tok"
    """The config key of how many experts a token is routed to (Gemma 4's ``top_k_experts``)."""
    switch_key: str | None = None
    """The config key that turns the MoE layers on (Gemma 4's ``enable_moe_block``); None: they are always there."""
    activation_key: str | None = None
    """The config key naming the experts' gated activation (Gemma 4's ``hidden_activation``); None: SiLU."""
    beside_dense: bool = False
    """The experts run beside the layer's dense MLP on the MLP block's input, each output normed, the two added
    (Gemma 4's MoE block, layers/moe_beside_mlp.py)."""


TOPK_METHODS = ("noaux_tc", "greedy")
"""The ``topk_method`` values of DeepSeek's router that nanostream runs: ``noaux_tc`` (a correction bias steers the
choice, limited to the best groups) and ``greedy`` (the top k of the scores, no bias, no groups)."""


def positive_int(hf_config: Any, key: str, arch_name: str, default: Any = None) -> int:
    """The config's ``key``, a positive integer, or a ``ModelLoadError`` naming it."""
    value = getattr(hf_config, key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelLoadError(f"{arch_name} with {key}={value!r} is not supported; nanostream needs a positive integer")
    return value


def count(hf_config: Any, key: str, arch_name: str) -> int:
    """The config's ``key``, an integer of 0 or more (0 when the config lacks it), or a ``ModelLoadError``."""
    value = getattr(hf_config, key, None)
    value = 0 if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ModelLoadError(f"{arch_name} with {key}={value!r} is not supported; nanostream needs an integer >= 0")
    return value


def moe_spec(hf_config: Any, arch_name: str, experts: Experts) -> MoESpec | None:
    """The MoE layers a config declares, refusing what nanostream does not run; None: none (every MLP dense)."""
    if experts.switch_key is not None and not getattr(hf_config, experts.switch_key, False):
        return None
    num_experts = getattr(hf_config, experts.num_experts_key, None)
    if num_experts == 0 and experts.sparse_layers:  # transformers' Qwen MoE models: every layer dense
        return None
    num_experts = positive_int(hf_config, experts.num_experts_key, arch_name)
    top_k = positive_int(hf_config, experts.top_k_key, arch_name)
    if top_k > num_experts:
        raise ModelLoadError(
            f"{arch_name} routes each token to {experts.top_k_key}={top_k} of {experts.num_experts_key}={num_experts} "
            "experts; it cannot pick more than there are"
        )
    layers = _moe_layers(hf_config, arch_name, experts)
    if not layers:
        return None
    intermediate = positive_int(hf_config, experts.intermediate_key, arch_name)
    shared, gated = 0, True
    if experts.shared_expert:
        shared = getattr(hf_config, "shared_expert_intermediate_size", 0)
        if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
            raise ModelLoadError(f"{arch_name} with shared_expert_intermediate_size={shared!r} is not supported")
    if experts.shared_experts_key is not None:  # DeepSeek's: n experts of the routed ones' size, one ungated MLP
        shared, gated = count(hf_config, experts.shared_experts_key, arch_name) * intermediate, False
    if experts.shared_expert_size_key is not None:  # one ungated shared expert of its own size
        shared, gated = positive_int(hf_config, experts.shared_expert_size_key, arch_name), False
    renormalize = experts.renormalize
    if renormalize is None:
        renormalize = bool(getattr(hf_config, "norm_topk_prob", False))
    fields = dict(
        router=experts.router, transposed_experts=experts.transposed, weights_on_input=experts.weights_on_input,
        beside_dense=experts.beside_dense,
    )  # fmt: skip
    fields |= _gpt_oss(hf_config, experts) | _grouped_router(hf_config, arch_name, experts, num_experts, top_k)
    fields |= _activation(hf_config, arch_name, experts)
    return MoESpec(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=intermediate,
        renormalize=renormalize,
        float32_weights=experts.float32_weights,
        layers=layers,
        shared_expert_intermediate_size=shared,
        shared_expert_gate=gated,
        **fields,
    )


def _moe_layers(hf_config: Any, arch_name: str, experts: Experts) -> tuple[int, ...]:
    num_layers = hf_config.num_hidden_layers
    layers = tuple(range(num_layers))
    if experts.layers_key is not None:  # the config lists them
        listed = getattr(hf_config, experts.layers_key, None)
        if not isinstance(listed, list | tuple) or not all(isinstance(i, int) and 0 <= i < num_layers for i in listed):
            raise ModelLoadError(f"{arch_name} with {experts.layers_key}={listed!r}: nanostream needs layer indices")
        return tuple(sorted(set(listed)))
    if experts.layer_range_keys is not None:  # from a first to a last layer, every n-th
        start_key, end_key, step_key = experts.layer_range_keys
        start, step = count(hf_config, start_key, arch_name), positive_int(hf_config, step_key, arch_name, default=1)
        end = getattr(hf_config, end_key, -1)
        end = num_layers - 1 if end is None or end == -1 else end
        if isinstance(end, bool) or not isinstance(end, int) or end < 0:
            raise ModelLoadError(f"{arch_name} with {end_key}={end!r}: nanostream needs a layer index or -1")
        return tuple(i for i in layers if start <= i <= end and (i + 1) % step == 0)
    if experts.sparse_layers:
        step = positive_int(hf_config, "decoder_sparse_step", arch_name, default=1)
        only = getattr(hf_config, "mlp_only_layers", None) or []
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
            raise ModelLoadError(f"{arch_name} with mlp_only_layers={only!r}: nanostream needs a list of layer indices")
        layers = tuple(i for i in layers if i not in only and (i + 1) % step == 0)
    if experts.first_dense_key is not None:  # DeepSeek's first_k_dense_replace: dense layers, then MoE ones
        first = count(hf_config, experts.first_dense_key, arch_name)
        layers = tuple(i for i in layers if i >= first)
    if experts.layer_types_key is not None:  # GLM-4.7-Flash's mlp_layer_types: "dense" or "sparse" per layer
        types = getattr(hf_config, experts.layer_types_key, None)
        if types is not None:
            if len(types) != num_layers or not set(types) <= {"dense", "sparse"}:
                raise ModelLoadError(
                    f"{arch_name} with {experts.layer_types_key}={types!r}: nanostream needs 'dense' or 'sparse' for "
                    f"each of its {num_layers} layers"
                )
            layers = tuple(i for i in layers if types[i] == "sparse")
    return layers


def _gpt_oss(hf_config: Any, experts: Experts) -> dict[str, Any]:
    if not experts.gpt_oss:
        return {}
    # transformers before swiglu_alpha was a config key used 1.702, and so do configs without it
    alpha, limit = getattr(hf_config, "swiglu_alpha", 1.702), getattr(hf_config, "swiglu_limit", 7.0)
    return dict(
        router_bias=True,
        softmax_after_topk=True,
        activation=ClampedSwiGLU(alpha=float(alpha), limit=float(limit)),
        expert_bias=True,
        transposed_experts=True,
        interleaved_gate_up=True,
    )


def _activation(hf_config: Any, arch_name: str, experts: Experts) -> dict[str, Any]:
    """The experts' activation where the config names it (``activation_key``); {} for SiLU's or gpt-oss's."""
    if experts.activation_key is None:
        return {}
    name = getattr(hf_config, experts.activation_key, None)
    if ACTIVATIONS.get(name) not in GATED_ACTIVATIONS:
        raise ModelLoadError(
            f"{arch_name} with {experts.activation_key}={name!r} is not supported; nanostream's experts run "
            f"{', '.join(k for k, v in ACTIVATIONS.items() if v in GATED_ACTIVATIONS)}"
        )
    return {"activation": ACTIVATIONS[name]}


def _grouped_router(hf_config: Any, name: str, experts: Experts, num_experts: int, top_k: int) -> dict[str, Any]:
    """DeepSeek's router's options (``scoring_func``, ``topk_method``, groups, scaling), refusing what it does not
    run; {} for another router."""
    if experts.router != "grouped_topk":
        return {}
    scoring = experts.scoring or getattr(hf_config, "scoring_func", None) or "sigmoid"
    if scoring not in SCORINGS:
        raise ModelLoadError(
            f"{name} with scoring_func={scoring!r} is not supported; nanostream's router scores by "
            f"{' or '.join(SCORINGS)}"
        )
    method = getattr(hf_config, "topk_method", None) or "noaux_tc"
    if method not in TOPK_METHODS:
        raise ModelLoadError(
            f"{name} with topk_method={method!r} is not supported; nanostream's router runs {', '.join(TOPK_METHODS)}"
        )
    groups = topk_groups = 1
    if experts.groups and method == "noaux_tc":
        groups = positive_int(hf_config, "n_group", name, default=1)
        topk_groups = positive_int(hf_config, "topk_group", name, default=1)
        problem = group_problem(num_experts, top_k, groups, topk_groups)
        if problem is not None:
            raise ModelLoadError(f"{name} with n_group={groups}, topk_group={topk_groups} is not supported: {problem}")
    scaling = 1.0
    if experts.scaling_key is not None:
        scaling = getattr(hf_config, experts.scaling_key, None)
        scaling = 1.0 if scaling is None else scaling
        if isinstance(scaling, bool) or not isinstance(scaling, int | float) or not math.isfinite(scaling):
            raise ModelLoadError(f"{name} with {experts.scaling_key}={scaling!r} is not supported; it needs a number")
    return dict(
        router="grouped_topk",
        scoring=scoring,
        correction_bias=method == "noaux_tc" and experts.correction_bias,
        groups=groups,
        topk_groups=topk_groups,
        scaling=float(scaling),
        float32_router=experts.float32_router,
    )
