"""The mixture-of-experts MLP of Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss, GLM-4.5 and MiniMax-M2, and the routers (Gemma
4's too, whose experts run beside its dense MLP: layers/moe_beside_mlp.py): a router picks each token's top-k
experts, their gated MLPs run on the tokens routed to them, and the outputs are summed with the routing weights.

- ``Router``: the gate linear [E, H], a float32 softmax over the experts, the top k, renormalised over
  those k when ``MoESpec.renormalize`` (``norm_topk_prob``; Mixtral always). This is transformers' order
  of operations for all three: Mixtral's "softmax over the top-k logits" is computed as the softmax
  over every expert renormalised over the top k (the same value, rounded as transformers rounds it).
  gpt-oss (``router_bias``, ``softmax_after_topk``): the linear has a bias, and the softmax is over the
  k largest logits, in their dtype, as transformers' ``GptOssTopKRouter`` computes it.
- ``NormedInputRouter`` (``router == "normed_softmax"``, Gemma 4's): that router on the input RMS-normed without
  a weight, times a learned ``scale`` [H] and H^-0.5; each weight then times its expert's ``per_expert_scale``.
- ``Experts`` (layers/experts.py): every expert's gate and up rows stacked, ``w13`` [E, 2I, H] (gate rows
  first), and down, ``w2`` [E, H, I]: transformers' stacked layout and the fused kernel's. gpt-oss's
  checkpoints (stacked [E, H, 2I] with gate and up interleaved, [E, I, H]) are de-interleaved and transposed
  into it at load; its biases (``expert_bias``) are ``w13_bias`` [E, 2I] and ``w2_bias`` [E, H], its
  activation the ``ClampedSwiGLU``. Which implementation runs is the ``MoEFn`` (layers/moe_spec.py) given at
  construction (``LayerKernels.moe``): ``moe_experts`` (layers/moe_reference.py), the reference, or
  ``nanostream.kernels.fused_moe.fused_moe`` (sorted tokens, grouped GEMMs).
- ``SparseMoE``: router -> experts (+ the shared expert: Qwen2-MoE's scaled by a sigmoid gate, DeepSeek's and
  GLM-4.5's ``shared_experts`` added as they are) -> one all-reduce with tensor parallelism.

With tensor parallelism every rank holds every expert's slice of the intermediate dimension (rows of
gate and up and of their bias, columns of down), and of the shared expert's; router, shared-expert gate
and down's bias are whole on every rank. Each rank's output is a partial sum (the sigmoid gate is per
token, so it scales the parts alike) and the block's one all-reduce adds them; down's bias is added by
one rank alone, the one holding the first rows, so that the sum holds it once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanostream.distributed.group import SINGLE, TensorParallel
from nanostream.layers.activation import SiluAndMul
from nanostream.layers.experts import Experts
from nanostream.layers.grouped_router import GroupedTopKRouter
from nanostream.layers.linear import Gemm, MergedColumnLinear, RowParallelLinear
from nanostream.layers.moe_spec import MoEFn, MoESpec
from nanostream.layers.norm import RMSNorm, RMSNormFn


class Router(nn.Module):
    """Gate linear (+ bias) -> float32 softmax over the experts -> top k (-> renormalised), or (gpt-oss) top k
    of the logits -> a softmax over them, or (``router == "sigmoid"``, Llama 4) top k of the logits -> each one's
    sigmoid, taken in float32 and rounded to the logits' dtype: (weights, expert ids)."""

    def __init__(self, hidden_size: int, spec: MoESpec, gemm: Gemm = F.linear) -> None:
        super().__init__()
        self.gemm = gemm
        self.weight = nn.Parameter(torch.empty(spec.num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(spec.num_experts)) if spec.router_bias else None
        self.top_k, self.renormalize, self.float32_weights = spec.top_k, spec.renormalize, spec.float32_weights
        self.softmax_after_topk, self.sigmoid = spec.softmax_after_topk, spec.router == "sigmoid"

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [T, H] -> weights [T, K] (float32, or x's dtype as transformers' Qwen routers), ids [T, K] int64
        logits = self.gemm(x, self.weight, self.bias)  # [T, E]
        if self.sigmoid:
            top, ids = torch.topk(logits, self.top_k, dim=-1)
            return torch.sigmoid(top.float()).to(top.dtype), ids
        if self.softmax_after_topk:
            top, ids = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(top, dim=-1, dtype=top.dtype), ids
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.float32_weights else weights.to(logits.dtype)), ids


