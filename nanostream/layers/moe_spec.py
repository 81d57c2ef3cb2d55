"""What a decoder's MoE layers are (``MoESpec``, read from its config by models/moe_config.py) and the
contract of the routed experts' implementation (``MoEFn``: layers/moe_reference.py's torch reference, or
kernels/fused_moe.py's fused Triton kernel).

Its router is one of ``ROUTERS``: ``softmax`` (layers/moe.py's ``Router``: a softmax over the experts, then the
top k; gpt-oss's top k, then a softmax), ``sigmoid`` (the same ``Router``: the top k logits, each weight its
sigmoid, Llama 4's), ``grouped_topk`` (layers/grouped_router.py: DeepSeek's scores, a
correction bias that steers the choice alone, group-limited top k, scaled weights) or ``normed_softmax``
(layers/moe.py's ``NormedInputRouter``, Gemma 4's: the input RMS-normed and scaled, the softmax router renormalised,
each weight times its expert's learned scale).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from nanostream.kernels.expert_ops import GATED_ACTIVATIONS, Activation, ClampedSwiGLU

ROUTERS = ("softmax", "grouped_topk", "sigmoid", "normed_softmax")
SCORINGS = ("sigmoid", "softmax")
"""How a ``grouped_topk`` router scores each expert from its logit."""


class MoEFn(Protocol):
    """``(x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, K], topk_ids [T, K]; w13_bias [E, 2I] and
    w2_bias [E, H] or None, activation) -> [T, H]``: the routed experts' outputs (down's bias added before the
    routing weight) summed with their weights (a partial sum with tensor parallelism): ``moe_experts`` or
    ``nanostream.kernels.fused_moe.fused_moe``."""

    def __call__(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
        activation: Activation = "silu",
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class MoESpec:
    """The MoE layers of a decoder, read from its config (models/moe_config.py). The fields from ``router_bias``
    to ``interleaved_gate_up`` are gpt-oss's, those after ``router`` the ``grouped_topk`` router's options (DeepSeek's
    router: DeepSeek-V3, GLM-4.5, MiniMax-M2); their defaults are the other families' experts."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of each expert
    renormalize: bool  # the top-k weights divided by their sum
    float32_weights: bool  # Mixtral: the routing weights and the top-k sum stay float32 (transformers' router)
    layers: tuple[int, ...]  # the layers whose MLP is this block; the others are dense
    shared_expert_intermediate_size: int = 0  # the shared expert beside the routed ones; 0: none
    shared_expert_gate: bool = True  # its output times sigmoid(shared_expert_gate(x)) (Qwen2-MoE); else added as is
    router_bias: bool = False  # the router linear has a bias [E]
    softmax_after_topk: bool = False  # the top k of the logits, then a softmax over those k in the logits' dtype
    activation: Activation = "silu"
    expert_bias: bool = False  # every expert has a bias on its gate and up rows and on its down output
    transposed_experts: bool = False  # stacked checkpoint tensors [E, H, 2I] and [E, I, H] (inputs first)
    interleaved_gate_up: bool = False  # gate and up alternate along a stacked gate_up tensor's (and bias's) 2I
    router: str = "softmax"  # one of ROUTERS
    scoring: str = "softmax"  # grouped_topk: each expert's score, one of SCORINGS, in float32
    correction_bias: bool = False  # grouped_topk: e_score_correction_bias [E], added to the scores to choose only
    groups: int = 1  # grouped_topk: the experts in this many groups, each ranked by its two best (biased) scores
    topk_groups: int = 1  # grouped_topk: the top k are taken among the experts of this many best groups
    scaling: float = 1.0  # grouped_topk: the (renormalised) weights times this (routed_scaling_factor)
    float32_router: bool = False  # grouped_topk: its weight and correction bias float32, its GEMM in float32
    weights_on_input: bool = False  # the routing weight scales the token going into its one expert (top 1)
    beside_dense: bool = False  # the experts run beside the layer's dense MLP (Gemma 4: layers/moe_beside_mlp.py)

    def __post_init__(self) -> None:
        if self.softmax_after_topk and (self.renormalize or self.float32_weights):
            raise ValueError(
                "softmax_after_topk gives weights that sum to 1 in the logits' dtype: leave renormalize and "
                "float32_weights False with it"
            )
        if self.activation not in GATED_ACTIVATIONS and not isinstance(self.activation, ClampedSwiGLU):
            raise ValueError(
                f"the experts' activation is one of {GATED_ACTIVATIONS} or a ClampedSwiGLU, not {self.activation!r}"
            )
        if self.router not in ROUTERS or self.scoring not in SCORINGS:
            raise ValueError(f"router {self.router!r} with scoring {self.scoring!r}: one of {ROUTERS}, of {SCORINGS}")
        grouped = (self.scoring, self.correction_bias, self.groups, self.topk_groups, self.scaling, self.float32_router)
        if self.router != "grouped_topk" and grouped != ("softmax", False, 1, 1, 1.0, False):
            raise ValueError("scoring, correction_bias, groups, topk_groups, scaling, float32_router: grouped_topk's")
        if (self.router == "normed_softmax") != self.beside_dense:
            raise ValueError("normed_softmax routes the experts beside a dense MLP (layers/moe_beside_mlp.py) alone")
        if self.weights_on_input and self.top_k != 1:
            raise ValueError("weights_on_input scales a token's input to its one expert: top_k must be 1")
        problem = group_problem(self.num_experts, self.top_k, self.groups, self.topk_groups)
        if problem is not None:
            raise ValueError(problem)


def group_problem(num_experts: int, top_k: int, groups: int, topk_groups: int) -> str | None:
    """Why ``num_experts`` experts in ``groups`` groups, ``top_k`` of them taken among ``topk_groups`` groups, cannot
    be routed (each group ranked by its two best scores), or None."""
    if groups < 1 or num_experts % groups:
        return f"{num_experts} experts do not split into {groups} groups of equal size"
    if groups > 1 and num_experts // groups < 2:
        return f"groups of {num_experts // groups} expert: a group is ranked by its two best scores"
    if not 1 <= topk_groups <= groups:
        return f"the top {topk_groups} of {groups} groups: it takes from 1 to {groups}"
    if top_k > topk_groups * (num_experts // groups):
        return f"{top_k} experts cannot be taken from {topk_groups} groups of {num_experts // groups}"
    return None
