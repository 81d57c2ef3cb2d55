"""The mixture-of-experts MLP of Qwen3-MoE, Qwen2-MoE and Mixtral: a router picks each token's top-k
experts, their SwiGLU MLPs run on the tokens routed to them, and the outputs are summed with the
routing weights.

- ``Router``: the gate linear [E, H], a float32 softmax over the experts, the top k, renormalised over
  those k when ``MoESpec.renormalize`` (``norm_topk_prob``; Mixtral always). This is transformers' order
  of operations for all three: Mixtral's "softmax over the top-k logits" is computed as the softmax
  over every expert renormalised over the top k (the same value, rounded as transformers rounds it).
- ``Experts``: every expert's gate and up rows stacked, ``w13`` [E, 2I, H] (gate rows first), and down,
  ``w2`` [E, H, I]: transformers' stacked layout and the fused kernel's. Which implementation runs is
  the ``MoEFn`` given at construction (``LayerKernels.moe``): ``moe_experts`` here, the reference, or
  ``nanostream.kernels.fused_moe.fused_moe`` (sorted tokens, grouped GEMMs).
- ``SparseMoE``: router -> experts (+ Qwen2-MoE's shared expert, scaled by a sigmoid gate) -> one
  all-reduce with tensor parallelism.

With tensor parallelism every rank holds every expert's slice of the intermediate dimension (rows of
gate and up, columns of down), and of the shared expert's; router and shared-expert gate are whole on
every rank. Each rank's output is a partial sum (the sigmoid gate is per token, so it scales the parts
alike) and the block's one all-reduce adds them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanostream.distributed.group import SINGLE, TensorParallel
from nanostream.layers.activation import SiluAndMul
from nanostream.layers.linear import MergedColumnLinear, RowParallelLinear, TensorSlice

MoEFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, K], topk_ids [T, K]) -> [T, H]``: the routed
experts' outputs summed with their weights (a partial sum with tensor parallelism): ``moe_experts`` or
``nanostream.kernels.fused_moe.fused_moe``."""


@dataclass(frozen=True)
class MoESpec:
    """The MoE layers of a decoder, read from its config (models/architectures.py)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of each expert
    renormalize: bool  # the top-k weights divided by their sum
    float32_weights: bool  # Mixtral: the routing weights and the top-k sum stay float32 (transformers' router)
    layers: tuple[int, ...]  # the layers whose MLP is this block; the others are dense
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert; 0: none


# ---- the torch reference ------------------------------------------------------------------------


@functools.cache
def _grouped_mm_runs(device_type: str, dtype: torch.dtype) -> bool:
    # torch.nn.functional.grouped_mm (torch >= 2.10): any dtype on the CPU, bf16 on CUDA (SM80+).
    if not hasattr(F, "grouped_mm"):
        return False
    if device_type == "cpu":
        return True
    return device_type == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability() >= (8, 0)


def _grouped_linear(a: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows ``ends[e-1]:ends[e]`` of a [S, K] times expert e's ``w[e]`` [N, K] transposed: [S, N]."""
    if _grouped_mm_runs(a.device.type, a.dtype):
        return F.grouped_mm(a, w.transpose(1, 2), offs=ends)  # no host sync: capturable in a CUDA graph
    if a.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"the torch MoE path cannot run in a CUDA graph here (no grouped_mm for {a.dtype}): use "
            "attention_backend='triton' (the fused MoE kernel), dtype='bfloat16', or enforce_eager=True"
        )
    out = a.new_zeros(a.shape[0], w.shape[1])
    start = 0
    for e, end in enumerate(ends.tolist()):  # one host sync
        if end > start:
            torch.mm(a[start:end], w[e].T, out=out[start:end])
        start = end
    return out


def moe_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """The reference ``MoEFn``, transformers' computation (its default ``grouped_mm`` experts): the T*K
    (token, expert) pairs sorted by expert, one grouped GEMM for gate and up, SiLU-and-mul, one for
    down, each pair scaled by its weight, then the k outputs of a token summed in top-k order.

    The product with the weights takes their dtype (float32 for Mixtral, as transformers), and so does
    the sum; the result is cast to x's dtype."""
    num_tokens, k = topk_ids.shape
    num_experts = w13.shape[0]
    sorted_ids, perm = torch.sort(topk_ids.reshape(-1))  # [T*K]: the pairs, by expert
    rows = x[perm // k]  # [T*K, H]
    ends = torch.searchsorted(sorted_ids, torch.arange(num_experts, device=x.device), right=True).to(torch.int32)
    gate, up = _grouped_linear(rows, w13, ends).chunk(2, dim=-1)  # [T*K, I] each
    out = _grouped_linear(F.silu(gate) * up, w2, ends)  # [T*K, H]
    out = out * topk_weights.reshape(-1)[perm, None]
    unsorted = torch.empty_like(out)
    unsorted[perm] = out  # back to (token, k) order
    return unsorted.view(num_tokens, k, -1).sum(dim=1).to(x.dtype)


# ---- the modules ---------------------------------------------------------------------------------


class Router(nn.Module):
    """Gate linear -> float32 softmax over the experts -> top k (-> renormalised): (weights, expert ids)."""

    def __init__(self, hidden_size: int, spec: MoESpec) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(spec.num_experts, hidden_size))
        self.top_k, self.renormalize, self.float32_weights = spec.top_k, spec.renormalize, spec.float32_weights

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [T, H] -> weights [T, K] (float32, or x's dtype as transformers' Qwen routers), ids [T, K] int64
        logits = F.linear(x, self.weight)  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.float32_weights else weights.to(logits.dtype)), ids


