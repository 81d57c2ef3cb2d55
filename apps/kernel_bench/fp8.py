"""The "fp8" section: one linear layer at Qwen3-8B's projection shapes (q/k/v+o: 4096 x 4096, gate/up: 24576 x
4096, down: 4096 x 12288) and 1, 64, 256 and 4,096 tokens: the bf16 GEMM (F.linear) against the FP8 GEMM with
block-wise weights (nanostream.kernels.fp8_gemm, 128 x 128 blocks, activations quantized per 128-group in the
timed call) and torch._scaled_mm with per-channel weights and per-token activations (quantized in the call too).

Each output is checked against the dequantized operands' product in float32 (BAD over harness.TOL); TB/s counts
the weight bytes, the bound of the small batches.
"""

from __future__ import annotations

import functools
import traceback
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from kernel_bench.attention import load_kernel
from kernel_bench.harness import DEVICE, TOL, check_alive_after, need_cuda, short
from kernel_bench.report import fmt_impl
from kernel_bench.timing import best_us, time_calls

if TYPE_CHECKING:
    from kernel_bench.run import Run

TOKENS = (1, 64, 256, 4096)
SHAPES = ((4096, 4096), (24576, 4096), (4096, 12288))  # (N, K)
FP8 = torch.float8_e4m3fn


def block_quantized(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    tiles = w.float().reshape(n // block, block, k // block, block)
    scale = tiles.abs().amax(dim=(1, 3)) / 448.0  # [N / 128, K / 128]
    q = (tiles / scale[:, None, :, None]).reshape(n, k).to(FP8)
    return q, scale.contiguous()


def bench_fp8(run: Run, n: int, k: int, tokens: int, kernels: dict) -> None:
    gen = torch.Generator(DEVICE).manual_seed(run.args.seed + n + tokens)
    w = (torch.randn(n, k, device=DEVICE, generator=gen) * 0.02).bfloat16()
    x = torch.randn(tokens, k, device=DEVICE, generator=gen).bfloat16()
    wq, ws = block_quantized(w)
    wc_scale = (w.float().abs().amax(1, keepdim=True) / 448.0).contiguous()  # [N, 1]
    wc = (w.float() / wc_scale).to(FP8)
    row: dict[str, Any] = {"n": n, "k": k, "tokens": tokens, "impls": {}}
    run.report.setdefault("fp8", []).append(row)
    quantize, matmul = kernels["quantize"], kernels["matmul"]

    def ours(x):
        xq, xs = quantize(x, 128)
        return matmul(xq, xs, wq, ws, (128, 128), torch.bfloat16)

    def scaled_mm(x):
        xs = x.float().abs().amax(1, keepdim=True).clamp_min(1e-12) / 448.0
        xq = (x.float() / xs).to(FP8)
        return torch._scaled_mm(xq, wc.T, scale_a=xs, scale_b=wc_scale.T, out_dtype=torch.bfloat16)

    impls = {"bf16": lambda x: F.linear(x, w), "fp8 block": ours, "fp8 channel (_scaled_mm)": scaled_mm}
    refs = {"bf16": x.float() @ w.float().T}
    refs["fp8 block"] = refs["fp8 channel (_scaled_mm)"] = refs["bf16"]
    for label, fn in impls.items():
        res: dict[str, Any] = {}
        row["impls"][label] = res
        try:
            out = fn(x)
            torch.cuda.synchronize()
            err = ((out.float() - refs[label]).norm() / refs[label].norm()).item()
            # FP8 operands: e4m3's rounding of x and w, a few percent of the bf16 product
            res["err"], res["ok"] = err, bool(torch.isfinite(out).all()) and err < (TOL if label == "bf16" else 0.08)
        except Exception as exc:
            res["error"] = short(exc)
            traceback.print_exc()
            check_alive_after(exc)
            continue
        time_calls(res, [functools.partial(fn, x)])
        t = best_us(res)
        if t:
            weight_bytes = n * k * (2 if label == "bf16" else 1)
            res["tbs"] = weight_bytes / (t * 1e-6) / 1e12
        print(f"   {label}: {fmt_impl(res)}")


def section_fp8(run: Run) -> None:
    need_cuda()
    kernels = {
        "quantize": load_kernel("fp8_gemm", "quantize_per_token_group"),
        "matmul": load_kernel("fp8_gemm", "fp8_scaled_matmul"),
    }
    for n, k in SHAPES:
        for tokens in TOKENS:
            run.unit(f"fp8/N={n} K={k} T={tokens}", lambda n=n, k=k, t=tokens: bench_fp8(run, n, k, t, kernels))
