"""Gemma 4's MoE block (config ``enable_moe_block``, the 26B-A4B model): routed experts beside the layer's dense MLP,
both on the MLP block's input, each output normed, the two added::

    h = the layer's input + its attention's output       # the MLP block's input (the residual stream)
    dense = mlp(pre_feedforward_layernorm(h))             # the layer's dense MLP, as without experts
    weights, ids = router(h)                              # layers/moe.py's NormedInputRouter
    routed = experts(pre_feedforward_layernorm_2(h), weights, ids)
    out = post_feedforward_layernorm_1(dense) + post_feedforward_layernorm_2(routed)
    # then the layer's post_feedforward_layernorm and residual add, as without experts

The decoder layer (models/decoder_layer.py) keeps its dense MLP and its norms and calls ``ExpertsBesideMLP`` with
the MLP's output and ``h``; the block's modules sit on the layer under the checkpoint's names (``router`` is the
decoder's ``gate``, ``experts``, ``pre_feedforward_layernorm_2``, ``post_feedforward_layernorm_1`` and ``_2``).

With tensor parallelism the router and the norms are whole on every rank and each rank holds every expert's slice
of the intermediate dimension (as layers/moe.py's ``SparseMoE``); the routed experts' partial sums are all-reduced
before their norm, the dense MLP's by its down_proj.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanostream.distributed.group import TensorParallel
from nanostream.layers.experts import Experts
from nanostream.layers.linear import Gemm
from nanostream.layers.moe import NormedInputRouter
from nanostream.layers.moe_spec import MoEFn, MoESpec
from nanostream.layers.norm import RMSNorm, RMSNormFn


class ExpertsBesideMLP(nn.Module):
    """The router, the routed experts over ``rows`` of their intermediate dimension, and the block's three norms
    (``eps``, ``weight_offset``: the layer's); ``forward(dense, h)``: the block's output before the layer's
    post-MLP norm."""

    def __init__(
        self,
        hidden_size: int,
        spec: MoESpec,
        rows: range,
        eps: float,
        weight_offset: float | None,
        kernel: MoEFn,
        norm: RMSNormFn,
        tp: TensorParallel,
        gemm: Gemm = F.linear,
    ) -> None:
        super().__init__()
        self.gate = NormedInputRouter(hidden_size, spec, eps, norm, gemm)
        self.experts = Experts(hidden_size, spec, rows, kernel)
        for name in ("pre_feedforward_layernorm_2", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2"):
            self.add_module(name, RMSNorm(hidden_size, eps, norm, weight_offset))
        self.reduce = tp.all_reduce if tp.size > 1 else None  # one rank: no collective

    def forward(self, dense: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        # dense: the dense MLP's output [T, H]; h: the MLP block's input [T, H] -> [T, H]
        weights, ids = self.gate(h)  # [T, K] each
        routed = self.experts(self.pre_feedforward_layernorm_2(h), weights, ids)
        if self.reduce is not None:
            routed = self.reduce(routed)
        return self.post_feedforward_layernorm_1(dense) + self.post_feedforward_layernorm_2(routed)