class Experts(nn.Module):
    """Every expert's SwiGLU MLP over ``rows`` of its intermediate dimension (all of them at one rank).

    Checkpoint tensors arrive per expert (``load_shard(param, tensor, "gate.3")``: expert 3's gate_proj,
    [I, H]) or stacked as transformers' ``save_pretrained(save_original_format=False)`` writes them
    (``"gate_up"``: [E, 2I, H]; ``"down"``: [E, H, I]); either way only this rank's rows are read."""

    def __init__(self, num_experts: int, hidden_size: int, rows: range, total: int, kernel: MoEFn) -> None:
        super().__init__()
        self.rows, self.total, self.kernel = rows, total, kernel
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * len(rows), hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, len(rows)))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.w13, self.w2, topk_weights, topk_ids)  # [T, H]

    def shards(self, param: nn.Parameter) -> list[str]:
        """The checkpoint parts ``param`` is made of, each to be loaded once."""
        parts = ("gate", "up") if param is self.w13 else ("down",)
        return [f"{part}.{e}" for e in range(self.w13.shape[0]) for part in parts]

    def load_shard(self, param: nn.Parameter, loaded: TensorSlice, shard: str) -> list[str]:
        """Copy this rank's part of ``loaded`` (``shard``: "gate.E", "up.E", "down.E", "gate_up" or "down");
        the parts of ``shards`` it filled."""
        a, b, n, total = self.rows.start, self.rows.stop, len(self.rows), self.total
        shape = tuple(loaded.get_shape() if hasattr(loaded, "get_shape") else loaded.shape)
        num_experts, hidden = self.w13.shape[0], self.w13.shape[2]
        if shard == "gate_up":
            self._check(shard, shape, (num_experts, 2 * total, hidden))
            param.data[:, :n].copy_(loaded[:, a:b])
            param.data[:, n:].copy_(loaded[:, total + a : total + b])
            return self.shards(param)
        if shard == "down":
            self._check(shard, shape, (num_experts, hidden, total))
            param.data.copy_(loaded[:, :, a:b])
            return self.shards(param)
        part, expert = shard.split(".")
        e = int(expert)
        if e >= num_experts:
            raise ValueError(f"expert {e} in the checkpoint, but the config has {num_experts} experts")
        if part == "down":
            self._check(shard, shape, (hidden, total))
            param.data[e].copy_(loaded[:, a:b])
        else:
            self._check(shard, shape, (total, hidden))
            offset = 0 if part == "gate" else n
            param.data[e, offset : offset + n].copy_(loaded[a:b])
        return [shard]

    @staticmethod
    def _check(shard: str, shape: tuple[int, ...], expected: tuple[int, ...]) -> None:
        if shape != expected:
            raise ValueError(f"experts' {shard} tensor of shape {shape}, expected {expected}")


class PartialSumLinear(RowParallelLinear):
    """``columns`` of a projection's input features (read from the checkpoint as ``RowParallelLinear``
    reads them), left unreduced: this rank's part of the sum, which the MoE block's all-reduce adds."""

    def __init__(self, columns: range, out_features: int) -> None:
        super().__init__(columns, out_features, bias=False, tp=SINGLE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)  # [T, in / size] -> [T, out]


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: a SwiGLU MLP over ``rows`` of its intermediate dimension, every token."""

    def __init__(self, hidden_size: int, rows: range, total: int, act: SiluAndMul) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnLinear(hidden_size, {"gate": (rows, total), "up": (rows, total)}, bias=False)
        self.act = act
        self.down_proj = PartialSumLinear(rows, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class SparseMoE(nn.Module):
    """Router, routed experts, Qwen2-MoE's gated shared expert; one all-reduce with tensor parallelism.

    ``expert_rows`` / ``shared_rows``: this rank's rows of the experts' and of the shared expert's
    intermediate dimension (distributed/sharding.py)."""

    def __init__(
        self,
        hidden_size: int,
        spec: MoESpec,
        expert_rows: range,
        shared_rows: range,
        kernel: MoEFn,
        act: SiluAndMul,
        tp: TensorParallel,
    ) -> None:
        super().__init__()
        self.gate = Router(hidden_size, spec)
        self.experts = Experts(spec.num_experts, hidden_size, expert_rows, spec.intermediate_size, kernel)
        self.shared_expert: SharedExpert | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if spec.shared_expert_intermediate_size:
            total = spec.shared_expert_intermediate_size
            self.shared_expert = SharedExpert(hidden_size, shared_rows, total, act)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        self.reduce = tp.all_reduce if tp.size > 1 else _unreduced  # one rank: no collective

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        weights, ids = self.gate(x)  # [T, K] each
        y = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            # As transformers: the routed sum + sigmoid(gate) * shared, in the model's dtype.
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.reduce(y)


def _unreduced(y: torch.Tensor) -> torch.Tensor:
    return y
