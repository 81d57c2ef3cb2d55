"""Fused MoE: the routed experts' gated MLPs as two grouped GEMMs over tokens sorted by expert (the design of
vLLM's ``fused_moe``), computing what ``nanostream.layers.moe_reference.moe_experts`` computes.

1. ``align_by_expert`` (kernels/moe_align.py): the T*K (token, expert) pairs sorted by expert, each expert's
   run padded to a multiple of BLOCK_M, and each block's expert; no host sync, buffers of a static length
   (a CUDA graph captures it at a fixed T).
2. ``_moe_gemm_kernel`` with GATED_ACT: per block of pairs and tile of the intermediate dimension, the
   pairs' token rows times the expert's gate and up rows (two float32 accumulators), + their biases
   (gpt-oss), the activation (silu(gate) * up, Gemma 4's gelu(gate) * up, or gpt-oss's clamped SwiGLU) stored:
   [T*K, I]. The
   [T*K, 2I] gate/up product is never written.
3. ``_moe_gemm_kernel`` with MUL_WEIGHT: per block and tile of H, those rows times the expert's down
   rows, + its bias (gpt-oss), times the pair's routing weight: [T*K, H].
4. Each token's K rows summed (torch, top-k order, as the reference): [T, H].

Tiles come from ``TILES`` by shape and token count (``tile_for``): the fastest of ``SWEEP`` that
apps/bench_kernels.py's ``moe`` section measured on an H200 for the shapes it has, up to 256 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanostream.kernels.expert_ops import GATED_ACTIVATIONS, Activation, ClampedSwiGLU, ordered_topk_sum
from nanostream.kernels.moe_align import align_by_expert


@dataclass(frozen=True)
class MoETile:
    block_m: int  # pairs per program (and the padding of each expert's run)
    block_n: int  # output columns per program
    block_k: int  # reduction step
    group_m: int  # row blocks that share their weight tiles in L2 (program order)
    num_warps: int = 4
    num_stages: int = 3


# (num_experts, hidden, intermediate per rank, dtype) or "default" -> ((up to this many tokens, tile), ...),
# the last for any count. Measured on an H200 (bf16, apps/bench_kernels.py --sections moe, the fastest of
# SWEEP in a graph replay at 1, 16, 64 and 256 tokens; BENCHMARKS.md); the last row of each, beyond 256 tokens
# (prefill), is not measured. "default" takes the shapes measured as a guide for the others.
TILES: dict[tuple[int, int, int, str] | str, tuple[tuple[int, MoETile], ...]] = {
    (128, 2048, 768, "bfloat16"): (  # Qwen3-30B-A3B
        (64, MoETile(16, 64, 128, 1, num_warps=4, num_stages=4)),
        (1 << 62, MoETile(64, 64, 64, 8, num_warps=4, num_stages=3)),
    ),
    (8, 4096, 14336, "bfloat16"): (  # Mixtral-8x7B
        (1, MoETile(16, 64, 128, 1, num_warps=4, num_stages=4)),
        (16, MoETile(16, 128, 128, 1, num_warps=4, num_stages=4)),
        (64, MoETile(64, 64, 64, 8, num_warps=4, num_stages=3)),
        (1 << 62, MoETile(128, 128, 64, 8, num_warps=8, num_stages=3)),
    ),
    "default": (
        (32, MoETile(16, 64, 128, 1, num_warps=4, num_stages=4)),  # decode: each expert sees a row or two
        (256, MoETile(64, 64, 64, 8, num_warps=4, num_stages=3)),
        (1 << 62, MoETile(128, 128, 64, 8, num_warps=8, num_stages=3)),
    ),
}
SWEEP = (
    MoETile(16, 32, 64, 1),
    MoETile(16, 64, 128, 1, num_stages=4),
    MoETile(16, 128, 128, 1, num_stages=4),
    MoETile(32, 64, 64, 4),
    MoETile(32, 128, 64, 4),
    MoETile(64, 64, 64, 8),
    MoETile(64, 128, 64, 8, num_warps=8),
    MoETile(128, 128, 64, 8, num_warps=8),
)
"""Tiles the benchmark tries at each shape (apps/kernel_bench/moe.py)."""


def tile_for(num_tokens: int, num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype) -> MoETile:
    """The ``TILES`` entry for this shape (else the default) and token count."""
    rows = TILES.get((num_experts, hidden, intermediate, str(dtype).removeprefix("torch.")), TILES["default"])
    return next(tile for upto, tile in rows if num_tokens <= upto)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks_m"])  # both follow the token count: one compile
def _moe_gemm_kernel(
    a_ptr, w_ptr, c_ptr, weights_ptr, pairs_ptr, block_experts_ptr, num_padded_ptr, bias_ptr,
    N, K, num_pairs, num_blocks_m,
    stride_am, stride_we, stride_wn, stride_cm, up_offset, stride_be, alpha, limit,
    A_ROW_DIV: tl.constexpr, GATED_ACT: tl.constexpr, HAS_BIAS: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    # Program -> (block of sorted pairs, tile of N), GROUP_M row blocks per band so that they reuse the
    # expert's weight tile from L2. c[pair, n] = sum_k a[pair // A_ROW_DIV, k] * w[expert, n, k]
    # (w's rows have unit stride along K) (+ bias[expert, n] with HAS_BIAS); GATED_ACT ("silu", "gelu_tanh" or
    # "clamped_swiglu"; "" for none): that is the gate, the same over the rows up_offset on (and the bias's
    # entries N on) the up, and c = act(gate, up). The flags are constexpr: a launch without them compiles to
    # the plain GEMM.
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    band = GROUP_M * num_n
    first_m = (pid // band) * GROUP_M
    rows_in_band = tl.minimum(num_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % band) % rows_in_band
    pid_n = (pid % band) // rows_in_band
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    valid = pairs < num_pairs
    pairs = tl.where(valid, pairs, 0).to(tl.int64)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pairs // A_ROW_DIV)[:, None] * stride_am + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    # [BLOCK_K, BLOCK_N]: the expert's rows offs_n, read along K
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        if IEEE:  # noqa: SIM108 (float32 operands: exact products, not TF32)
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
        if GATED_ACT != "":
            w_up = tl.load(w_ptrs + up_offset, mask=w_mask, other=0.0)
            if IEEE:  # noqa: SIM108
                acc_up = tl.dot(a, w_up, acc_up, input_precision="ieee")
            else:
                acc_up = tl.dot(a, w_up, acc_up)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:  # [BLOCK_N] of the expert's bias, added to every pair's row
        b_ptrs = bias_ptr + expert * stride_be + offs_n
        acc += tl.load(b_ptrs, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if GATED_ACT != "":
            acc_up += tl.load(b_ptrs + N, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if GATED_ACT == "silu":
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    elif GATED_ACT == "gelu_tanh":  # 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), tanh(z) = 2 sigmoid(2z) - 1
        z = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
        acc = acc * tl.sigmoid(2.0 * z) * acc_up
    elif GATED_ACT == "clamped_swiglu":  # gpt-oss: gate clamped above, up on both sides, (up + 1) * swish_alpha(gate)
        gate = tl.minimum(acc, limit)
        up = tl.minimum(tl.maximum(acc_up, -limit), limit)
        acc = (up + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    c_ptrs = c_ptr + pairs[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


def _check_layout(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
) -> None:
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"fused_moe takes x [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {x.dim()}, {w13.dim()}, {w2.dim()} dims"
        )
    (num_tokens, hidden), (num_experts, two_i, _) = x.shape, w13.shape
    if w13.shape[2] != hidden or two_i % 2 or w2.shape != (num_experts, hidden, two_i // 2):
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit x {tuple(x.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)}, topk_weights {tuple(topk_weights.shape)}: need [{num_tokens}, K]"
        )
    if topk_ids.dtype not in (torch.int32, torch.int64) or not topk_weights.dtype.is_floating_point:
        raise ValueError(
            f"topk_ids must be int32/int64, topk_weights float; got {topk_ids.dtype}, {topk_weights.dtype}"
        )
    if x.dtype != w13.dtype or w2.dtype != w13.dtype:
        raise ValueError(f"x, w13 and w2 must share a dtype; got {x.dtype}, {w13.dtype}, {w2.dtype}")
    if x.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError(f"rows must be contiguous: strides x {x.stride()}, w13 {w13.stride()}, w2 {w2.stride()}")
    if not topk_weights.is_contiguous():
        raise ValueError(f"topk_weights must be contiguous, got strides {topk_weights.stride()}")
    for name, bias, shape in (
        ("w13_bias", w13_bias, (num_experts, two_i)),
        ("w2_bias", w2_bias, (num_experts, hidden)),
    ):
        if bias is not None and (bias.shape != shape or bias.stride(1) != 1 or not bias.dtype.is_floating_point):
            raise ValueError(
                f"{name} must be a float [{', '.join(map(str, shape))}] with contiguous rows; got "
                f"{tuple(bias.shape)} {bias.dtype}, strides {bias.stride()}"
            )
    tensors = (x, w13, w2, topk_weights, topk_ids, *(b for b in (w13_bias, w2_bias) if b is not None))
    if len({t.device for t in tensors}) != 1:
        raise ValueError("x, the weights, the biases and the routing tensors must be on one device")


INVARIANT_TOKENS = 64
"""The token count whose tile the batch-invariant mode runs at every count (decode's, mostly)."""


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: Activation = "silu",
    tile: MoETile | None = None,
    invariant: bool = False,
) -> torch.Tensor:
    """``nanostream.layers.moe_spec.MoEFn``: the routed experts of x [T, H] (unit-stride rows) with w13 [E, 2I, H]
    (gate rows, then up) and w2 [E, H, I] (unit stride along their last dimension), topk_ids / topk_weights
    [T, K] (contiguous weights, any float dtype: applied in float32); [T, H] in x's dtype. ``w13_bias``
    [E, 2I] and ``w2_bias`` [E, H] (gpt-oss) are added to the float32 accumulators, before the activation
    and the routing weight; ``activation`` is "silu", "gelu_tanh" or gpt-oss's ``ClampedSwiGLU``.

    ``tile`` overrides ``tile_for``'s choice (benchmarks). ``invariant`` (the batch-invariant mode): the tile
    of ``INVARIANT_TOKENS`` tokens whatever the count, and each token's K rows added in top-k order, so that a
    token's output does not depend on the others'."""
    _check_layout(x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias)
    clamped = isinstance(activation, ClampedSwiGLU)
    if not clamped and activation not in GATED_ACTIVATIONS:
        raise ValueError(f"fused_moe's activation is one of {GATED_ACTIVATIONS} or a ClampedSwiGLU, not {activation!r}")
    alpha, limit = (activation.alpha, activation.limit) if clamped else (0.0, 0.0)
    (num_tokens, hidden), (num_experts, two_i, _), top_k = x.shape, w13.shape, topk_ids.shape[1]
    inter = two_i // 2
    if num_tokens == 0:
        return torch.zeros_like(x)
    tile = tile or tile_for(INVARIANT_TOKENS if invariant else num_tokens, num_experts, hidden, inter, x.dtype)
    sorted_pairs, block_experts, num_padded = align_by_expert(topk_ids, num_experts, tile.block_m)
    num_pairs, num_blocks_m = num_tokens * top_k, block_experts.shape[0]
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)  # act(gate) * up per pair
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)  # weighted down per pair
    common = dict(
        IEEE=x.dtype == torch.float32, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        GROUP_M=tile.group_m, num_warps=tile.num_warps, num_stages=tile.num_stages,
    )  # fmt: skip
    # Without a bias the kernel never reads its pointer (HAS_BIAS is constexpr): w13 / w2 stand in.
    _moe_gemm_kernel[(num_blocks_m * triton.cdiv(inter, tile.block_n),)](
        x, w13, act, topk_weights, sorted_pairs, block_experts, num_padded, w13 if w13_bias is None else w13_bias,
        inter, hidden, num_pairs, num_blocks_m,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0), inter * w13.stride(1),
        0 if w13_bias is None else w13_bias.stride(0), alpha, limit,
        A_ROW_DIV=top_k, GATED_ACT="clamped_swiglu" if clamped else activation, HAS_BIAS=w13_bias is not None,
        MUL_WEIGHT=False, **common,
    )  # fmt: skip
    _moe_gemm_kernel[(num_blocks_m * triton.cdiv(hidden, tile.block_n),)](
        act, w2, out, topk_weights, sorted_pairs, block_experts, num_padded, w2 if w2_bias is None else w2_bias,
        hidden, inter, num_pairs, num_blocks_m,
        act.stride(0), w2.stride(0), w2.stride(1), out.stride(0), 0,
        0 if w2_bias is None else w2_bias.stride(0), 0.0, 0.0,
        A_ROW_DIV=1, GATED_ACT="", HAS_BIAS=w2_bias is not None, MUL_WEIGHT=True, **common,
    )  # fmt: skip
    if invariant:
        return ordered_topk_sum(out.view(num_tokens, top_k, hidden))
    return out.view(num_tokens, top_k, hidden).sum(dim=1)  # [T, H], each token's K rows in top-k order
