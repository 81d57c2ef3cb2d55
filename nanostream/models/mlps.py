"""The MLP blocks of a decoder layer (models/decoder_layer.py): the dense ``MLP`` (gated), the ``UngatedMLP``
(Apertus's xIELU), and in the layers ``spec.moe`` names the ``SparseMoE`` block (layers/moe.py) in the MLP's place
or, where the experts run beside the dense MLP (Gemma 4), an ``ExpertsBesideMLP`` (layers/moe_beside_mlp.py) next
to it. Each is built for this rank's shard (models/sharding.py): gate/up column-parallel, down_proj row-parallel,
the experts by rows of their intermediate dimension.
"""

from __future__ import annotations

import torch
from torch import nn

from nanostream.distributed.group import TensorParallel
from nanostream.layers.activation import SiluAndMul
from nanostream.layers.layer_kernels import LayerKernels
from nanostream.layers.linear import MergedColumnLinear, row_parallel_linear
from nanostream.layers.moe import SparseMoE
from nanostream.layers.moe_beside_mlp import ExpertsBesideMLP
from nanostream.layers.xielu import XIELU
from nanostream.models.sharding import DecoderShard
from nanostream.models.spec import DecoderSpec


class MLP(nn.Module):
    def __init__(
        self, spec: DecoderSpec, kernels: LayerKernels, shard: DecoderShard, tp: TensorParallel, size: int | None = None
    ) -> None:
        super().__init__()  # ``size``: this layer's own intermediate size, else the spec's
        total = spec.intermediate_size if size is None else size
        rows = (
            shard.intermediate
            if size is None
            else range(shard.rank * size // shard.size, (shard.rank + 1) * size // shard.size)
        )
        parts = {"gate": (rows, total), "up": (rows, total)}
        self.gate_up_proj = MergedColumnLinear(spec.hidden_size, parts, spec.mlp_bias, kernels.linear)
        self.act = SiluAndMul(kernels.gated(spec.activation), spec.activation)
        self.down_proj = row_parallel_linear(rows, spec.hidden_size, spec.mlp_bias, tp, kernels.linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.activated(x, self.act))


class UngatedMLP(nn.Module):
    """down(act(up(x))), no gate_proj; the activation a module of its own (xIELU's learned scalars: ``act_fn``)."""

    def __init__(self, spec: DecoderSpec, kernels: LayerKernels, shard: DecoderShard, tp: TensorParallel) -> None:
        super().__init__()
        rows = shard.intermediate
        # the checkpoint's up_proj, under the name of the gated MLP's fused projection (its only part "up")
        self.gate_up_proj = MergedColumnLinear(spec.hidden_size, {"up": (rows, spec.intermediate_size)}, spec.mlp_bias,
                                          kernels.linear)  # fmt: skip
        self.act_fn = XIELU()
        self.down_proj = row_parallel_linear(rows, spec.hidden_size, spec.mlp_bias, tp, kernels.linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


def layer_mlp(
    spec: DecoderSpec, layer_idx: int, kernels: LayerKernels, shard: DecoderShard, tp: TensorParallel
) -> nn.Module:
    """Layer ``layer_idx``'s MLP: the MoE block in the layers ``spec.moe`` names, else the dense one."""
    if spec.moe is None or layer_idx not in spec.moe.layers or spec.moe.beside_dense:
        if spec.layer_intermediate and spec.layer_intermediate[layer_idx] != spec.intermediate_size:
            return MLP(spec, kernels, shard, tp, spec.layer_intermediate[layer_idx])
        return MLP(spec, kernels, shard, tp) if spec.mlp_gated else UngatedMLP(spec, kernels, shard, tp)
    act = SiluAndMul(kernels.silu_and_mul)
    return SparseMoE(
        spec.hidden_size,
        spec.moe,
        shard.expert_intermediate,
        shard.shared_intermediate,
        kernels.moe,
        act,
        tp,
        kernels.linear,
    )


def experts_beside_mlp(
    spec: DecoderSpec, layer_idx: int, kernels: LayerKernels, shard: DecoderShard, tp: TensorParallel
) -> ExpertsBesideMLP | None:
    """Layer ``layer_idx``'s experts beside its dense MLP (Gemma 4's MoE block), or None."""
    moe = spec.moe
    if moe is None or not moe.beside_dense or layer_idx not in moe.layers:
        return None
    return ExpertsBesideMLP(
        spec.hidden_size, moe, shard.expert_intermediate, spec.rms_norm_eps, spec.norm_weight_offset, kernels.moe,
        kernels.rms_norm, tp, kernels.linear,
    )  # fmt: skip
