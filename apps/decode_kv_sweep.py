"""Paged decode attention with a bf16 pool and an FP8 one, over the kernel's tiles (GPU only; CUDA-graph timing).

At the Qwen3-8B shape (32 query heads, 8 KV heads, head dim 128) and the 0.6B one (16 and 8): 256 sequences of
the bench workload's mean context (~1,116 tokens, spread 100 to 2,132) and 1 sequence of 1,024, 256-token
blocks in a shuffled pool (the FP8 pool's V laid out rows fastest, as the engine lays it). Per case: each tile's
us (BLOCK_N, warps, stages), the KV bytes a call reads over its time (GB/s), and the FP8 pool's error against
the bf16 pool's output.

    python3 apps/decode_kv_sweep.py
"""

from __future__ import annotations

import functools
import itertools
import random
import sys

import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, ".")
from nanostream.kernels.decode_attention import FP8_TILE, TILE, paged_decode_attention

TILES = tuple(itertools.product((32, 64, 128), (4, 8), (2, 3)))
SHAPES = {"8b": (32, 8, 128), "0.6b": (16, 8, 128)}
BLOCK = 256


def case(hq: int, hkv: int, d: int, lens: list[int]) -> dict:
    pages = [-(-n // BLOCK) for n in lens]
    num_blocks = sum(pages) + 8
    order = list(range(num_blocks))
    random.Random(0).shuffle(order)
    table = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    at = 0
    for i, p in enumerate(pages):
        table[i, :p] = torch.tensor(order[at : at + p])
        at += p
    k = torch.randn(num_blocks, BLOCK, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    k_scale, v_scale = (t.abs().amax().float().reshape(1) / 448 for t in (k, v))  # [1] float32, on the GPU
    k8, v8 = (k / k_scale).to(torch.float8_e4m3fn), (v / v_scale).to(torch.float8_e4m3fn)
    v8 = v8.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)  # rows fastest, as allocate_kv_pool lays it
    return dict(
        q=torch.randn(len(lens), hq, d, device="cuda", dtype=torch.bfloat16),
        table=table.cuda(), lens=torch.tensor(lens, dtype=torch.int32, device="cuda"), max_len=max(lens),
        bf16=(k, v, {}), fp8=(k8, v8, dict(k_scale=k_scale, v_scale=v_scale)),
        kv_tokens=sum(lens) * hkv * d * 2,
    )  # fmt: skip


def main() -> None:
    rng = random.Random(0)
    half = [rng.randint(100, 2132) for _ in range(128)]
    shapes = {"b256 ctx~1116": [*half, *(2232 - n for n in half)], "b1 ctx1024": [1024]}
    print(torch.cuda.get_device_name(), "| us per call, CUDA graphs | GB/s of KV read", flush=True)
    for (model, (hq, hkv, d)), (name, lens) in itertools.product(SHAPES.items(), shapes.items()):
        c = case(hq, hkv, d, lens)
        ref = None
        for pool in ("bf16", "fp8"):
            k, v, scales = c[pool]
            call = functools.partial(paged_decode_attention, c["q"], k, v, c["table"], c["lens"], d**-0.5,
                                     c["max_len"], **scales)  # fmt: skip
            out = call().float()
            ref = out if ref is None else ref
            err = ((out - ref).norm() / ref.norm()).item()
            times = {}
            for tile in TILES:
                try:
                    times[tile] = do_bench_cudagraph(functools.partial(call, tile=tile), rep=10) * 1e3
                except Exception as exc:  # a tile that fails to compile or launch: reported, not fatal
                    print(f"   {tile}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            default = times.get(FP8_TILE if pool == "fp8" else TILE, float("nan"))
            nbytes = c["kv_tokens"] * k.element_size()
            ranked = sorted(times, key=times.get)[:4]
            best = ", ".join(f"{t} {times[t]:.1f}" for t in ranked)
            print(f"{model} {name} {pool}: default {default:.1f} us ({nbytes / default / 1e3:.0f} GB/s)"
                  f" | best {best} ({nbytes / times[ranked[0]] / 1e3:.0f} GB/s) | error vs bf16 {err:.1e}",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
