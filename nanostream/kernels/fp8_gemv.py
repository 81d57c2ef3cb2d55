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

A decoder layer's o_proj and down_proj can end in the residual add and RMSNorm after them
(``fp8_gemv_add_norm``): each program adds the residual to its rows, stores the new residual, the sum times the
norm's weight (in the model's dtype) and its squares' sum, and the next GEMV (gate_up_proj, the next layer's
qkv_proj) takes that ``PendingNorm`` as its x and multiplies its sums by the norm's 1 / rms: a batch-1 step
launches two norm kernels, not 73 (Qwen3-8B on an H200: 2.74 ms a token against 2.88, BENCHMARKS.md). The
product is rounded as the norm kernel's output is, so the next GEMV's loop reads bf16 as it always does: kept
in float32 it doubled the x half of a 16-row tile's loads and qkv_proj's GEMV took 17.7 us against 9.2.

``gemv_config`` (kernels/fp8_gemv_config.py) picks the tile and the split; apps/fp8_gemm_sweep.py --gemv times the
alternatives.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._device import let_dependents_launch, pdl
from .fp8_gemm import FP8, sum_splits
from .fp8_gemv_config import GROUP, GemvConfig, gemv_takes, launch_config, whole_tiles
from .norm_act import act_and_mul, gated_act

LANE_BYTES = 16  # a lane's load of e4m3 weights: the columns of its own dot


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, ss_ptr, res_ptr, norm_w_ptr, res_out_ptr, ss_out_ptr,
    M, N, K, P, eps, weight_offset,
    stride_xm, stride_wn, stride_sn, stride_os, stride_om, stride_ss, stride_r, stride_ro, stride_sso,
    BLOCK_N_SCALE: tl.constexpr, ONE_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr, C: tl.constexpr, G: tl.constexpr, V: tl.constexpr, STAGES: tl.constexpr,
    PDL: tl.constexpr, GATED: tl.constexpr, GELU_TANH: tl.constexpr, EVEN: tl.constexpr,
    RMS: tl.constexpr, BLOCK_P: tl.constexpr, NORM_OUT: tl.constexpr,
):  # fmt: skip
    # Program (pid_n, split): BLOCK_N rows of the weight over split s's contiguous range of K's steps of C * G
    # columns; acc [BLOCK_N, ROWS]: each row of x's share of y, float32. GATED: the weight is [gate | up] (2 N
    # rows), the tile's rows in pairs (gate row j, up row N + j) and y [M, N] = act(gate) * up. RMS: x is a
    # PendingNorm's (ss_ptr its P sums of squares a row). NORM_OUT (one split, not GATED): y goes on into
    # the residual add and a norm's weight (res_ptr, norm_w_ptr) as PendingNorm's x (out_ptr), the new
    # residual (res_out_ptr) and the tile's sums of squares (ss_out_ptr, column pid_n).
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
    if RMS:  # loaded now, summed after the loop: [BLOCK_P, ROWS]
        parts = tl.arange(0, BLOCK_P)
        ss_mask = (parts < P)[:, None] & (rows < M)[None, :]
        ss = tl.load(ss_ptr + rows[None, :].to(tl.int64) * stride_ss + parts[:, None], mask=ss_mask, other=0.0)
    if NORM_OUT:  # the residual and the norm's weight loaded now, used after the loop (no load round trip then)
        out_mask = col_mask[:, None] & (rows < M)[None, :]
        res = tl.load(res_ptr + rows[None, :].to(tl.int64) * stride_r + cols[:, None], mask=out_mask, other=0.0)
        g = tl.load(norm_w_ptr + cols, mask=col_mask, other=0.0)
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
    if RMS:  # the norm's 1 / rms, in the producer's tile order (a split's share too: the sum is linear)
        acc = acc * tl.rsqrt(tl.sum(ss, 0) / K + eps)[None, :]
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
    elif NORM_OUT:  # y rounded as stored, plus the residual (rounded: the new residual), times the norm's weight
        model_dtype = res_out_ptr.dtype.element_ty
        h = (acc.to(model_dtype).to(tl.float32) + res.to(tl.float32)).to(model_dtype)
        tl.store(res_out_ptr + rows[None, :].to(tl.int64) * stride_ro + cols[:, None], h, mask=out_mask)
        h = h.to(tl.float32)
        g = g.to(tl.float32) + weight_offset
        hg = (h * g[:, None]).to(out_ptr.dtype.element_ty)  # bf16 (a float16 model's: float32, its range)
        tl.store(out_ptr + rows[None, :].to(tl.int64) * stride_om + cols[:, None], hg, mask=out_mask)
        tl.store(ss_out_ptr + rows.to(tl.int64) * stride_sso + pid_n, tl.sum(h * h, 0), mask=rows < M)
    else:
        out = out_ptr + split.to(tl.int64) * stride_os + rows[None, :].to(tl.int64) * stride_om + cols[:, None]
        tl.store(out, acc.to(dtype), mask=col_mask[:, None] & (rows < M)[None, :])


