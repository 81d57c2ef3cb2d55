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
- Split K, for the few-token steps: there an [N, K] weight's N tiles alone can leave SMs without a program
  (down_proj, N = 4,096: 128 tiles for an H200's 132 SMs), and the step is the weight's streaming. The grid's
  third dimension then splits each tile's K into contiguous ranges of whole steps; each split writes its share
  of y as a float32 partial, and a second kernel adds them up in split order (no atomics: bit-identical
  results run to run, CUDA graphs included), with the bias, in the output's dtype. ``default_config`` picks
  the split from the SM count; apps/fp8_gemm_sweep.py --split-k times the alternatives.

layers/fp8_linear.py calls them for the linear layers that keep an FP8 checkpoint's weights. Under Triton's
interpreter they run on the CPU (tests/test_fp8_gemm.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

# relative: apps load nanostream/kernels/ as a package of its own where nanostream cannot be imported
from ._device import num_sms, pdl_launch, wait_for_producer

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value


@triton.jit
def _quantize_kernel(
    x_ptr, q_ptr, s_ptr, M, K, stride_x, stride_q, stride_sm, stride_sg,
    GROUP: tl.constexpr, BLOCK: tl.constexpr, GROUPS: tl.constexpr,
):  # fmt: skip
    # One program per (row, GROUPS consecutive groups): a [GROUPS, BLOCK] tile, each group's scale its amax / 448
    # (at least a tiny floor: an all-zero group gives zeros). Rows from M on (the padding a caller asked for) are
    # zeros with the floor's scale.
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    within = tl.arange(0, BLOCK)
    cols = groups[:, None] * GROUP + within[None, :]
    mask = (within < GROUP)[None, :] & (cols < K)
    live = (within < GROUP)[None, :] & (cols < tl.where(row < M, K, 0))  # a padding row reads nothing
    x = tl.load(x_ptr + row * stride_x + cols, mask=live, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 1) / 448.0, 1e-12)
    q = tl.clamp(x / scale[:, None], -448.0, 448.0)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + groups * stride_sg, scale, mask=groups * GROUP < K)


QUANT_TILE = 2048  # elements a quantizer program takes (16 a thread): whole groups of a row, or one longer group


