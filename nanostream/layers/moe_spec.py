"""What a decoder's MoE layers are (``MoESpec``, read from its config by models/config_reader.py) and the
contract of the routed experts' implementation (``MoEFn``: layers/moe_reference.py's torch reference, or
kernels/fused_moe.py's fused Triton kernel).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from nanostream.kernels.expert_ops import Activation, ClampedSwiGLU


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
    """The MoE layers of a decoder, read from its config (models/config_reader.py). The fields after
    ``shared_expert_intermediate_size`` are gpt-oss's; their defaults are the other families' experts."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of each expert
    renormalize: bool  # the top-k weights divided by their sum
    float32_weights: bool  # Mixtral: the routing weights and the top-k sum stay float32 (transformers' router)
    layers: tuple[int, ...]  # the layers whose MLP is this block; the others are dense
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert; 0: none
    router_bias: bool = False  # the router linear has a bias [E]
    softmax_after_topk: bool = False  # the top k of the logits, then a softmax over those k in the logits' dtype
    activation: Activation = "silu"
    expert_bias: bool = False  # every expert has a bias on its gate and up rows and on its down output
    transposed_experts: bool = False  # stacked checkpoint tensors [E, H, 2I] and [E, I, H] (inputs first)
    interleaved_gate_up: bool = False  # gate and up alternate along a stacked gate_up tensor's (and bias's) 2I

    def __post_init__(self) -> None:
        if self.softmax_after_topk and (self.renormalize or self.float32_weights):
            raise ValueError(
                "softmax_after_topk gives weights that sum to 1 in the logits' dtype: leave renormalize and "
                "float32_weights False with it"
            )
        if self.activation != "silu" and not isinstance(self.activation, ClampedSwiGLU):
            raise ValueError(f"the experts' activation is 'silu' or a ClampedSwiGLU, not {self.activation!r}")
