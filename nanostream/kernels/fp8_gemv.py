"""The FP8 weight's matmul for a few tokens (up to 4; the layers take it at decode of batch 1):
y [M, N] = x @ (w × w_scale)ᵀ with x in its own dtype (bf16 at decode), not quantized.

A step of a few tokens is the weight's streaming: each weight byte is read once and used M times, so the
tensor cores have nothing to do and the activation quantizer would be one more launch and one more rounding.
Here each program streams a BLOCK_N x (C x 128) slab of the e4m3 weight per step, widens it to float32 and
takes each row of x's dot with it on the CUDA cores, 16 columns (a lane's load) at a time: each lane keeps its
own sums, its dots times their group's scale, and the lanes' sums meet once, after the loop, not in shuffles
every step (Triton 3.6's sm90 loop at Qwen3-8B's 32 x 512 tile: 521 instructions a step against 569; the
four projections of Qwen3-8B 1-3% faster on an H100). With the tile inside one block row of the weight's
scales (BLOCK_N divides block_n), a step's scales are C numbers, not one an element. One group along K
(per-channel and per-tensor weights) multiplies each column once at the end. K splits as in
nanostream/kernels/fp8_gemm.py (float32 partials summed in split order, no atomics), so the result is the same
bits from call to call and a CUDA graph captures it.

An MLP's fused [gate | up] projection can end in its activation (``act``): a program's rows are pairs, gate
row j and up row I + j, and it stores act(gate) * up, rounded as the projection's output and norm_act's
kernel round (one launch and the [1, 2 I] round trip fewer). The same bits as the two kernels under Triton's
interpreter; compiled, the pairs' tile may multiply-add a row's group sums in another order (on an H100, a few
outputs of Qwen3-8B's gate_up_proj in its 64-row tiles differ in their last bit).

``gemv_config`` picks the tile and the split; apps/fp8_gemm_sweep.py --gemv times the alternatives.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._device import let_dependents_launch, num_sms, pdl
from .fp8_gemm import FP8, sum_splits
from .norm_act import act_and_mul, gated_act

MAX_ROWS = 4  # up to these many tokens the weight-streaming kernel runs (its rows unrolled)
LANE_BYTES = 16  # a lane's load of e4m3 weights: the columns of its own dot
GROUP = 128  # the columns a step's scale covers (block-wise checkpoints' 128); per-row weights use it as the tile


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_os, stride_om,
    BLOCK_N_SCALE: tl.constexpr, ONE_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr, C: tl.constexpr, G: tl.constexpr, V: tl.constexpr, STAGES: tl.constexpr,
    PDL: tl.constexpr, GATED: tl.constexpr, GELU_TANH: tl.constexpr, EVEN: tl.constexpr,
):  # fmt: skip
    # Program (pid_n, split): BLOCK_N rows of the weight over split s's contiguous range of K's steps of C * G
    # columns; acc [BLOCK_N, ROWS]: each row of x's share of y, float32. GATED: the weight is [gate | up] (2 N
    # rows), the tile's rows in pairs (gate row j, up row N + j) and y [M, N] = act(gate) * up.
    let_dependents_launch(PDL)  # launched in order; the small kernel after it may launch now
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    steps = tl.cdiv(K, C * G)
    k_lo = split * steps // tl.num_programs(1) * (C * G)
    k_hi = (split + 1) * steps // tl.num_programs(1) * (C * G)
    tile = tl.arange(0, BLOCK_N)
    if GATED:
        cols = pid_n * (BLOCK_N // 2) + tile // 2  # y's column of each of the tile's rows
        w_row = cols + (tile % 2) * N
    else:
        cols = pid_n * BLOCK_N + tile
        w_row = cols
    col_mask = cols < N
    rows = tl.arange(0, ROWS)
    ks = tl.arange(0, C)[:, None] * G + tl.arange(0, G)[None, :]  # [C, G]: a step's columns
    w_rows = w_ptr + w_row[:, None, None].to(tl.int64) * stride_wn
    # The tile's row of scales (one block row: BLOCK_N, or a pair's half, divides the blocks' rows); GATED: two
    s_row = s_ptr + (pid_n * BLOCK_N // BLOCK_N_SCALE) * stride_sn
    if GATED:
        s_row = s_ptr + (pid_n * (BLOCK_N // 2) // BLOCK_N_SCALE) * stride_sn
        s_up_row = s_ptr + ((N + pid_n * (BLOCK_N // 2)) // BLOCK_N_SCALE) * stride_sn
    # acc [BLOCK_N, C, G / V, ROWS]: each lane's sums (its V columns' dots, scaled) for each row of x, float32
    acc = tl.zeros([BLOCK_N, C, G // V, ROWS], tl.float32)
    for k0 in tl.range(k_lo, k_hi, C * G, num_stages=STAGES):
        k_mask = (k0 + ks) < K
        if EVEN:  # whole tiles and steps: the loads unmasked (no predicate a vector to compute)
            w = tl.load(w_rows + (k0 + ks)[None, :, :])
        else:
            w = tl.load(w_rows + (k0 + ks)[None, :, :], mask=col_mask[:, None, None] & k_mask[None, :, :], other=0.0)
        # [BLOCK_N, C, G / V, V]: V = 16 contiguous columns, a lane's load, so that each lane's dot over them
        # needs no other lane; the lanes' sums stay apart until after the loop
        w = tl.reshape(w.to(tl.float32), [BLOCK_N, C, G // V, V])
        if not ONE_GROUP:  # the step's C scales ([1, C, 1]; GATED: [BLOCK_N, C, 1], the gate's or the up's a row)
            groups = k0 // G + tl.arange(0, C)
            s = tl.load(s_row + groups, mask=groups * G < K, other=0.0)[None, :, None]
            if GATED:
                s_up = tl.load(s_up_row + groups, mask=groups * G < K, other=0.0)[None, :, None]
                s = tl.where((tile % 2 == 0)[:, None, None], s, s_up)
        for r in tl.static_range(ROWS):
            if EVEN and r == 0:  # row 0 always there
                x = tl.load(x_ptr + k0 + ks).to(tl.float32)
            else:  # (the mask a tensor: the interpreter takes no scalar mask)
                x_mask = k_mask & (tl.full([C, G], r, tl.int32) < M)
                x = tl.load(x_ptr + r * stride_xm + k0 + ks, mask=x_mask, other=0.0).to(tl.float32)
            part = tl.sum(w * tl.reshape(x, [C, G // V, V])[None, :, :, :], 3)  # [BLOCK_N, C, G / V]
            if not ONE_GROUP:
                part = part * s
            if ROWS == 1:  # (a constexpr branch)
                acc += part[:, :, :, None]
            else:
                acc = tl.where(rows[None, None, None, :] == r, acc + part[:, :, :, None], acc)
    acc = tl.sum(tl.sum(acc, 2), 1)  # [BLOCK_N, ROWS]: the lanes' sums met
    if ONE_GROUP:  # one scale a row (per-channel, or per-tensor spread on the rows)
        acc = acc * tl.load(s_ptr + (w_row // BLOCK_N_SCALE) * stride_sn, mask=col_mask, other=0.0)[:, None]
    if HAS_BIAS:  # one split only: with more, the sum adds it
        acc += tl.load(bias_ptr + w_row, mask=col_mask, other=0.0).to(tl.float32)[:, None]
    dtype = out_ptr.dtype.element_ty
    if GATED:  # each pair's two rows apart, each rounded as a stored projection would be, then act(gate) * up
        gate, up = tl.split(tl.permute(tl.reshape(acc, [BLOCK_N // 2, 2, ROWS]), [0, 2, 1]))
        y = gated_act(gate.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32), dtype, GELU_TANH)
        out_cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        out = out_ptr + rows[None, :].to(tl.int64) * stride_om + out_cols[:, None]
        tl.store(out, y, mask=(out_cols < N)[:, None] & (rows < M)[None, :])
    else:
        out = out_ptr + split.to(tl.int64) * stride_os + rows[None, :].to(tl.int64) * stride_om + cols[:, None]
        tl.store(out, acc.to(dtype), mask=col_mask[:, None] & (rows < M)[None, :])


class GemvConfig(NamedTuple):
    """A program's columns, its step's groups of 128 columns (``groups``), warps, pipeline stages and the
    split of K (``split_k`` programs share a tile's K, their float32 partials summed by a second kernel)."""

    block_n: int
    groups: int
    num_warps: int
    num_stages: int
    split_k: int = 1


MIN_STEPS_PER_SPLIT = 4
WIDE_TILES_PER_SM = 4
GEMV_ROWS = 1
"""Tokens up to which layers/fp8_linear.py takes this kernel: on an H200 at Qwen3-8B's four projections it runs
one token in about 0.85x the time of the activation quantizer and the block kernel (apps/fp8_gemm_sweep.py
--gemv), four in 1.3x at its best tiles (the CUDA cores' work grows with the rows, the tensor cores' does not)."""


def gemv_config(n: int, k: int, sms: int) -> GemvConfig:
    """The tile and split for an [``n``, ``k``] weight on a GPU of ``sms`` SMs: 32 columns a program, steps of
    512 columns, 4 stages; K splits only where the tiles leave half the SMs idle (a narrow layer), until each SM
    has one, each split at least 4 steps (``apps/fp8_gemm_sweep.py --gemv`` at one token: within 3% of the best at
    each of Qwen3-8B's projections on an H200; splitting a weight of 128 tiles or more only adds partials). A
    wide layer, of 4 tiles an SM or more, takes 64 rows and steps of 256 columns in 3 stages: Qwen3-8B's
    gate_up_proj in 25.9 us against 28.1 on an H200 (a CUDA graph of 12 weights in turn). Unsplit, a layer
    whose last wave of 32-row tiles leaves SMs idle that 16-row tiles would fill (a tenth of them or more)
    takes those, in 3 stages: Qwen3-8B's qkv_proj, 192 tiles for 132 SMs, in 10.24 us against 10.77 on an
    H200 (before the lanes' own sums) and 11.08 against 11.50 on an H100.

    >>> gemv_config(4096, 12288, 132)  # Qwen3-8B's down_proj on an H200: 128 tiles, one split
    GemvConfig(block_n=32, groups=4, num_warps=4, num_stages=4, split_k=1)
    >>> gemv_config(6144, 4096, 132)  # its qkv_proj: 192 tiles of 32 (a last wave of 60), 384 of 16 (120)
    GemvConfig(block_n=16, groups=4, num_warps=4, num_stages=3, split_k=1)
    >>> gemv_config(1024, 3072, 132).split_k  # Qwen3-0.6B's o_proj: 32 tiles, K in 6 steps: one split
    1
    """
    block_n, groups = 32, 4
    tiles = triton.cdiv(n, block_n)
    if tiles >= WIDE_TILES_PER_SM * sms:  # a wide layer (gate_up_proj): fewer, taller programs
        return GemvConfig(64, 2, 4, 3)
    steps = triton.cdiv(k, groups * GROUP)
    splits = 1
    if 2 * tiles < sms:
        splits = max(1, min(triton.cdiv(sms, tiles), steps // MIN_STEPS_PER_SPLIT))
    if splits == 1 and _waves_filled(triton.cdiv(n, 16), sms) >= _waves_filled(tiles, sms) + 0.1:
        return GemvConfig(16, groups, 4, 3)
    return GemvConfig(block_n, groups, 4, 4, splits)


def _waves_filled(programs: int, sms: int) -> float:
    """The share of ``sms`` x waves that ``programs`` fill (1.0: the last wave is whole)."""
    return programs / (triton.cdiv(programs, sms) * sms)


def gemv_takes(m: int, block: tuple[int, int], k: int, block_n: int = 32) -> bool:
    """Whether the weight-streaming kernel runs ``m`` tokens of a weight scaled in ``block``: at most MAX_ROWS
    tokens, and scales one a row (one group along K) or in blocks of GROUP columns whose rows a tile divides
    (``block_n``; a fused [gate | up]'s tile holds half as many of each)."""
    block_rows, block_cols = block
    return 1 <= m <= MAX_ROWS and (block_cols >= k or (block_cols == GROUP and block_rows % block_n == 0))


def whole_tiles(n: int, k: int, cfg: GemvConfig) -> bool:
    """Whether an [``n``, ``k``] weight is whole tiles and whole steps of ``cfg`` (a split takes whole steps): the
    kernel's loads then need no mask (Triton 3.6's sm90 loop at Qwen3-8B's 32 x 512 tile: ~12% fewer instructions a
    step; a batch-1 chain of 36 layers, ``apps/fp8_gemm_sweep.py --layers``, about 1% faster on an H100)."""
    return n % cfg.block_n == 0 and k % (cfg.groups * GROUP) == 0


GATED = {"silu": False, "gelu_tanh": True}  # the activations ``fp8_gemv`` applies (as norm_act's): GELU_TANH


def fp8_gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
    config: GemvConfig | tuple[int, ...] | None = None,
    act: str | None = None,
) -> torch.Tensor:
    """x @ (w × w_scale)ᵀ + bias: [M, N] in x's dtype, for M <= MAX_ROWS (``gemv_takes``); with ``act``
    ("silu", "gelu_tanh") w is a fused [gate | up] projection and the result act(gate) * up, [M, N / 2].

    x [M, K] (any float dtype, rows contiguous); w [N, K] float8_e4m3fn as a checkpoint stores it; ``block`` =
    (block_n, block_k) of ``w_scale`` [ceil(N / block_n), ceil(K / block_k)] float32: block_k = 128 (block-wise)
    or K and more (one scale a row: per-channel). ``config`` overrides ``gemv_config`` (benchmarks). With
    ``act`` the activation is the kernel's epilogue where K is not split (``gemv_config``: a layer of 2 x 66
    tiles or more on an H200); a split K sums first and norm_act's kernel follows.

        y = fp8_gemv(x, w, w_scale, (128, 128))  # x [1, 4096] bfloat16, w [6144, 4096] e4m3
        h = fp8_gemv(x, w, w_scale, (128, 128), act="silu")  # w [24576, 4096]: gate_up_proj; h [1, 12288]
    """
    m, k = x.shape
    n = w.shape[0]
    cfg = GemvConfig(*config) if config else gemv_config(n, k, num_sms(x.device))
    gated = act is not None and cfg.split_k == 1
    if not config and not gemv_takes(m, block, k, cfg.block_n // 2 if gated else cfg.block_n):
        cfg = cfg._replace(block_n=32)  # a wide layer's tile of 64 rows in blocks of 32 or 96: a tile of 32
    assert gemv_takes(m, block, k, cfg.block_n // 2 if gated else cfg.block_n), (
        f"{m} rows in blocks {block}: the GEMV does not take them"
    )
    assert not gated or block[1] >= k or n // 2 % block[0] == 0, f"gate rows {n // 2} in blocks of {block[0]}"
    assert w.dtype == FP8 and w.shape[1] == k and w.stride(1) == 1 and x.stride(1) == 1, (w.dtype, w.shape)
    assert w_scale.dtype == torch.float32 and w_scale.shape == (triton.cdiv(n, block[0]), triton.cdiv(k, block[1]))
    assert cfg.split_k >= 1 and cfg.groups & (cfg.groups - 1) == 0, cfg
    assert bias is None or (bias.shape == (n,) and bias.stride(0) == 1), bias
    assert act is None or (act in GATED and n % 2 == 0), (act, n)
    splits = cfg.split_k
    out = torch.empty(m, n // 2 if gated else n, dtype=x.dtype, device=x.device)
    if not n:
        return out
    part = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    stride_os, stride_om = (0, out.stride(0)) if splits == 1 else part.stride()[:2]
    _gemv_kernel[(triton.cdiv(n, cfg.block_n), splits)](
        x, w, w_scale, out if bias is None else bias, part,
        m, n // 2 if gated else n, k,
        x.stride(0), w.stride(0), w_scale.stride(0), stride_os, stride_om,
        BLOCK_N_SCALE=block[0], ONE_GROUP=block[1] >= k, HAS_BIAS=bias is not None and splits == 1,
        ROWS=triton.next_power_of_2(m), BLOCK_N=cfg.block_n, C=cfg.groups, G=GROUP, V=LANE_BYTES, STAGES=cfg.num_stages,
        PDL=pdl(x.device), GATED=gated, GELU_TANH=GATED.get(act, False), EVEN=whole_tiles(n, k, cfg),
        num_warps=cfg.num_warps,
    )  # fmt: skip
    if splits > 1:
        sum_splits(part, bias, out)
    if act is not None and not gated:
        return act_and_mul(out, GATED[act])
    return out