def quantize_per_token_group(x: torch.Tensor, group: int, pad_rows_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows contiguous) -> (q [M', K] float8_e4m3fn, scale [M', ceil(K / group)] float32), M' = M rounded
    up to a multiple of ``pad_rows_to``; the padding rows are zeros (cuBLASLt's block-scaled GEMM takes rows in
    16s).

    The scales are column-major (strides (1, M')), as torch's block-scaled ``scaled_mm`` reads them."""
    assert x.dim() == 2 and x.stride(1) == 1, (x.shape, x.stride())
    assert group >= 1 and pad_rows_to >= 1, (group, pad_rows_to)
    m, k = x.shape
    rows = -(-m // pad_rows_to) * pad_rows_to
    groups = triton.cdiv(k, group)
    q = torch.empty(rows, k, dtype=FP8, device=x.device)
    scale = torch.empty_strided((rows, groups), (1, rows), dtype=torch.float32, device=x.device)
    if rows and k:
        block = triton.next_power_of_2(group)
        per_program = max(1, min(QUANT_TILE // block, triton.next_power_of_2(groups)))
        _quantize_kernel[(rows, triton.cdiv(groups, per_program))](
            x, q, scale, m, k, x.stride(0), q.stride(0), scale.stride(0), scale.stride(1),
            GROUP=group, BLOCK=block, GROUPS=per_program, num_warps=8 if block * per_program > QUANT_TILE else 4,
        )  # fmt: skip
    return q, scale


@triton.jit
def _scaled_matmul_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_am, stride_asm, stride_asg, stride_bn, stride_bsn, stride_os, stride_om,
    BLOCK_N_SCALE: tl.constexpr, ONE_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    # Program (pid_m, pid_n, split) owns a BLOCK_M x BLOCK_N tile and one contiguous range of K's steps of
    # BLOCK_K columns: split s of S takes steps [s * steps // S, (s + 1) * steps // S), none when S > steps.
    # One flat loop over the range (so that Triton pipelines its loads): with scale groups along K, BLOCK_K is
    # the group's width, so no range cuts a group, and each step's product takes its two scales; with one group
    # (per-channel or per-tensor weights, per-token activations) the scales multiply the range's sum once.
    # Either way the tile is this split's share of y: with one split, y (+ bias) in out's dtype; with more, a
    # float32 partial [S, M, N] that _sum_splits_kernel adds up.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    steps = tl.cdiv(K, BLOCK_K)
    k_lo = split * steps // tl.num_programs(2) * BLOCK_K
    k_hi = (split + 1) * steps // tl.num_programs(2) * BLOCK_K
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < M, cols < N
    b_scale_rows = cols // BLOCK_N_SCALE  # each output column's row of b's scales
    a_rows = a_ptr + rows[:, None].to(tl.int64) * stride_am
    b_rows = b_ptr + cols[:, None].to(tl.int64) * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
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
    if HAS_BIAS:  # one split only: with more, the sum adds it
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + split.to(tl.int64) * stride_os + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _sum_splits_kernel(
    part_ptr, bias_ptr, out_ptr, M, N, num_splits, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_producer(PDL)
    # One program per (row, BLOCK columns): the partials [num_splits, M, N] added in split order, no atomics, so
    # that the same inputs give the same bits (a CUDA graph's replays too); then the bias and out's dtype.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(num_splits):
        acc += tl.load(part_ptr + (s * M + row) * N + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


class Config(NamedTuple):
    """The GEMM's tile and its split of K: ``split_k`` programs share each tile's K, each a contiguous range of
    whole scale groups (block-wise) or BLOCK_K steps (one group), their float32 partials summed by a second
    kernel. A 5-tuple without ``split_k`` is one split."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1


FEW_TOKENS = 16  # up to these many rows the tile is 16 high, the weight's streaming the cost, and K may split
PROGRAMS_PER_SM = 3  # what a split K aims at: ~3 programs resident on each SM keep enough weight loads in flight
MIN_STEPS_PER_SPLIT = 4  # a split walks at least 4 steps of 128 columns: its partial's write-back stays small
FEW_TOKENS_64 = 64  # up to these many rows one 64-row tile, K split until ~3/4 of the SMs have a program
SPLIT_FILL_64 = 0.75  # the share of the SMs a 17-64-token split aims to give a program (the sweep's best)
SUM_BLOCK = 512  # columns per program of the partials' sum


def default_config(m: int, n: int, k: int, sms: int) -> Config:
    """The tile for ``m`` rows of an [``n``, ``k``] weight on a GPU of ``sms`` SMs (``num_sms(device)``).

    Few tokens: tiles of 16 x 64, and where those alone leave the SMs short of programs (fewer than 2 per SM) K
    splits until ~3 per SM stream the weight, each split at least 4 steps of 128 columns (the best of
    ``apps/fp8_gemm_sweep.py --split-k`` at 1 and 4 tokens for each of Qwen3-8B's projections on an H200).
    17 to 64 tokens: one tile of 64 x 128 down the rows, K split until ~3/4 of the SMs have a program (the
    best of apps/fp8_gemm_sweep.py's mid-M tiles at 64 tokens for each projection; there the four
    projections take 0.87x the time of cuBLASLt's block-scaled GEMM, whose 128-row tiles and single split
    leave o_proj and down_proj 32 programs). More tokens: wide tiles, one split (the step is compute-bound;
    fp8_linear gives those to cuBLASLt). Pure Python, a few operations: it runs on every call.

    >>> default_config(1, 4096, 12288, 132)  # Qwen3-8B's down_proj at decode on an H200: 64 tiles x 6 splits
    Config(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4, split_k=6)
    """
    if m <= FEW_TOKENS:
        tiles = triton.cdiv(m, 16) * triton.cdiv(n, 64)
        splits = 1
        if tiles < 2 * sms:
            splits = max(1, min(round(PROGRAMS_PER_SM * sms / tiles), triton.cdiv(k, 128) // MIN_STEPS_PER_SPLIT))
        return Config(16, 64, 128, 4, 4, splits)
    if m <= FEW_TOKENS_64:
        tiles = triton.cdiv(m, 64) * triton.cdiv(n, 128)
        splits = max(1, min(round(SPLIT_FILL_64 * sms / tiles), triton.cdiv(k, 128) // MIN_STEPS_PER_SPLIT))
        return Config(64, 128, 128, 4, 4, splits)
    return Config(128, 128, 128, 8, 3)


def fp8_scaled_matmul(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    block: tuple[int, int],
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    config: Config | tuple[int, ...] | None = None,
) -> torch.Tensor:
    """(a × a_scale) @ (b × b_scale)ᵀ + bias: [M, N] in ``out_dtype``.

    a [M, K] and b [N, K] float8_e4m3fn, rows contiguous; ``block`` = (block_n, block_k): b's scale covers
    block_n rows and block_k columns, ``b_scale`` [ceil(N / block_n), ceil(K / block_k)] float32; a's scale
    covers block_k columns of a row, ``a_scale`` [M, ceil(K / block_k)] (``quantize_per_token_group(x,
    block_k)``). block_k is K or more (one group: per-channel and per-tensor weights), or a power of two from
    16 (the block-wise checkpoints' 128). ``bias`` [N] (any float dtype) is added in float32. ``config``
    overrides ``default_config`` (benchmarks): a ``Config`` or its fields as a tuple. Bit-identical from call to
    call whatever the split, and CUDA-graph capturable (a split's workspace comes from the caching allocator).

        xq, xs = quantize_per_token_group(x, 128)  # x [M, K] bfloat16
        y = fp8_scaled_matmul(xq, xs, w, w_scale, (128, 128), torch.bfloat16, config=(16, 32, 128, 4, 4, 3))
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
    assert bias is None or (bias.shape == (n,) and bias.stride(0) == 1 and bias.device == a.device), bias
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if not (m and n):
        return out
    cfg = Config(*config) if config else default_config(m, n, k, num_sms(a.device))
    assert cfg.split_k >= 1, cfg
    block_k_ = cfg.block_k if one_group else block_k  # a step is a scale group: no split cuts one
    block_n_ = min(cfg.block_n, max(16, triton.next_power_of_2(n)))
    block_m_ = min(cfg.block_m, max(16, triton.next_power_of_2(m)))
    splits = cfg.split_k
    # one split writes y; more write float32 partials [splits, M, N], summed below
    part = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=a.device)
    stride_os, stride_om = (0, out.stride(0)) if splits == 1 else part.stride()[:2]
    grid = (triton.cdiv(m, block_m_), triton.cdiv(n, block_n_), splits)
    _scaled_matmul_kernel[grid](
        a, a_scale, b, b_scale, out if bias is None else bias, part,
        m, n, k,
        a.stride(0), a_scale.stride(0), a_scale.stride(1), b.stride(0), b_scale.stride(0), stride_os, stride_om,
        BLOCK_N_SCALE=block_n, ONE_GROUP=one_group, HAS_BIAS=bias is not None and splits == 1,
        BLOCK_M=block_m_, BLOCK_N=block_n_, BLOCK_K=block_k_, STAGES=cfg.num_stages,
        num_warps=cfg.num_warps,
    )  # fmt: skip
    if splits > 1:
        sum_splits(part, bias, out)
    return out


def sum_splits(part: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out [M, N] = the float32 partials part [S, M, N] added in split order, + bias [N], in out's dtype."""
    splits, m, n = part.shape
    _sum_splits_kernel[(m, triton.cdiv(n, SUM_BLOCK))](
        part, out if bias is None else bias, out, m, n, splits, out.stride(0),
        HAS_BIAS=bias is not None, BLOCK=SUM_BLOCK, num_warps=4, **pdl_launch(part.device),
    )  # fmt: skip