GATED = {"silu": False, "gelu_tanh": True}  # the activations ``fp8_gemv`` applies (as norm_act's): GELU_TANH


class PendingNorm(NamedTuple):
    """An RMSNorm's output but for its 1 / rms, left by ``fp8_gemv_add_norm`` for the next ``fp8_gemv`` to apply.

    ``x`` [M, H] in ``dtype`` (float32 for a float16 model: h x weight may pass float16's range where h / rms x
    weight would not): the sum h (a projection plus the residual, rounded to ``dtype``) times the norm's weight,
    rounded once; ``sumsq`` float32 [M, P]: h's squares summed over each of the producer's P tiles. The GEMV
    that takes it multiplies its sums by rsqrt(sum(sumsq) / H + eps) (the sums in tile order: the same bits
    every call) and stores ``dtype``: the norm's product, but for its roundings (one rounding of h x weight,
    where Llama's norm rounds h / rms and then that times the weight)."""

    x: torch.Tensor
    sumsq: torch.Tensor
    eps: float
    dtype: torch.dtype


def fp8_gemv(
    x: torch.Tensor | PendingNorm,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
    config: GemvConfig | tuple[int, ...] | None = None,
    act: str | None = None,
) -> torch.Tensor:
    """x @ (w × w_scale)ᵀ + bias: [M, N] in x's dtype, for M <= MAX_ROWS (``gemv_takes``); with ``act``
    ("silu", "gelu_tanh") w is a fused [gate | up] projection and the result act(gate) * up, [M, N / 2].

    x [M, K] (any float dtype, rows contiguous), or a ``PendingNorm`` (its norm finished here, the result in
    its dtype); w [N, K] float8_e4m3fn as a checkpoint stores it; ``block`` = (block_n, block_k) of ``w_scale``
    [ceil(N / block_n), ceil(K / block_k)] float32: block_k = 128 (block-wise) or K and more (one scale a row:
    per-channel). ``config`` overrides ``gemv_config`` (benchmarks). With ``act`` the activation is the
    kernel's epilogue where K is not split (``gemv_config``: a layer of 2 x 66 tiles or more on an H200); a split
    K sums first and norm_act's kernel follows.

        y = fp8_gemv(x, w, w_scale, (128, 128))  # x [1, 4096] bfloat16, w [6144, 4096] e4m3
        h = fp8_gemv(x, w, w_scale, (128, 128), act="silu")  # w [24576, 4096]: gate_up_proj; h [1, 12288]
    """
    rms = x if isinstance(x, PendingNorm) else None
    x = x.x if rms else x
    m, k = x.shape
    n = w.shape[0]
    cfg, gated = launch_config(x, n, block, config, act)
    _check(x, w, w_scale, block, bias, cfg, gated)
    assert act is None or (act in GATED and n % 2 == 0), (act, n)
    assert rms is None or (rms.sumsq.shape[0] == m and rms.sumsq.stride(1) == 1), rms.sumsq.shape
    splits = cfg.split_k
    out = torch.empty(m, n // 2 if gated else n, dtype=rms.dtype if rms else x.dtype, device=x.device)
    if not n:
        return out
    part = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    stride_os, stride_om = (0, out.stride(0)) if splits == 1 else part.stride()[:2]
    ss = rms.sumsq if rms else out
    _gemv_kernel[(triton.cdiv(n, cfg.block_n), splits)](
        x, w, w_scale, out if bias is None else bias, part, ss, out, out, out, out,
        m, n // 2 if gated else n, k, ss.shape[1] if rms else 0, rms.eps if rms else 0.0, 0.0,
        x.stride(0), w.stride(0), w_scale.stride(0), stride_os, stride_om, ss.stride(0), 0, 0, 0,
        RMS=rms is not None, BLOCK_P=triton.next_power_of_2(ss.shape[1]) if rms else 1, NORM_OUT=False,
        GATED=gated, GELU_TANH=GATED.get(act, False), **_meta(x, block, bias, cfg, n, k),
    )  # fmt: skip
    if splits > 1:
        sum_splits(part, bias, out)
    if act is not None and not gated:
        return act_and_mul(out, GATED[act])
    return out


def fp8_gemv_add_norm(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight_offset: float | None = None,
    config: GemvConfig | tuple[int, ...] | None = None,
) -> tuple[PendingNorm, torch.Tensor]:
    """The projection y = ``fp8_gemv(x, ...)``, then the residual add and RMSNorm that follow it in a decoder
    layer, but for the norm's 1 / rms, in the GEMV's epilogue: (the ``PendingNorm`` for the next GEMV, the new
    residual h = y + ``residual``, rounded as the norm kernel rounds it: the same bits). Only where
    ``norm_fuses`` (one split). ``norm_weight`` [N]; ``weight_offset`` as ``layers.norm.RMSNorm``'s (added to
    the float32 weight; None: 0); ``config`` overrides ``gemv_config`` (one split).

        pending, residual = fp8_gemv_add_norm(attn, o_w, o_s, (128, 128), None, residual, norm.weight, 1e-6)
        h = fp8_gemv(pending, gate_up_w, gate_up_s, (128, 128), act="silu")
    """
    m, k = x.shape
    n = w.shape[0]
    cfg, _ = launch_config(x, n, block, config, None)
    assert cfg.split_k == 1, f"[{n}, {k}] splits K: the norm does not fuse (norm_fuses)"
    _check(x, w, w_scale, block, bias, cfg, False)
    dtype = x.dtype
    assert residual.shape == (m, n) and residual.dtype == dtype and residual.stride(1) == 1, residual.shape
    assert norm_weight.shape == (n,) and norm_weight.stride(0) == 1, norm_weight.shape
    tiles = triton.cdiv(n, cfg.block_n)
    pending = PendingNorm(
        torch.empty(m, n, dtype=torch.float32 if dtype == torch.float16 else dtype, device=x.device),
        torch.empty(m, tiles, dtype=torch.float32, device=x.device),
        eps,
        dtype,
    )
    res_out = torch.empty_like(residual, memory_format=torch.contiguous_format)
    if not n:
        return pending, res_out
    _gemv_kernel[(tiles, 1)](
        x, w, w_scale, res_out if bias is None else bias, pending.x, pending.sumsq, residual, norm_weight, res_out,
        pending.sumsq,
        m, n, k, 0, 0.0, float(weight_offset or 0.0),
        x.stride(0), w.stride(0), w_scale.stride(0), 0, pending.x.stride(0), 0, residual.stride(0),
        res_out.stride(0), pending.sumsq.stride(0),
        RMS=False, BLOCK_P=1, NORM_OUT=True,
        GATED=False, GELU_TANH=False, **_meta(x, block, bias, cfg, n, k),
    )  # fmt: skip
    return pending, res_out


def _check(x, w, w_scale, block, bias, cfg: GemvConfig, gated: bool) -> None:
    m, k = x.shape
    n = w.shape[0]
    assert gemv_takes(m, block, k, cfg.block_n // 2 if gated else cfg.block_n), (
        f"{m} rows in blocks {block}: the GEMV does not take them"
    )
    assert not gated or block[1] >= k or n // 2 % block[0] == 0, f"gate rows {n // 2} in blocks of {block[0]}"
    assert w.dtype == FP8 and w.shape[1] == k and w.stride(1) == 1 and x.stride(1) == 1, (w.dtype, w.shape)
    assert w_scale.dtype == torch.float32 and w_scale.shape == (triton.cdiv(n, block[0]), triton.cdiv(k, block[1]))
    assert cfg.split_k >= 1 and cfg.groups & (cfg.groups - 1) == 0, cfg
    assert bias is None or (bias.shape == (n,) and bias.stride(0) == 1), bias


def _meta(x: torch.Tensor, block: tuple[int, int], bias, cfg: GemvConfig, n: int, k: int) -> dict:
    """The kernel's launch keywords that do not depend on what it ends in."""
    return dict(
        BLOCK_N_SCALE=block[0], ONE_GROUP=block[1] >= k, HAS_BIAS=bias is not None and cfg.split_k == 1,
        ROWS=triton.next_power_of_2(x.shape[0]), BLOCK_N=cfg.block_n, C=cfg.groups, G=GROUP, V=LANE_BYTES,
        STAGES=cfg.num_stages, PDL=pdl(x.device), EVEN=whole_tiles(n, k, cfg), num_warps=cfg.num_warps,
    )  # fmt: skip
