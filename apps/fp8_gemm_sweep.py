"""The FP8 GEMMs at Qwen3-8B's projection shapes and 1 to 4,096 tokens (GPU only; CUDA-graph timing, us): bf16
F.linear, the activation quantizer, the Triton block-scaled kernel (its default tile and the best of a few),
torch's block-scaled F.scaled_mm, and per-channel weights through torch._scaled_mm and the Triton kernel.

    python3 apps/fp8_gemm_sweep.py      # from the repository root
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

sys.path.insert(0, ".")
from kernels.fp8_gemm import fp8_scaled_matmul, quantize_per_token_group
from nanostream.layers.fp8_linear import _block_scaled_mm, quantize

SHAPES = ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288))  # (N, K): qkv, o, gate/up, down
TOKENS = (1, 4, 16, 64, 256, 1024, 4096)
TILES = ((16, 16, 128, 2, 4), (16, 32, 128, 4, 4), (16, 64, 128, 4, 4), (32, 64, 128, 4, 4), (64, 64, 128, 4, 4),
         (64, 128, 128, 4, 4), (128, 128, 128, 8, 3))  # fmt: skip


def us(fn, *args, **kwargs) -> float:
    return do_bench_cudagraph(functools.partial(fn, *args, **kwargs), rep=30) * 1e3


def main() -> None:
    bf16 = torch.bfloat16
    for n, k in SHAPES:
        w = torch.randn(n, k, device="cuda") * 0.02
        wq, ws = quantize(w, (128, 128))
        wc, wcs = quantize(w, (1, k))
        w = w.to(bf16)
        for m in TOKENS:
            x = torch.randn(m, k, device="cuda", dtype=bf16)
            xq, xs = quantize_per_token_group(x, 128)
            xcq, xcs = quantize_per_token_group(x, k)
            tiles = {t: us(fp8_scaled_matmul, xq, xs, wq, ws, (128, 128), bf16, config=t) for t in TILES}
            best = min(tiles, key=tiles.get)
            line = (
                f"N={n} K={k} M={m}: bf16 {us(F.linear, x, w):.1f} | quant {us(quantize_per_token_group, x, 128):.1f}"
                f" | block: triton {us(fp8_scaled_matmul, xq, xs, wq, ws, (128, 128), bf16):.1f}"
                f" (best {tiles[best]:.1f} {best})"
            )
            if m % 16 == 0:
                line += f", torch {us(_block_scaled_mm, xq, xs, wq, ws, bf16):.1f}"
            smm = us(torch._scaled_mm, xcq, wc.t(), scale_a=xcs, scale_b=wcs.t(), out_dtype=bf16)
            tri = us(fp8_scaled_matmul, xcq, xcs, wc, wcs, (1, k), bf16)
            line += f" | channel: _scaled_mm {smm:.1f}, triton {tri:.1f}"
            print(line + f" | FP8 weight floor {n * k / 4.8e12 * 1e6:.1f}", flush=True)


if __name__ == "__main__":
    main()
