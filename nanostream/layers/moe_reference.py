"""The torch reference of the routed experts (a ``MoEFn``, layers/moe_spec.py): what the CPU runs, and what
kernels/fused_moe.py is tested against.

transformers' computation (its default ``grouped_mm`` experts): the (token, expert) pairs sorted by expert,
one grouped GEMM for gate and up, the activation, one for down, each pair scaled by its routing weight, and
each token's k outputs summed.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from nanostream.kernels.expert_ops import Activation, gated_activation, ordered_topk_sum
from nanostream.layers.linear import Gemm


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
    act = gated_activation(activation, gate, up)  # [T*K, I]
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