class NormedInputRouter(Router):
    """x RMS-normed (no weight), times ``scale`` and hidden_size^-0.5, in x's dtype -> ``Router`` (the float32
    softmax, the top k, renormalised, float32) -> each weight times its expert's ``per_expert_scale``: transformers'
    ``Gemma4TextRouter``, in its order."""

    def __init__(self, hidden_size: int, spec: MoESpec, eps: float, norm: RMSNormFn, gemm: Gemm = F.linear) -> None:
        super().__init__(hidden_size, spec, gemm)
        self.norm = RMSNorm(hidden_size, eps, norm, weight_offset=0.0, learned=False)
        self.scale = nn.Parameter(torch.empty(hidden_size))
        self.per_expert_scale = nn.Parameter(torch.empty(spec.num_experts))
        self.root_size = hidden_size**-0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [T, H] -> weights [T, K] float32, ids [T, K] int64
        weights, ids = super().forward(self.norm(x) * self.scale * self.root_size)
        return weights * self.per_expert_scale[ids], ids


class PartialSumLinear(RowParallelLinear):
    """``columns`` of a projection's input features (read from the checkpoint as ``RowParallelLinear``
    reads them), left unreduced: this rank's part of the sum, which the MoE block's all-reduce adds."""

    def __init__(self, columns: range, out_features: int, gemm: Gemm = F.linear) -> None:
        super().__init__(columns, out_features, bias=False, tp=SINGLE, gemm=gemm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)  # [T, in / size] -> [T, out]


class SharedExpert(nn.Module):
    """The shared expert (Qwen2-MoE's; DeepSeek's ``shared_experts``, all of them as one): a SwiGLU MLP over
    ``rows`` of its intermediate dimension, every token."""

    def __init__(self, hidden_size: int, rows: range, total: int, act: SiluAndMul, gemm: Gemm = F.linear) -> None:
        super().__init__()
        parts = {"gate": (rows, total), "up": (rows, total)}
        self.gate_up_proj = MergedColumnLinear(hidden_size, parts, bias=False, gemm=gemm)
        self.act = act
        self.down_proj = PartialSumLinear(rows, hidden_size, gemm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.activated(x, self.act))


class SparseMoE(nn.Module):
    """Router, routed experts, the shared expert (gated or not); one all-reduce with tensor parallelism.

    ``expert_rows`` / ``shared_rows``: this rank's rows of the experts' and of the shared expert's
    intermediate dimension (models/sharding.py)."""

    def __init__(
        self,
        hidden_size: int,
        spec: MoESpec,
        expert_rows: range,
        shared_rows: range,
        kernel: MoEFn,
        act: SiluAndMul,
        tp: TensorParallel,
        gemm: Gemm = F.linear,
    ) -> None:
        super().__init__()
        self.gemm = gemm
        router = GroupedTopKRouter if spec.router == "grouped_topk" else Router
        self.gate = router(hidden_size, spec, gemm)
        self.experts = Experts(hidden_size, spec, expert_rows, kernel)
        self.shared_expert: SharedExpert | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if spec.shared_expert_intermediate_size:
            total = spec.shared_expert_intermediate_size
            self.shared_expert = SharedExpert(hidden_size, shared_rows, total, act, gemm)
            if spec.shared_expert_gate:
                self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)  # its weight, multiplied by gemm
        self.reduce = tp.all_reduce if tp.size > 1 else _unreduced  # one rank: no collective
        self.weights_on_input = spec.weights_on_input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        weights, ids = self.gate(x)  # [T, K] each
        if self.weights_on_input:  # top 1: the token scaled going in, its expert's output taken whole
            y = self.experts((x * weights).to(x.dtype), torch.ones_like(weights), ids)
        else:
            y = self.experts(x, weights, ids)
        if self.shared_expert_gate is not None:
            # As transformers: the routed sum + sigmoid(gate) * shared, in the model's dtype.
            y = y + torch.sigmoid(self.gemm(x, self.shared_expert_gate.weight)) * self.shared_expert(x)
        elif self.shared_expert is not None:
            y = y + self.shared_expert(x)
        return self.reduce(y)


def _unreduced(y: torch.Tensor) -> torch.Tensor:
    return y
