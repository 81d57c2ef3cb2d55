"""The batch-invariant mode's GEMMs (``EngineConfig.batch_invariant``): a token's row of every matmul is the
same bits whatever else shares its step, so a request's tokens do not depend on the batch.

- ``invariant_linear`` is the linear layers' and the LM head's GEMM in the mode (``LayerKernels.linear``):
  on CUDA the fixed-tile Triton matmul (nanostream/kernels/invariant_matmul.py); on the CPU ``F.linear`` over fixed
  chunks of ``CPU_ROWS`` rows, the last one padded, since the CPU BLAS picks its blocking by the row count
  (measured: float32 rows of ``F.linear`` change with M; at a fixed M they do not change with the other
  rows' values nor with the row's place).
- ``invariant_moe``: the routed experts with those GEMMs, each token's top-k outputs added in top-k order.

What else the mode changes is chosen where the layers are built: the attention backends split nothing by
the batch (layers/attention_backend.py, layers/triton_attention.py), FP8 weights are dequantized on load.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

CPU_ROWS = 32
"""Rows per ``F.linear`` call on the CPU in the mode: every call the same shape."""


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` whose rows do not depend on how many rows x has. x: [..., K]."""
    if x.is_cuda:
        from nanostream.kernels.invariant_matmul import invariant_matmul

        return invariant_matmul(x, weight, bias)
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    if not m:
        return F.linear(x, weight, bias)
    if m % CPU_ROWS:
        rows = F.pad(rows, (0, 0, 0, -m % CPU_ROWS))
    out = torch.cat([F.linear(chunk, weight, bias) for chunk in rows.split(CPU_ROWS)])
    return out[:m].reshape(*lead, weight.shape[0])


@functools.cache
def invariant_moe(on_gpu_kernels: bool):
    """The ``MoEFn`` of the mode: the fused MoE kernel with one tile for every token count (where the layers run
    Triton), else the torch reference over ``invariant_linear``; the top-k sum in order either way."""
    if on_gpu_kernels:
        from nanostream.kernels.fused_moe import fused_moe

        return functools.partial(fused_moe, invariant=True)
    from nanostream.layers.moe_reference import moe_experts

    return functools.partial(moe_experts, linear=invariant_linear)
