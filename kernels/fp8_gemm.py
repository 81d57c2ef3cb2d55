"""FP8 GEMMs with scaled operands, for the FP8 checkpoints' linear layers (issue 33): activations quantized
per token group as they enter, weights stored as the checkpoint stores them.

- ``quantize_per_token_group``: x [M, K] -> e4m3 values and one float32 scale per ``group`` columns of a
  row (amax / 448), so that x ≈ q × scale. A group of K is one scale per token (compressed-tensors'
  dynamic per-token activations); 128 matches block-wise checkpoints' weight blocks along K.
- ``fp8_scaled_matmul``: y [M, N] = (a_q × a_scale) @ (b_q × b_scale)ᵀ with b [N, K] as a checkpoint stores
  it and b's scale per (block_n rows, block_k columns): a block-wise checkpoint's ``weight_scale_inv``
  ([ceil(N/128), ceil(K/128)]), a per-channel one's ``weight_scale`` ([N, 1], block (1, K)) or a per-tensor
  one ([1, 1], block (N, K)). Each program owns a BLOCK_M x BLOCK_N tile and walks K in steps of one scale
  group (block-wise: 128), each step's float32 product times its two scales; with one group along K (per
  channel, per tensor) the scales multiply the sum once. The activations' groups along K must be the
  weight's: quantize with ``group = block_k``.

layers/fp8_linear.py calls them for the linear layers that keep an FP8 checkpoint's weights. Under Triton's
interpreter they run on the CPU (tests/test_fp8_gemm.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value


@triton.jit
def _quantize_kernel(
    x_ptr, q_ptr, s_ptr, stride_x, stride_q, stride_sm, stride_sg, K, GROUP: tl.constexpr, BLOCK: tl.constexpr
):
    # One program per (row, group): scale = amax / 448 (at least a tiny floor: an all-zero group gives zeros).
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, BLOCK)
    mask = (cols < K) & (tl.arange(0, BLOCK) < GROUP)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 0) / 448.0, 1e-12)
    q = tl.clamp(x / scale, -448.0, 448.0)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + g * stride_sg, scale)


def quantize_per_token_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows contiguous) -> (q [M, K] float8_e4m3fn, scale [M, ceil(K / group)] float32).

    The scales are column-major (strides (1, M)), as torch's block-scaled ``scaled_mm`` reads them."""
    assert x.dim() == 2 and x.stride(1) == 1, (x.shape, x.stride())
    assert group >= 1, group
    m, k = x.shape
    groups = triton.cdiv(k, group)
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    scale = torch.empty_strided((m, groups), (1, m), dtype=torch.float32, device=x.device)
    if m and k:
        _quantize_kernel[(m, groups)](
            x, q, scale, x.stride(0), q.stride(0), scale.stride(0), scale.stride(1), k,
            GROUP=group, BLOCK=triton.next_power_of_2(group),
        )  # fmt: skip
    return q, scale


@triton.jit
def _scaled_matmul_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, out_ptr,
    M, N, K,
    stride_am, stride_asm, stride_asg, stride_bn, stride_bsn, stride_om,
    BLOCK_N_SCALE: tl.constexpr, ONE_GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    # One flat loop over K (so that Triton pipelines its loads): with scale groups along K, BLOCK_K is the
    # group's width and each step's product takes its two scales; with one group (per-channel or per-tensor
    # weights, per-token activations) the scales multiply the sum once at the end.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < M, cols < N
    b_scale_rows = cols // BLOCK_N_SCALE  # each output column's row of b's scales
    a_rows = a_ptr + rows[:, None].to(tl.int64) * stride_am
    b_rows = b_ptr + cols[:, None].to(tl.int64) * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(a_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_rows + ks[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        if ONE_GROUP:
            acc = tl.dot(a, tl.trans(b), acc)
        else:
            g = k0 // BLOCK_K
            a_s = tl.load(as_ptr + rows * stride_asm + g * stride_asg, mask=row_mask, other=0.0)
            b_s = tl.load(bs_ptr + b_scale_rows * stride_bsn + g, mask=col_mask, other=0.0)
            acc += tl.dot(a, tl.trans(b)) * a_s[:, None] * b_s[None, :]
    if ONE_GROUP:
        a_s = tl.load(as_ptr + rows * stride_asm, mask=row_mask, other=0.0)
        b_s = tl.load(bs_ptr + b_scale_rows * stride_bsn, mask=col_mask, other=0.0)
        acc = acc * a_s[:, None] * b_s[None, :]
    out = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


Config = tuple[int, int, int, int, int]
"""(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the GEMM's tile."""


def default_config(m: int, n: int) -> Config:
    """The tile for ``m`` rows: narrow N tiles for the few-token steps (enough programs to stream the weight
    from every SM), wide ones where the step is compute-bound."""
    if m <= 16:
        return (16, 32 if n <= 8192 else 64, 128, 4, 4)
    if m <= 64:
        return (64, 64, 128, 4, 4)
    return (128, 128, 128, 8, 3)


def fp8_scaled_matmul(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    block: tuple[int, int],
    out_dtype: torch.dtype,
    config: Config | None = None,
) -> torch.Tensor:
    """(a × a_scale) @ (b × b_scale)ᵀ: [M, N] in ``out_dtype``.

    a [M, K] and b [N, K] float8_e4m3fn, rows contiguous; ``block`` = (block_n, block_k): b's scale covers
    block_n rows and block_k columns, ``b_scale`` [ceil(N / block_n), ceil(K / block_k)] float32; a's scale
    covers block_k columns of a row, ``a_scale`` [M, ceil(K / block_k)] (``quantize_per_token_group(x,
    block_k)``). block_k is K or more (one group: per-channel and per-tensor weights), or a power of two from
    16 (the block-wise checkpoints' 128). ``config`` overrides the tile (benchmarks).
    """
    m, k = a.shape
    n = b.shape[0]
    block_n, block_k = block
    one_group = block_k >= k
    assert a.dtype == b.dtype == FP8 and a.stride(1) == 1 and b.stride(1) == 1, (a.dtype, b.dtype)
    assert b.shape[1] == k, (a.shape, b.shape)
    assert one_group or (block_k >= 16 and block_k & (block_k - 1) == 0), f"block_k {block_k}: K or a power of two"
    assert a_scale.dtype == b_scale.dtype == torch.float32, (a_scale.dtype, b_scale.dtype)
    assert a_scale.shape == (m, triton.cdiv(k, block_k)), (a_scale.shape, m, k, block_k)
    assert b_scale.shape == (triton.cdiv(n, block_n), triton.cdiv(k, block_k)), (b_scale.shape, n, k, block)
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if not (m and n):
        return out
    block_m_, block_n_, block_k_, warps, stages = config or default_config(m, n)
    block_k_ = block_k_ if one_group else block_k  # a step never crosses a scale group
    block_n_ = min(block_n_, max(16, triton.next_power_of_2(n)))
    block_m_ = min(block_m_, max(16, triton.next_power_of_2(m)))
    grid = (triton.cdiv(m, block_m_), triton.cdiv(n, block_n_))
    _scaled_matmul_kernel[grid](
        a, a_scale, b, b_scale, out,
        m, n, k,
        a.stride(0), a_scale.stride(0), a_scale.stride(1), b.stride(0), b_scale.stride(0), out.stride(0),
        BLOCK_N_SCALE=block_n, ONE_GROUP=one_group,
        BLOCK_M=block_m_, BLOCK_N=block_n_, BLOCK_K=block_k_, STAGES=stages,
        num_warps=warps,
    )  # fmt: skip
    return out
