"""The FP8 GEMMs at Qwen3-8B's projection shapes (GPU only; CUDA-graph timing, us).

The full sweep, 1 to 4,096 tokens: bf16 F.linear, the activation quantizer, the Triton block-scaled kernel (its
default config and the best of a few tiles, one split), torch's block-scaled F.scaled_mm, and per-channel
weights through torch._scaled_mm and the Triton kernel.

``--split-k``, the few-token steps (1, 4 and 16 tokens, about a minute): the Triton block-scaled kernel's
tiles of 16 rows times K splits, bounded to at most 6 programs per SM; per shape and token count the best
config and the best with one split against ``default_config``'s pick, bf16 F.linear, the per-channel Triton
kernel (default and one split) and the FP8 weight's byte floor. Each timed call there reads the next of
several copies of the weight (256 MB or more in all): a decode step streams every layer's weight once, so
none may sit in the 50 MB L2 from the previous call.

``--mid``, 17 to 256 tokens (the decode steps of a busy server): the Triton block-scaled kernel over tiles of 32 to
128 rows times K splits (splits only while the tiles leave SMs idle) against torch's block-scaled F.scaled_mm
(cuBLASLt, rows padded to 16s), ``default_config``'s pick, bf16 F.linear and the activation quantizer, weights
rotated as in ``--split-k``; the last lines add up a layer's four projections.

``--gemv``, 1 and 4 tokens: the weight-streaming kernel (nanostream/kernels/fp8_gemv.py, x unquantized) over
its tiles, steps, stages and splits, against the block kernel with its activation quantizer (what a
layer ran before it), bf16 and the floor; weights rotated as in ``--split-k``.

    python3 apps/fp8_gemm_sweep.py              # from the repository root
    python3 apps/fp8_gemm_sweep.py --split-k
    python3 apps/fp8_gemm_sweep.py --gemv
    python3 apps/fp8_gemm_sweep.py --mid --tokens 64 128 256
    python3 apps/fp8_gemm_sweep.py --layers --rep 200
    python3 apps/fp8_gemm_sweep.py --layers --bf16 --rep 200

``--layers``: a batch-1 step's layers at Qwen3-8B's shapes, 36 layers' weights in one CUDA graph (norm -> qkv ->
the attention prologue and split decode attention over 400 tokens -> o -> norm -> gate_up + SiLU -> down), timed
twice: the step without the embedding, the LM head and the sampler, for variants of the kernels to be set against.
o_proj and down_proj end in the norms after them as the model runs them at one token (``--unfused-norms``: not).
``--layers --bf16``: the same chain with bf16 weights through F.linear, as the bf16 model runs its projections.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench_cudagraph

sys.path.insert(0, ".")
from nanostream.kernels._device import num_sms
from nanostream.kernels.fp8_gemm import Config, default_config, fp8_scaled_matmul, quantize_per_token_group
from nanostream.kernels.fp8_gemv import fp8_gemv, fp8_gemv_add_norm
from nanostream.kernels.fp8_gemv_config import GemvConfig, gemv_config
from nanostream.kernels.norm_act import rms_norm, silu_and_mul
from nanostream.layers.fp8_linear import _block_scaled_mm, dequantize, quantize

SHAPES = ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288))  # (N, K): qkv, o, gate/up, down
NAMES = dict(zip(SHAPES, ("qkv", "o", "gate_up", "down")))
TOKENS = (1, 4, 16, 64, 256, 1024, 4096)
TILES = ((16, 16, 128, 2, 4), (16, 32, 128, 4, 4), (16, 64, 128, 4, 4), (32, 64, 128, 4, 4), (64, 64, 128, 4, 4),
         (64, 128, 128, 4, 4), (128, 128, 128, 8, 3))  # fmt: skip
SPLIT_TOKENS = (1, 4, 16)
SPLIT_TILES = ((16, 16, 128, 2, 4), (16, 32, 128, 4, 4), (16, 64, 128, 4, 4))  # 16 rows: the few-token tiles
SPLITS = (1, 2, 3, 4, 6, 8)
MAX_PROGRAMS_PER_SM = 6  # past it a split only adds partials to write and sum
ROTATE_BYTES = 256 << 20  # weight copies a timed call cycles through: 5x the H200's L2
HBM_BYTES_PER_S = 4.8e12  # the H200's
BF16 = torch.bfloat16


def us(fn: Callable, *args, rep: int = 30, **kwargs) -> float:
    return do_bench_cudagraph(functools.partial(fn, *args, **kwargs), rep=rep) * 1e3


def full_sweep() -> None:
    for n, k in SHAPES:
        w = torch.randn(n, k, device="cuda") * 0.02
        wq, ws = quantize(w, (128, 128))
        wc, wcs = quantize(w, (1, k))
        w = w.to(BF16)
        for m in TOKENS:
            x = torch.randn(m, k, device="cuda", dtype=BF16)
            xq, xs = quantize_per_token_group(x, 128)
            xcq, xcs = quantize_per_token_group(x, k)
            tiles = {t: us(fp8_scaled_matmul, xq, xs, wq, ws, (128, 128), BF16, config=t) for t in TILES}
            best = min(tiles, key=tiles.get)
            line = (
                f"N={n} K={k} M={m}: bf16 {us(F.linear, x, w):.1f} | quant {us(quantize_per_token_group, x, 128):.1f}"
                f" | block: triton {us(fp8_scaled_matmul, xq, xs, wq, ws, (128, 128), BF16):.1f}"
                f" (best {tiles[best]:.1f} {best})"
            )
            if m % 16 == 0:
                line += f", torch {us(_block_scaled_mm, xq, xs, wq, ws, BF16):.1f}"
            smm = us(torch._scaled_mm, xcq, wc.t(), scale_a=xcs, scale_b=wcs.t(), out_dtype=BF16)
            tri = us(fp8_scaled_matmul, xcq, xcs, wc, wcs, (1, k), BF16)
            line += f" | channel: _scaled_mm {smm:.1f}, triton {tri:.1f}"
            print(line + f" | FP8 weight floor {n * k / HBM_BYTES_PER_S * 1e6:.1f}", flush=True)


def split_configs(m: int, n: int, k: int, sms: int) -> list[Config]:
    """The few-token tiles times the splits that keep programs <= MAX_PROGRAMS_PER_SM per SM and >= 2 groups of
    K per split (one split always), and ``default_config``'s pick."""
    configs = [default_config(m, n, k, sms)]
    for tile, splits in itertools.product(SPLIT_TILES, SPLITS):
        programs = -(-m // tile[0]) * -(-n // tile[1]) * splits
        if splits == 1 or (programs <= MAX_PROGRAMS_PER_SM * sms and k // 128 >= 2 * splits):
            configs.append(Config(*tile, splits))
    return list(dict.fromkeys(configs))


def timed_configs(configs: list, call: Callable, want: torch.Tensor, tol: float, rep: int) -> dict:
    """us of ``call(cfg)()`` for each config whose result is within ``tol`` (relative norm) of ``want``; a config
    that is wrong, or fails to compile or launch, is reported and left out."""
    times = {}
    for cfg in configs:
        try:
            err = ((call(cfg)().to(want.dtype) - want).norm() / want.norm()).item()
            if err > tol:
                print(f"   {tuple(cfg)}: WRONG, relative error {err:.1e}", flush=True)
                continue
            times[cfg] = us(call(cfg), rep=rep)
        except Exception as exc:  # reported, not fatal
            print(f"   {tuple(cfg)}: failed, {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    return times


def short(cfg: Config) -> str:
    return f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} st{cfg.num_stages} split {cfg.split_k}"


def split_case(n: int, k: int, m: int, weights: dict[str, list], sms: int, rep: int) -> str:
    """One shape and token count of ``--split-k``: its line of results."""
    x = torch.randn(m, k, device="cuda", dtype=BF16)
    xq, xs = quantize_per_token_group(x, 128)
    xcq, xcs = quantize_per_token_group(x, k)

    def block_call(cfg: Config) -> Callable[[], torch.Tensor]:
        it = itertools.cycle(weights["block"])
        return lambda: fp8_scaled_matmul(xq, xs, *next(it), (128, 128), BF16, config=cfg)

    def row_call(cfg: Config) -> Callable[[], torch.Tensor]:
        it = itertools.cycle(weights["row"])
        return lambda: fp8_scaled_matmul(xcq, xcs, *next(it), (1, k), BF16, config=cfg)

    default = default_config(m, n, k, sms)
    want = block_call(default._replace(split_k=1))().float()
    # the same sums in another order: rounding apart, no more
    times = timed_configs(split_configs(m, n, k, sms), block_call, want, 1e-3, rep)
    ranked = sorted(times, key=times.get)
    one = [c for c in ranked if c.split_k == 1]
    dense = itertools.cycle(weights["bf16"])
    bf16 = us(lambda: F.linear(x, next(dense)), rep=rep)
    row_default = us(row_call(default), rep=rep)
    row_one = us(row_call(default._replace(split_k=1)), rep=rep)

    def timed(cfgs: list[Config]) -> str:
        return f"{times[cfgs[0]]:.1f} ({short(cfgs[0])})" if cfgs else "none ran"

    return (
        f"{NAMES[n, k]} N={n} K={k} M={m}: floor {n * k / HBM_BYTES_PER_S * 1e6:.1f} | bf16 {bf16:.1f}"
        f" | block: best {timed(ranked)}, default {timed([default] if default in times else [])},"
        f" best of one split {timed(one)} | channel: default {row_default:.1f}, one split {row_one:.1f}"
        f" | next: {', '.join(f'{short(c)} {times[c]:.1f}' for c in ranked[1:4])}"
    )


def split_sweep(tokens: tuple[int, ...], rep: int) -> None:
    sms = num_sms(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}: {sms} SMs; us per call, CUDA graphs, weights rotated", flush=True)
    for n, k in SHAPES:
        w = torch.randn(n, k, device="cuda") * 0.02
        copies = -(-ROTATE_BYTES // (n * k))  # of the FP8 weight's bytes; bf16's take as many copies
        block, row = quantize(w, (128, 128)), quantize(w, (1, k))
        weights = {
            "block": [tuple(t.clone() for t in block) for _ in range(copies)],
            "row": [tuple(t.clone() for t in row) for _ in range(copies)],
            "bf16": [w.to(BF16) for _ in range(copies)],
        }
        del w, block, row
        for m in tokens:
            print(split_case(n, k, m, weights, sms, rep), flush=True)
        del weights
        torch.cuda.empty_cache()


MID_TOKENS = (17, 32, 64, 128, 192, 256)
MID_TILES = [
    (bm, bn, 128, warps, stages)
    for bm, bn, warps, stages in itertools.product((64, 128), (64, 128, 256), (4, 8), (3, 4))
    if warps == 4 or bm * bn >= 64 * 128
] + [(32, 64, 128, 4, 4), (32, 128, 128, 4, 4)]
MID_SPLITS = (1, 2, 3)


def mid_configs(m: int, n: int, sms: int) -> list[Config]:
    """MID_TILES no taller than ``m`` needs, times the splits while the tiles leave SMs idle (<= 4 programs an SM)."""
    configs = []
    for tile, splits in itertools.product(MID_TILES, MID_SPLITS):
        tiles = -(-m // tile[0]) * -(-n // tile[1])
        fits = tile[0] <= max(32, triton.next_power_of_2(m))
        if fits and (splits == 1 or (tiles < sms and tiles * splits <= 4 * sms)):
            configs.append(Config(*tile, splits))
    return configs


def mid_case(n: int, k: int, m: int, blocks: list, dense: list, sms: int, rep: int) -> tuple[str, tuple]:
    """One shape and token count of ``--mid``: its line, and (bf16, quantizer, cuBLASLt, default, best) in us."""
    x = torch.randn(m, k, device="cuda", dtype=BF16)
    xq, xs = quantize_per_token_group(x, 128)
    xp, xps = quantize_per_token_group(x, 128, pad_rows_to=16)
    rotation, rotation_bf16 = itertools.cycle(blocks), itertools.cycle(dense)

    def block_call(cfg: Config) -> Callable[[], torch.Tensor]:
        return lambda: fp8_scaled_matmul(xq, xs, *next(rotation), (128, 128), BF16, config=cfg)

    want = fp8_scaled_matmul(xq, xs, *blocks[0], (128, 128), BF16).float()
    default = default_config(m, n, k, sms)
    times = timed_configs(list(dict.fromkeys([default, *mid_configs(m, n, sms)])), block_call, want, 1e-2, rep)
    ranked = sorted(times, key=times.get)
    row = (
        us(lambda: F.linear(x, next(rotation_bf16)), rep=rep),
        us(lambda: quantize_per_token_group(x, 128), rep=rep),
        us(lambda: _block_scaled_mm(xp, xps, *next(rotation), BF16), rep=rep),
        times.get(default, float("nan")),
        times[ranked[0]],
    )
    line = (
        f"{NAMES[n, k]} N={n} K={k} M={m}: bf16 {row[0]:.1f} | quantizer {row[1]:.1f} | cuBLASLt block {row[2]:.1f}"
        f" | triton default {short(default)} {row[3]:.1f} | best "
        + ", ".join(f"{short(c)} {times[c]:.1f}" for c in ranked[:3])
    )
    return line, row


def mid_sweep(tokens: tuple[int, ...], rep: int) -> None:
    sms = num_sms(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}: {sms} SMs; us per call, CUDA graphs, weights rotated", flush=True)
    totals = {m: [0.0] * 5 for m in tokens}  # bf16, quantizer, cuBLASLt, default, best
    for n, k in SHAPES:
        w = torch.randn(n, k, device="cuda") * 0.02
        copies = -(-ROTATE_BYTES // (n * k))
        block = quantize(w, (128, 128))
        blocks = [tuple(t.clone() for t in block) for _ in range(copies)]
        dense = [w.to(BF16) for _ in range(copies)]
        del w, block
        for m in tokens:
            line, row = mid_case(n, k, m, blocks, dense, sms, rep)
            totals[m] = [t + v for t, v in zip(totals[m], row)]
            print(line, flush=True)
        del blocks, dense
        torch.cuda.empty_cache()
    for m, (bf16, quant, cublas, default, best) in totals.items():
        print(
            f"a layer's four at M={m}: bf16 {bf16:.1f} us, quantizer {quant:.1f}, cuBLASLt {cublas:.1f}, "
            f"triton default {default:.1f}, triton best {best:.1f}",
            flush=True,
        )


GEMV_TILES = tuple(itertools.product((16, 32, 64), (1, 2, 4), (4,), (2, 3, 4)))  # block_n, groups, warps, stages


def gemv_configs(n: int, k: int, sms: int) -> list[GemvConfig]:
    """The weight-streaming kernel's tiles times the splits that keep programs <= 8 per SM and >= 2 steps a
    split (one split always), and ``gemv_config``'s pick first."""
    configs = [gemv_config(n, k, sms)]
    for tile, splits in itertools.product(GEMV_TILES, SPLITS):
        programs = -(-n // tile[0]) * splits
        if splits == 1 or (programs <= 8 * sms and k // (128 * tile[1]) >= 2 * splits):
            configs.append(GemvConfig(*tile, splits))
    return list(dict.fromkeys(configs))


def gemv_case(n: int, k: int, m: int, weights: dict[str, list], sms: int, rep: int) -> tuple[str, float, float]:
    """One shape and token count of ``--gemv``: its line, and the default's and the old path's us."""
    x = torch.randn(m, k, device="cuda", dtype=BF16)
    blocks = itertools.cycle(weights["block"])

    def gemv_call(cfg: GemvConfig) -> Callable[[], torch.Tensor]:
        return lambda: fp8_gemv(x, *next(blocks), (128, 128), config=cfg)

    def old_path() -> torch.Tensor:  # the layer's few-token path before the GEMV: quantize, then the block kernel
        xq, xs = quantize_per_token_group(x, 128)
        return fp8_scaled_matmul(xq, xs, *next(blocks), (128, 128), BF16)

    want = x.double() @ dequantize(*weights["block"][0], (128, 128)).double().T
    times = timed_configs(gemv_configs(n, k, sms), gemv_call, want, 1e-2, rep)  # bf16 output: 1% of the float64
    ranked = sorted(times, key=times.get)
    default = gemv_config(n, k, sms)
    old = us(old_path, rep=rep)
    dense = itertools.cycle(weights["bf16"])
    bf16 = us(lambda: F.linear(x, next(dense)), rep=rep)
    best = ", ".join(f"{tuple(c)} {times[c]:.1f}" for c in ranked[:4])
    line = (
        f"{NAMES[n, k]} N={n} K={k} M={m}: floor {n * k / HBM_BYTES_PER_S * 1e6:.1f} | bf16 {bf16:.1f} | "
        f"quant+block {old:.1f} | gemv default {tuple(default)} {times.get(default, float('nan')):.1f} | best {best}"
    )
    return line, times.get(default, float("nan")), old


def gemv_sweep(tokens: tuple[int, ...], rep: int) -> None:
    sms = num_sms(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}: {sms} SMs; us per call, CUDA graphs, weights rotated", flush=True)
    totals = {m: [0.0, 0.0] for m in tokens}
    for n, k in SHAPES:
        w = torch.randn(n, k, device="cuda") * 0.02
        copies = -(-ROTATE_BYTES // (n * k))
        block = quantize(w, (128, 128))
        weights = {"block": [tuple(t.clone() for t in block) for _ in range(copies)],
                   "bf16": [w.to(BF16) for _ in range(copies)]}  # fmt: skip
        del w, block
        for m in tokens:
            line, default, old = gemv_case(n, k, m, weights, sms, rep)
            totals[m][0] += default
            totals[m][1] += old
            print(line, flush=True)
        del weights
        torch.cuda.empty_cache()
    for m, (default, old) in totals.items():
        print(f"a layer's four at M={m}: gemv default {default:.1f} us, quant+block {old:.1f} us", flush=True)


def layer_chain(rep: int, layers: int = 36, context: int = 400, dtype: str = "fp8", fuse_norms: bool = True) -> float:
    """``--layers``: us a step for a batch-1 chain of Qwen3-8B's layers, attention on a ``context``-token pool
    included, each kernel as the model launches it; ``dtype`` "fp8" (block-scaled weights, the one-token GEMV; o_proj
    and down_proj ending in the norm after them unless not ``fuse_norms``) or "bf16" (F.linear, as the bf16 model
    runs them). Returns the faster of two timings."""
    from nanostream.kernels.decode_attention import paged_decode_attention
    from nanostream.kernels.qkv_prologue import qkv_prologue

    (qkv_n, k), (o_n, _), (gate_up_n, _), (down_n, down_k) = SHAPES
    heads, kv_heads, d, page, eps = 32, 8, 128, 256, 1e-6
    block = (128, 128)

    def weights(n: int, k: int) -> tuple[torch.Tensor, ...]:
        w = torch.randn(n, k, device="cuda") * 0.02
        return quantize(w, block) if dtype == "fp8" else (w.to(BF16),)

    def linear(x: torch.Tensor, w: tuple[torch.Tensor, ...], act: str | None = None) -> torch.Tensor:
        if dtype == "fp8":
            return fp8_gemv(x, *w, block, act=act)
        y = F.linear(x, w[0])
        return silu_and_mul(y) if act else y

    pages = -(-(context + 1) // page)
    stack = [
        dict(qkv=weights(qkv_n, k), o=weights(o_n, k), gate_up=weights(gate_up_n, k), down=weights(down_n, down_k),
             norms=[(1 + 0.1 * torch.randn(k, device="cuda")).to(BF16) for _ in range(2)],
             kv=[torch.randn(pages, page, kv_heads, d, device="cuda", dtype=BF16) for _ in range(2)])
        for _ in range(layers)
    ]  # fmt: skip
    qk_norm = (1 + 0.1 * torch.randn(d, device="cuda")).to(BF16)
    angles = torch.arange(context + 1, device="cuda")[:, None] * 1e-4 ** (torch.arange(d // 2, device="cuda") / d)
    cos, sin = angles.cos(), angles.sin()
    positions = torch.tensor([context], device="cuda")
    slot = positions.clone()
    table = torch.arange(pages, device="cuda", dtype=torch.int32)[None]
    seq_lens = torch.tensor([context + 1], device="cuda", dtype=torch.int32)
    x0, r0 = (torch.randn(1, k, device="cuda", dtype=BF16) for _ in range(2))

    def attention(qkv: torch.Tensor, w: dict) -> torch.Tensor:
        q = qkv_prologue(qkv, positions, cos, sin, qk_norm, qk_norm, eps, *w["kv"], slot, heads, kv_heads)
        return paged_decode_attention(q, *w["kv"], table, seq_lens, d**-0.5, 40960).view(1, heads * d)

    def into_norm(x: torch.Tensor, w: tuple[torch.Tensor, ...], res: torch.Tensor, norm: torch.Tensor):
        # the projection, the residual add and the norm after it: as the model's decoder layer runs them
        if dtype == "fp8" and fuse_norms:
            return fp8_gemv_add_norm(x, *w, block, None, res, norm, eps)
        return rms_norm(linear(x, w), norm, eps, res)

    def step() -> torch.Tensor:
        h, res = rms_norm(x0, stack[0]["norms"][0], eps, r0)
        for i, w in enumerate(stack):
            h, res = into_norm(attention(linear(h, w["qkv"]), w), w["o"], res, w["norms"][1])
            a = linear(h, w["gate_up"], act="silu")
            if i + 1 == len(stack):
                return linear(a, w["down"])
            h, res = into_norm(a, w["down"], res, stack[i + 1]["norms"][0])

    step()
    times = [us(step, rep=rep) for _ in range(2)]
    fused = " (norms fused)" if dtype == "fp8" and fuse_norms else ""
    print(f"{torch.cuda.get_device_name()}: {layers} layers of {dtype}{fused} at one token, {context} tokens of "
          f"context: {' / '.join(f'{t:.1f}' for t in times)} us a step", flush=True)  # fmt: skip
    stack.clear()
    torch.cuda.empty_cache()
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--split-k", action="store_true", help="the few-token split-K sweep alone (about a minute)")
    parser.add_argument("--gemv", action="store_true", help="the weight-streaming kernel's sweep (a few minutes)")
    parser.add_argument("--mid", action="store_true", help="17-256 tokens: Triton tiles and splits against cuBLASLt")
    parser.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=None,
        help="token counts (--split-k: 1 4 16, --gemv: 1 4, --mid: 17 32 64 128 192 256)",
    )
    parser.add_argument("--layers", action="store_true", help="a batch-1 step's 36 layers in one CUDA graph")
    parser.add_argument("--bf16", action="store_true", help="--layers: bf16 weights (F.linear) in place of FP8")
    parser.add_argument("--unfused-norms", action="store_true", help="--layers: the norms as kernels of their own")
    parser.add_argument("--rep", type=int, default=10, help="--split-k's and --gemv's timing per config, ms of replays")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    start = time.perf_counter()
    if args.split_k:
        split_sweep(tuple(args.tokens or SPLIT_TOKENS), args.rep)
    elif args.mid:
        mid_sweep(tuple(args.tokens or MID_TOKENS), args.rep)
    elif args.layers:
        layer_chain(args.rep, dtype="bf16" if args.bf16 else "fp8", fuse_norms=not args.unfused_norms)
    elif args.gemv:
        gemv_sweep(tuple(args.tokens or (1, 4)), args.rep)
    else:
        full_sweep()
    print(f"{time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
