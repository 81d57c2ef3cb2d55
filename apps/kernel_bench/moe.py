"""The "moe" section: one MoE layer's routed experts at 1, 16, 64 and 256 tokens, the fused Triton kernel (the
tile table's choice and each tile of ``SWEEP``) against the torch path and against the layer's floor.

Shapes: Qwen3-30B-A3B's layer (128 experts of 768, 8 per token, hidden 2048) and, without --quick, Mixtral-8x7B's
(8 experts of 14,336, 2 per token, hidden 4096); bf16, random weights (std 0.02) and random distinct top-k
experts per token. Each routing set is a fresh draw; the input sets cycle through MAX_SETS routings.

Floor: the bytes the step must move, the experts its tokens touch (each read once: 3 * I * H weights) plus
the activations in and out, at the measured copy bandwidth; and the matmul FLOPs (2 * pairs * 3 * I * H) at
the measured bf16 rate; the larger of the two. Every implementation's output (poisoned first) is checked
against the torch path computed in float32 on the same inputs; BAD over harness.TOL.
"""

from __future__ import annotations

import functools
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kernel_bench.attention import load_kernel
from kernel_bench.harness import DEVICE, DTYPE, MAX_SETS, TOL, check_alive_after, need_cuda, short
from kernel_bench.report import fmt_impl
from kernel_bench.timing import best_us, time_calls

if TYPE_CHECKING:
    from kernel_bench.run import Run

TOKENS = (1, 16, 64, 256)


@dataclass(frozen=True)
class MoEShape:
    name: str
    num_experts: int
    top_k: int
    hidden: int
    inter: int  # per expert (one rank's slice)

    def expert_bytes(self) -> int:
        return 3 * self.inter * self.hidden * DTYPE.itemsize


SHAPES = (MoEShape("qwen3-30b-a3b", 128, 8, 2048, 768), MoEShape("mixtral-8x7b", 8, 2, 4096, 14336))


def routing_sets(shape: MoEShape, tokens: int, n: int, gen: torch.Generator) -> list[tuple[torch.Tensor, ...]]:
    """n (x [T, H], topk_weights [T, K] float32 renormalised, topk_ids [T, K]) sets on the device."""
    sets = []
    for _ in range(n):
        scores = torch.rand(tokens, shape.num_experts, generator=gen)
        weights, ids = torch.softmax(scores * 4, -1).topk(shape.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        x = torch.randn(tokens, shape.hidden, generator=gen).to(DEVICE, DTYPE)
        sets.append((x, weights.to(DEVICE).contiguous(), ids.to(DEVICE)))
    return sets


def floor_us(shape: MoEShape, tokens: int, sets: list, ceil: dict | None) -> tuple[float | None, int]:
    touched = sum(len(torch.unique(ids)) for _, _, ids in sets) / len(sets)
    io = touched * shape.expert_bytes() + 2 * tokens * shape.hidden * DTYPE.itemsize
    if not ceil:
        return None, int(io)
    flops = 2 * tokens * shape.top_k * 3 * shape.inter * shape.hidden
    return max(io / (ceil["copy_tbs"] * 1e12), flops / (ceil["matmul_tflops"] * 1e12)) * 1e6, int(io)


def bench_moe(run: Run, shape: MoEShape, tokens: int, weights: tuple, fused, reference, sweep) -> None:
    ceil = run.ceilings()
    gen = torch.Generator().manual_seed(run.args.seed + tokens)
    sets = routing_sets(shape, tokens, MAX_SETS if tokens <= 64 else 16, gen)
    floor, io = floor_us(shape, tokens, sets, ceil)
    row: dict[str, Any] = {"shape": shape.name, "tokens": tokens, "floor_us": floor, "io_bytes": io, "impls": {}}
    run.report["moe"].append(row)
    w13, w2 = weights
    x, tw, ids = sets[0]
    expected = reference(x.float(), w13.float(), w2.float(), tw, ids)  # the float32 torch path
    impls = {"torch": lambda s: reference(s[0], w13, w2, s[1].to(DTYPE), s[2])}
    if isinstance(fused, Exception):
        row["impls"]["fused"] = {"error": f"import: {short(fused)}"}
    else:
        impls["fused"] = lambda s: fused(s[0], w13, w2, *s[1:])
        for tile in sweep:
            impls[tile_label(tile)] = lambda s, tile=tile: fused(s[0], w13, w2, *s[1:], tile=tile)
    for label, fn in impls.items():
        res: dict[str, Any] = {}
        row["impls"][label] = res
        try:
            out = fn(sets[0])
            torch.cuda.synchronize()
            err = ((out.float() - expected).norm() / expected.norm()).item()
            res["err"], res["ok"] = err, bool(torch.isfinite(out).all()) and err < TOL
        except Exception as exc:
            res["error"] = short(exc)
            traceback.print_exc()
            check_alive_after(exc)
            continue
        time_calls(res, [functools.partial(fn, s) for s in sets])
        t = best_us(res)
        if t and floor:
            res["frac_floor"] = floor / t
        print(f"   {label}: {fmt_impl(res)}")


def random_experts(shape: MoEShape, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [E, 2I, H] and w2 [E, H, I] in bf16, std 0.02, made on the device."""
    gen = torch.Generator(DEVICE).manual_seed(seed)
    e, h, i = shape.num_experts, shape.hidden, shape.inter
    w13 = torch.randn(e, 2 * i, h, device=DEVICE, generator=gen).mul_(0.02).to(DTYPE)
    return w13, torch.randn(e, h, i, device=DEVICE, generator=gen).mul_(0.02).to(DTYPE)


def section_moe(run: Run) -> None:
    need_cuda()
    run.ceilings()
    fused = load_kernel("fused_moe", "fused_moe")
    tiles = load_kernel("fused_moe", "SWEEP")
    from nanostream.layers.moe_reference import moe_experts

    sweep = () if isinstance(tiles, Exception) or run.args.quick else tiles
    for shape in SHAPES[:1] if run.args.quick else SHAPES:
        weights = random_experts(shape, run.args.seed)
        for tokens in TOKENS:
            run.unit(
                f"moe/{shape.name} T={tokens}",
                lambda s=shape, t=tokens, w=weights: bench_moe(run, s, t, w, fused, moe_experts, sweep),
            )
        del weights


def tile_label(tile) -> str:
    return f"fused[{tile.block_m}x{tile.block_n}x{tile.block_k} g{tile.group_m} w{tile.num_warps} s{tile.num_stages}]"
