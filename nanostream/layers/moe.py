"""The mixture-of-experts MLP of Qwen3-MoE, Qwen2-MoE, Mixtral and gpt-oss: a router picks each token's
top-k experts, their gated MLPs run on the tokens routed to them, and the outputs are summed with the
routing weights.

- ``Router``: the gate linear [E, H], a float32 softmax over the experts, the top k, renormalised over
  those k when ``MoESpec.renormalize`` (``norm_topk_prob``; Mixtral always). This is transformers' order
  of operations for all three: Mixtral's "softmax over the top-k logits" is computed as the softmax
  over every expert renormalised over the top k (the same value, rounded as transformers rounds it).
  gpt-oss (``router_bias``, ``softmax_after_topk``): the linear has a bias, and the softmax is over the
  k largest logits, in their dtype, as transformers' ``GptOssTopKRouter`` computes it.
- ``Experts``: every expert's gate and up rows stacked, ``w13`` [E, 2I, H] (gate rows first), and down,
  ``w2`` [E, H, I]: transformers' stacked layout and the fused kernel's. gpt-oss's checkpoints (stacked
  [E, H, 2I] with gate and up interleaved, [E, I, H]) are de-interleaved and transposed into it at load;
  its biases (``expert_bias``) are ``w13_bias`` [E, 2I] and ``w2_bias`` [E, H], its activation the
  ``ClampedSwiGLU``. Which implementation runs is the ``MoEFn`` given at construction
  (``LayerKernels.moe``): ``moe_experts`` here, the reference, or
  ``nanostream.kernels.fused_moe.fused_moe`` (sorted tokens, grouped GEMMs).
- ``SparseMoE``: router -> experts (+ Qwen2-MoE's shared expert, scaled by a sigmoid gate) -> one
  all-reduce with tensor parallelism.

With tensor parallelism every rank holds every expert's slice of the intermediate dimension (rows of
gate and up and of their bias, columns of down), and of the shared expert's; router, shared-expert gate
and down's bias are whole on every rank. Each rank's output is a partial sum (the sigmoid gate is per
token, so it scales the parts alike) and the block's one all-reduce adds them; down's bias is added by
one rank alone, the one holding the first rows, so that the sum holds it once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from nanostream.distributed.group import SINGLE, TensorParallel
from nanostream.kernels.expert_ops import Activation, ClampedSwiGLU, ordered_topk_sum
from nanostream.layers.activation import SiluAndMul
from nanostream.layers.linear import Gemm, MergedColumnLinear, RowParallelLinear, TensorSlice


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
    """The MoE layers of a decoder, read from its config (models/architectures.py). The fields after
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
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: Activation = "silu",
    linear: Gemm | None = None,
) -> torch.Tensor:
    """The reference ``MoEFn``, transformers' computation (its default ``grouped_mm`` experts): the T*K
    (token, expert) pairs sorted by expert, one grouped GEMM for gate and up (+ the bias), the activation,
    one for down (+ the bias), each pair scaled by its weight, then the k outputs of a token summed in
    top-k order.

    The product with the weights takes their dtype (float32 for Mixtral, as transformers), and so does
    the sum; the result is cast to x's dtype. ``linear`` (the batch-invariant mode's): each expert's rows
    through it, one call per expert (a host sync), and the k outputs added in top-k order."""
    num_tokens, k = topk_ids.shape
    num_experts = w13.shape[0]
    sorted_ids, perm = torch.sort(topk_ids.reshape(-1))  # [T*K]: the pairs, by expert
    rows = x[perm // k]  # [T*K, H]
    ends = torch.searchsorted(sorted_ids, torch.arange(num_experts, device=x.device), right=True).to(torch.int32)
    grouped = _grouped_linear if linear is None else functools.partial(_per_expert, linear)
    gate_up = grouped(rows, w13, ends)  # [T*K, 2I]
    if w13_bias is not None:
        gate_up = gate_up + w13_bias[sorted_ids]
    gate, up = gate_up.chunk(2, dim=-1)  # [T*K, I] each
    act = F.silu(gate) * up if activation == "silu" else activation(gate, up)  # [T*K, I]
    out = grouped(act, w2, ends)  # [T*K, H]
    if w2_bias is not None:
        out = out + w2_bias[sorted_ids]
    out = out * topk_weights.reshape(-1)[perm, None]
    unsorted = torch.empty_like(out)
    unsorted[perm] = out  # back to (token, k) order
    if linear is not None:
        return ordered_topk_sum(unsorted.view(num_tokens, k, -1)).to(x.dtype)
    return unsorted.view(num_tokens, k, -1).sum(dim=1).to(x.dtype)


def _per_expert(linear: Gemm, a: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    # _grouped_linear's result, each expert's rows through ``linear``
    out, start = a.new_zeros(a.shape[0], w.shape[1]), 0
    for e, end in enumerate(ends.tolist()):
        if end > start:
            out[start:end] = linear(a[start:end], w[e])
        start = end
    return out


# ---- the modules ---------------------------------------------------------------------------------


class Router(nn.Module):
    """Gate linear (+ bias) -> float32 softmax over the experts -> top k (-> renormalised), or (gpt-oss) top k
    of the logits -> a softmax over them: (weights, expert ids)."""

    def __init__(self, hidden_size: int, spec: MoESpec, gemm: Gemm = F.linear) -> None:
        super().__init__()
        self.gemm = gemm
        self.weight = nn.Parameter(torch.empty(spec.num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(spec.num_experts)) if spec.router_bias else None
        self.top_k, self.renormalize, self.float32_weights = spec.top_k, spec.renormalize, spec.float32_weights
        self.softmax_after_topk = spec.softmax_after_topk

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [T, H] -> weights [T, K] (float32, or x's dtype as transformers' Qwen routers), ids [T, K] int64
        logits = self.gemm(x, self.weight, self.bias)  # [T, E]
        if self.softmax_after_topk:
            top, ids = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(top, dim=-1, dtype=top.dtype), ids
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.float32_weights else weights.to(logits.dtype)), ids


class Experts(nn.Module):
    """Every expert's gated MLP over ``rows`` of its intermediate dimension (all of them at one rank).

    Checkpoint tensors arrive per expert (``load_shard(param, tensor, "gate.3")``: expert 3's gate_proj,
    [I, H]) or stacked as transformers' ``save_pretrained`` writes them (``"gate_up"``: [E, 2I, H], or
    gpt-oss's [E, H, 2I] with gate and up interleaved; ``"down"``: [E, H, I], or gpt-oss's [E, I, H]; the
    biases ``"gate_up"`` of ``w13_bias``, [E, 2I] laid out as its weight's 2I, and ``"down"`` of
    ``w2_bias``, [E, H]); either way only this rank's rows are read.

    Down's bias is loaded on every rank but added only by the one holding the first rows: each rank's
    output is a partial sum that the block's all-reduce adds."""

    def __init__(self, hidden_size: int, spec: MoESpec, rows: range, kernel: MoEFn) -> None:
        super().__init__()
        num_experts = spec.num_experts
        self.rows, self.total, self.kernel, self.activation = rows, spec.intermediate_size, kernel, spec.activation
        self.transposed, self.interleaved = spec.transposed_experts, spec.interleaved_gate_up
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * len(rows), hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, len(rows)))
        self.w13_bias = nn.Parameter(torch.empty(num_experts, 2 * len(rows))) if spec.expert_bias else None
        self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden_size)) if spec.expert_bias else None
        self.adds_down_bias = rows.start == 0

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        w2_bias = self.w2_bias if self.adds_down_bias else None
        return self.kernel(
            x, self.w13, self.w2, topk_weights, topk_ids, w13_bias=self.w13_bias, w2_bias=w2_bias,
            activation=self.activation,
        )  # fmt: skip

    def shards(self, param: nn.Parameter) -> list[str]:
        """The checkpoint parts ``param`` is made of, each to be loaded once."""
        if param is self.w13_bias or param is self.w2_bias:
            return ["gate_up" if param is self.w13_bias else "down"]
        parts = ("gate", "up") if param is self.w13 else ("down",)
        return [f"{part}.{e}" for e in range(self.w13.shape[0]) for part in parts]

    def load_shard(self, param: nn.Parameter, loaded: TensorSlice, shard: str) -> list[str]:
        """Copy this rank's part of ``loaded`` (``shard``: "gate.E", "up.E", "down.E", "gate_up" or "down");
        the parts of ``shards`` it filled."""
        a, b, n, total = self.rows.start, self.rows.stop, len(self.rows), self.total
        shape = tuple(loaded.get_shape() if hasattr(loaded, "get_shape") else loaded.shape)
        num_experts, hidden = self.w13.shape[0], self.w13.shape[2]
        if param is self.w13_bias:
            self._check("gate_up bias", shape, (num_experts, 2 * total))
            gate, up = self._gate_and_up(loaded, dim=1)  # [E, n] each
            param.data[:, :n].copy_(gate)
            param.data[:, n:].copy_(up)
            return [shard]
        if param is self.w2_bias:
            self._check("down bias", shape, (num_experts, hidden))
            param.data.copy_(loaded[:])
            return [shard]
        if shard == "gate_up":
            self._check(
                shard, shape, (num_experts, hidden, 2 * total) if self.transposed else (num_experts, 2 * total, hidden)
            )
            gate, up = self._gate_and_up(loaded, dim=2 if self.transposed else 1)
            if self.transposed:  # [E, H, n] -> [E, n, H]
                gate, up = gate.transpose(1, 2), up.transpose(1, 2)
            param.data[:, :n].copy_(gate)
            param.data[:, n:].copy_(up)
            return self.shards(param)
        if shard == "down":
            self._check(shard, shape, (num_experts, total, hidden) if self.transposed else (num_experts, hidden, total))
            param.data.copy_(loaded[:, a:b].transpose(1, 2) if self.transposed else loaded[:, :, a:b])
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

    def _gate_and_up(self, loaded: TensorSlice, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's gate and up entries along ``dim`` of a stacked gate_up tensor (or its bias)."""
        a, b, total = self.rows.start, self.rows.stop, self.total
        lead = (slice(None),) * dim
        if self.interleaved:  # gate 0, up 0, gate 1, up 1, ...: this rank's 2n entries, read at once, then split
            both = loaded[(*lead, slice(2 * a, 2 * b))]
            return both[(*lead, slice(0, None, 2))], both[(*lead, slice(1, None, 2))]
        return loaded[(*lead, slice(a, b))], loaded[(*lead, slice(total + a, total + b))]

    @staticmethod
    def _check(shard: str, shape: tuple[int, ...], expected: tuple[int, ...]) -> None:
        if shape != expected:
            raise ValueError(f"experts' {shard} tensor of shape {shape}, expected {expected}")


class PartialSumLinear(RowParallelLinear):
    """``columns`` of a projection's input features (read from the checkpoint as ``RowParallelLinear``
    reads them), left unreduced: this rank's part of the sum, which the MoE block's all-reduce adds."""

    def __init__(self, columns: range, out_features: int, gemm: Gemm = F.linear) -> None:
        super().__init__(columns, out_features, bias=False, tp=SINGLE, gemm=gemm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)  # [T, in / size] -> [T, out]


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: a SwiGLU MLP over ``rows`` of its intermediate dimension, every token."""

    def __init__(self, hidden_size: int, rows: range, total: int, act: SiluAndMul, gemm: Gemm = F.linear) -> None:
        super().__init__()
        parts = {"gate": (rows, total), "up": (rows, total)}
        self.gate_up_proj = MergedColumnLinear(hidden_size, parts, bias=False, gemm=gemm)
        self.act = act
        self.down_proj = PartialSumLinear(rows, hidden_size, gemm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class SparseMoE(nn.Module):
    """Router, routed experts, Qwen2-MoE's gated shared expert; one all-reduce with tensor parallelism.

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
        self.gate = Router(hidden_size, spec, gemm)
        self.experts = Experts(hidden_size, spec, expert_rows, kernel)
        self.shared_expert: SharedExpert | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if spec.shared_expert_intermediate_size:
            total = spec.shared_expert_intermediate_size
            self.shared_expert = SharedExpert(hidden_size, shared_rows, total, act, gemm)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)  # its weight, multiplied by gemm
        self.reduce = tp.all_reduce if tp.size > 1 else _unreduced  # one rank: no collective

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        weights, ids = self.gate(x)  # [T, K] each
        y = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            # As transformers: the routed sum + sigmoid(gate) * shared, in the model's dtype.
            y = y + torch.sigmoid(self.gemm(x, self.shared_expert_gate.weight)) * self.shared_expert(x)
        return self.reduce(y)


def _unreduced(y: torch.Tensor) -> torch.Tensor:
    return y
