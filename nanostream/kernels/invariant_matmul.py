"""A matmul whose every output row is the same bits whatever the number of rows: the linear layers of the
batch-invariant mode (``EngineConfig.batch_invariant``) on CUDA.

cuBLAS picks its kernel, tile and split-K by the problem's shape, so a token's row of ``x @ W.T`` changes
in its last bits with the number of tokens in the step, and a near-tie between two logits can flip. Here
one tile per weight shape (chosen from N and K alone, never from M), no split of K: each output element
is the sum of its BLOCK_K-wide tile products in K order, accumulated in float32, then rounded once. A
row's value depends on its own inputs and the weight, not on where in the tile it sits nor on the rows
beside it. ``M`` is a runtime argument that Triton does not specialise (a batch of one would otherwise
compile a kernel of its own).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M", "stride_am", "stride_cm"])
def _matmul_kernel(
    a_ptr, b_ptr, bias_ptr, c_ptr, M, N, K, stride_am, stride_bn, stride_cm,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,  # float32 operands: "ieee", exact products, not TF32
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    # Program order in groups of GROUP_M row tiles, so that neighbouring programs share weight tiles in L2.
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % size_m
    pid_n = (pid % (GROUP_M * tiles_n)) // size_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < M, cols < N
    a_rows = a_ptr + rows[:, None].to(tl.int64) * stride_am
    b_rows = b_ptr + cols[:, None].to(tl.int64) * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):  # the tail tile's missing columns load as zeros: exact
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(a_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_rows + ks[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out = c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


Tile = tuple[int, int, int, int, int]
"""(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)."""


def tile_for(n: int, k: int, dtype: torch.dtype) -> Tile:
    """The one tile of an [N, K] weight in ``dtype``: a function of the weight alone. Narrower N tiles for
    narrow weights, so that a decode step's few rows still spread the weight over the GPU's SMs."""
    if dtype == torch.float32:
        return (32, 64, 32, 4, 3)
    return (64, 128 if n >= 16384 else 64, 64, 4, 4)


def invariant_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with rows that do not depend on how many there are.

    x [..., K] (unit stride along K after flattening the leading dims), weight [N, K] with unit-stride rows,
    bias [N] or None; all one dtype (float32, bfloat16 or float16). [..., N] in x's dtype::

        y = invariant_matmul(hidden, layer.weight, layer.bias)
    """
    lead, k = x.shape[:-1], x.shape[-1]
    n = weight.shape[0]
    assert weight.dim() == 2 and weight.shape[1] == k and weight.stride(1) == 1, (x.shape, weight.shape)
    assert x.dtype == weight.dtype and x.dtype in (torch.float32, torch.bfloat16, torch.float16), (
        x.dtype,
        weight.dtype,
    )
    assert bias is None or (bias.shape == (n,) and bias.is_contiguous()), None if bias is None else bias.shape
    a = x.reshape(-1, k)
    if a.stride(1) != 1:
        a = a.contiguous()
    m = a.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        block_m, block_n, block_k, warps, stages = tile_for(n, k, x.dtype)
        grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
        _matmul_kernel[grid](
            a, weight, weight if bias is None else bias, out, m, n, k, a.stride(0), weight.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, num_warps=warps, num_stages=stages,
        )  # fmt: skip
    return out.view(*lead, n)
