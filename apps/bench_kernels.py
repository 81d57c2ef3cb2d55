"""GPU benchmark of the hot paths: ceilings, attention kernels (vs FlashAttention-4), decode steps, prefill.

Usage::

    python apps/bench_kernels.py                                  # every section
    python apps/bench_kernels.py --sections kernels --quick       # a subset, at smaller sizes
    python apps/bench_kernels.py --only 'decode b256' --out $OUT/bench_kernels.json

Sections (a failure in one prints its error and the next one runs; without CUDA each is skipped):

- ceilings: device-to-device copy bandwidth (bytes read + bytes written) and a bf16 8192^3 matmul's
  TFLOP/s, on random data. Later sections measure against these (measured anyway if not picked).
- kernels: Qwen3-0.6B's attention shape (Hq 16, Hkv 8, D 128, bf16) on a random KV pool whose block
  tables are random permutations: store_kv, paged decode and paged prefill, ours and FlashAttention-4
  (``flash_attn.cute``, when importable) on the same inputs. Each call is timed eagerly
  (``triton.testing.do_bench``, median, L2 flushed before each call: host overhead included) and
  inside a captured CUDA graph that runs calls back to back over input sets that together exceed L2
  (no host overhead): FA4's host overhead is large, so graph times are what the ratios compare.
  Before timing, each implementation's output (poisoned with NaN first) is compared with a float32
  torch reference; the table shows the worst sequence's relative error, BAD over 2e-2 or when not finite.
- steps: decode steps of a random-weight Qwen3-0.6B through ``ModelRunner.execute``, every sequence
  at context 1,024 (KV pool filled with random values), per attention backend, eager and with CUDA
  graphs; floor = (weight bytes + KV bytes read per step) / copy bandwidth.
- prefill: one 8,192-token step (8 fresh prompts of 1,024) through ``ModelRunner.execute``;
  floor = (2 * matmul params * tokens + LM head + attention FLOPs) / matmul rate.
- window: paged decode at a 4,096-token context with sliding windows of 128 and 1,024 tokens and without
  one (batch 1, 8, 64, 256; block size 256), ours and FA4 (``window_size``), checked and timed as in
  kernels; TB/s and %copy count the KV each window covers, so a window should cost its length, not 4k.
- moe: one MoE layer's routed experts (Qwen3-30B-A3B's; Mixtral-8x7B's without --quick) at 1, 16, 64 and 256
  tokens: the fused Triton kernel (its tile table's choice and a sweep of tiles) and the torch path, against
  the floor (the experts the tokens touch, read once, at the copy bandwidth); apps/kernel_bench/moe.py.
- fp8: one linear layer at Qwen3-8B's shapes and 1 to 4,096 tokens: bf16 against the block-scaled FP8 GEMM
  (nanostream.kernels.fp8_gemm, activations quantized in the call) and torch._scaled_mm per channel;
  apps/kernel_bench/fp8.py.
- mla: the paged MLA decode kernel at DeepSeek-V3's latent (512 + 64, bf16) for 16 and 128 heads, 1, 64 and 256
  sequences of ~1k and ~8k tokens, against its byte floor (each entry read once); apps/kernel_bench/mla.py.

A CUDA error that poisons the process (an illegal address in a kernel under development) ends this
process's work: what is left runs in a fresh child process, skipping the unit that crashed.

This file is the entry point (arguments, sections, the main loop); each section lives in apps/kernel_bench/
(harness, timing, ceilings, attention_cases, attention, steps, run, report).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from kernel_bench.attention import section_kernels, section_window
from kernel_bench.ceilings import section_ceilings
from kernel_bench.fp8 import section_fp8
from kernel_bench.harness import ROOT, ContextLost, Skipped, cuda_alive, free_cuda, short
from kernel_bench.mla import section_mla
from kernel_bench.moe import section_moe
from kernel_bench.report import summary
from kernel_bench.run import Run, environment
from kernel_bench.steps import section_prefill, section_steps

SECTIONS = ("ceilings", "kernels", "window", "steps", "prefill", "moe", "fp8", "mla")
SECTION_FNS: dict[str, Callable[[Run], None]] = {
    "ceilings": section_ceilings,
    "kernels": section_kernels,
    "window": section_window,
    "steps": section_steps,
    "prefill": section_prefill,
    "moe": section_moe,
    "fp8": section_fp8,
    "mla": section_mla,
}


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=_Formatter)
    parser.add_argument(
        "--sections", default=",".join(SECTIONS), help="comma-separated subset of " + ", ".join(SECTIONS)
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer cases, for a first try")
    parser.add_argument("--out", help="also write every number as JSON to this file (rewritten after each section)")
    parser.add_argument(
        "--only", help="run only the units whose id matches this regex, e.g. 'decode b256|steps/triton'"
    )
    parser.add_argument(
        "--build-dir", default="/tmp/qwen3-0.6b-random", help="where the random Qwen3-0.6B is built (reused)"
    )
    parser.add_argument("--backends", default="triton,flash_attn", help="attention backends for steps and prefill")
    parser.add_argument("--steps", type=int, default=50, help="timed decode steps per batch size (--quick: at most 10)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    parser.add_argument(
        "--budget",
        type=float,
        default=540.0,
        help="seconds after which no new unit starts, so that the table still prints within a 600 s limit",
    )
    # Internal: how a fresh process continues after a lost CUDA context.
    parser.add_argument("--skip-units", help=argparse.SUPPRESS)
    parser.add_argument("--ceilings-json", help=argparse.SUPPRESS)
    parser.add_argument("--depth", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--no-table", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown or not args.sections:
        parser.error(f"--sections takes a comma-separated subset of {', '.join(SECTIONS)}; got {unknown or 'none'}")
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if args.steps < 1:
        parser.error("--steps must be positive")
    if args.only:
        try:
            re.compile(args.only)
        except re.error as exc:
            parser.error(f"--only is not a valid regex ({exc})")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if importlib.util.find_spec("nanostream") is None:  # a source checkout without PYTHONPATH or install
        sys.path.insert(0, str(ROOT))
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)  # the log interleaves with a child's after a respawn
    run = Run(args, Path(__file__).resolve())
    run.report["env"] = environment()
    print(f"env: {json.dumps(run.report['env'])}")
    for i, name in enumerate(args.sections):
        print(f"\n== {name} ==")
        t = time.perf_counter()
        try:
            SECTION_FNS[name](run)
        except Skipped as exc:
            print(f"{name}: skipped: {exc}")
            run.report["skipped"][name] = str(exc)
        except ContextLost as exc:
            print(f"{name}: CUDA context lost ({exc})")
            run.respawn(args.sections[i:])
            break
        except Exception as exc:  # a section's own setup failed (model build, ...): the next one still runs
            traceback.print_exc()
            run.report["errors"][name] = short(exc)
            if torch.cuda.is_available() and not cuda_alive():
                run.respawn(args.sections[i + 1 :])
                break
        finally:
            free_cuda()
            run.save()
            print(f"== {name}: {time.perf_counter() - t:.1f} s")
    run.save()
    if not args.no_table:
        print(summary(run.report))


if __name__ == "__main__":
    main()
