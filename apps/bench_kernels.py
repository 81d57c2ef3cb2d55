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

A CUDA error that poisons the process (an illegal address in a kernel under development) ends this
process's work: what is left runs in a fresh child process, skipping the unit that crashed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib
import importlib.util
import itertools
import json
import math
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

APPS = Path(__file__).resolve().parent
ROOT = APPS.parent
if importlib.util.find_spec("nanostream") is None:  # a source checkout without PYTHONPATH or install
    sys.path.insert(0, str(ROOT))
if str(APPS) not in sys.path:  # for `from bench import ...`, as apps/bench_stream.py does
    sys.path.insert(0, str(APPS))

SECTIONS = ("ceilings", "kernels", "steps", "prefill")
HQ, HKV, D = 16, 8, 128  # Qwen3-0.6B's attention
DTYPE = torch.bfloat16
DEVICE = "cuda"
SCALE = D**-0.5
DEFAULT_L2_BYTES = 60 << 20  # H200; the device's own figure is used when torch reports it
MAX_SETS = 64  # input sets one timing cycles through
TOL = 2e-2  # relative error vs float32: bf16 operands land between 1e-3 and 1e-2
STEP_CONTEXT = 1024
STEP_LLM_KWARGS = dict(max_num_seqs=256, max_model_len=4096)
MAX_RESPAWNS = 4


class Skipped(Exception):
    """A section that cannot run on this machine."""


class Unavailable(Exception):
    """A unit that cannot run with this configuration (an attention backend that will not construct)."""


class ContextLost(Exception):
    """A sticky CUDA error (illegal address, ...): nothing more can run in this process."""


def need_cuda() -> None:
    if not torch.cuda.is_available():
        raise Skipped("needs CUDA")


def cuda_alive() -> bool:
    try:
        torch.cuda.synchronize()
        return torch.ones(1, device=DEVICE).add_(1).item() == 2.0
    except Exception:
        return False


def free_cuda() -> None:
    gc.collect()
    if torch.cuda.is_available():
        with contextlib.suppress(Exception):  # a lost context: ContextLost is already on its way
            torch.cuda.empty_cache()


def short(exc: BaseException) -> str:
    """One line for the table: the exception's first line (and its last, for multi-line compiler errors)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = " | ".join(lines[:1] + lines[-1:]) if len(lines) > 1 else (lines[0] if lines else "")
    return f"{type(exc).__name__}: {text}"[:240]


def check_alive_after(exc: BaseException) -> None:
    """Raise ContextLost if ``exc`` left the CUDA context unusable."""
    if torch.cuda.is_available() and not cuda_alive():
        raise ContextLost(short(exc)) from exc


def l2_bytes() -> int:
    return getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or DEFAULT_L2_BYTES


# ---- timing ------------------------------------------------------------------------------------


def time_eager_us(calls: list[Callable[[], Any]]) -> float:
    """Median µs of one call launched from Python (host overhead included), L2 flushed before each."""
    from triton.testing import do_bench

    cycle = itertools.cycle(calls)
    return do_bench(lambda: next(cycle)(), warmup=25, rep=200, return_mode="median") * 1e3


def time_graph_us(calls: list[Callable[[], Any]], estimate_us: float) -> float:
    """Median µs of one call inside a captured CUDA graph of calls back to back (no host overhead).

    The graph cycles through the input sets (together bigger than L2) for about 2 ms per replay.
    """
    reps = max(1, min(256 // len(calls), math.ceil(2000 / max(estimate_us, 1.0) / len(calls))))
    seq = calls * reps
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles, allocator) on a side stream, as torch's docs ask
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in seq:
            call()
    graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(12)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    ms = statistics.median(start.elapsed_time(end) for start, end in events[2:])
    del graph
    return ms * 1e3 / len(seq)


def time_calls(row: dict, calls: list[Callable[[], Any]]) -> None:
    """Fill row's eager_us and graph_us (or *_error); a sticky CUDA error raises ContextLost."""
    try:
        row["eager_us"] = time_eager_us(calls)
    except Exception as exc:
        row["eager_error"] = short(exc)
        traceback.print_exc()
        check_alive_after(exc)
    try:
        row["graph_us"] = time_graph_us(calls, row.get("eager_us", 100.0))
    except Exception as exc:
        row["graph_error"] = short(exc)
        print(f"   graph capture failed: {short(exc)}")
        check_alive_after(exc)


def best_us(row: dict | None) -> float | None:
    """Graph time when there is one (what is compared), else eager."""
    if not row:
        return None
    return row.get("graph_us", row.get("eager_us"))


# ---- ceilings ----------------------------------------------------------------------------------


def copy_ms(nbytes: int) -> float:
    """Median ms of a device-to-device copy of nbytes (random values)."""
    from triton.testing import do_bench

    src = torch.empty(nbytes // 2, dtype=DTYPE, device=DEVICE).normal_()
    dst = torch.empty_like(src)
    return do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")


def matmul_ms(n: int) -> float:
    """Median ms of a bf16 n x n x n matmul on random values."""
    from triton.testing import do_bench

    a, b = (torch.randn(n, n, dtype=DTYPE, device=DEVICE) for _ in range(2))
    c = torch.empty(n, n, dtype=DTYPE, device=DEVICE)
    return do_bench(lambda: torch.matmul(a, b, out=c), warmup=50, rep=300, return_mode="median")


def measure_ceilings(quick: bool) -> dict:
    """Each ceiling measured twice (the spread is the noise); the faster run is the ceiling."""
    nbytes = (512 << 20) if quick else (2 << 30)  # per buffer
    copy_tbs = [2 * nbytes / (copy_ms(nbytes) * 1e-3) / 1e12 for _ in range(2)]
    free_cuda()
    n = 4096 if quick else 8192
    tflops = [2 * n**3 / (matmul_ms(n) * 1e-3) / 1e12 for _ in range(2)]
    free_cuda()
    return {
        "copy_tbs": max(copy_tbs),
        "copy_tbs_runs": copy_tbs,
        "copy_buffer_bytes": nbytes,
        "matmul_tflops": max(tflops),
        "matmul_tflops_runs": tflops,
        "matmul_n": n,
    }


# ---- attention kernels -------------------------------------------------------------------------


def causal_pairs(q_len: int, seq_len: int) -> int:
    """(query, key) pairs attended when q_len queries are the last of seq_len tokens."""
    return q_len * (seq_len - q_len) + q_len * (q_len + 1) // 2


@dataclass(frozen=True)
class Case:
    kind: str  # "decode" | "prefill"
    name: str
    block_size: int
    seq_lens: tuple[int, ...]  # context of each sequence, new tokens included
    q_lens: tuple[int, ...]  # new (query) tokens: the last q_lens[i] of each context

    @property
    def uid(self) -> str:
        return f"kernels/{self.kind} {self.name} bs{self.block_size}"

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    @property
    def kv_bytes(self) -> int:  # each context's K and V read once
        return sum(self.seq_lens) * HKV * D * 2 * DTYPE.itemsize

    @property
    def io_bytes(self) -> int:  # + q read, out written, block tables and lengths
        width = -(-max(self.seq_lens) // self.block_size)
        return self.kv_bytes + 2 * self.num_tokens * HQ * D * DTYPE.itemsize + 4 * len(self.seq_lens) * (width + 2)

    @property
    def flops(self) -> int:  # QK^T and PV: 2 * D each per (query, key) pair and head
        return 4 * D * HQ * sum(causal_pairs(q, n) for q, n in zip(self.q_lens, self.seq_lens))


def attention_cases(quick: bool, seed: int) -> list[Case]:
    rng = random.Random(seed)
    half = [rng.randint(100, 2132) for _ in range(128)]
    mixed = [*half, *(100 + 2132 - n for n in half)]  # uniform over 100..2132, mean exactly 1,116
    rng.shuffle(mixed)
    mixed = tuple(mixed)
    mixed_name = f"b256 ctx~{round(statistics.mean(mixed))}"
    cases = []
    for bs in (256, 16):
        shapes = [(mixed_name, mixed)]
        if not quick:
            shapes += [(f"b{b} ctx1024", (1024,) * b) for b in (1, 8, 64, 256)] + [("b8 ctx32768", (32768,) * 8)]
        elif bs == 256:
            shapes += [("b1 ctx1024", (1024,)), ("b64 ctx1024", (1024,) * 64)]
        cases += [Case("decode", name, bs, lens, (1,) * len(lens)) for name, lens in shapes]
    prefills = [("8x1024", 8, 1024, 0), ("4x2048+2048", 4, 2048, 2048), ("2x4096", 2, 4096, 0)]
    for name, b, new, prefix in prefills[:1] if quick else prefills:
        cases.append(Case("prefill", name, 256, (prefix + new,) * b, (new,) * b))
    return cases


@dataclass
class Batch:
    """One input set; every set of a case shares the pool but has its own blocks and queries."""

    q: torch.Tensor  # [T, Hq, D]
    block_tables: torch.Tensor  # [B, W] int32, padded with 0
    seq_lens: torch.Tensor  # [B] int32
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    out: torch.Tensor  # [T, Hq, D], where our kernels write
    cu_host: list[int]


def make_inputs(case: Case) -> tuple[torch.Tensor, torch.Tensor, list[Batch]]:
    """A random KV pool and enough input sets to exceed L2 four times over (at most MAX_SETS)."""
    bs = case.block_size
    per_seq = [-(-n // bs) for n in case.seq_lens]
    blocks_per_set = sum(per_seq)
    set_bytes = case.kv_bytes + 2 * case.num_tokens * HQ * D * DTYPE.itemsize
    n_sets = max(1, min(MAX_SETS, math.ceil(4 * l2_bytes() / set_bytes)))
    num_blocks = n_sets * blocks_per_set
    k_cache = torch.randn(num_blocks, bs, HKV, D, dtype=DTYPE, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks).tolist()  # each set's blocks scattered over the whole pool
    width = max(per_seq)
    cu = [0, *itertools.accumulate(case.q_lens)]
    seq_lens = torch.tensor(case.seq_lens, dtype=torch.int32, device=DEVICE)
    cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    batches = []
    for s in range(n_sets):
        ids = iter(perm[s * blocks_per_set : (s + 1) * blocks_per_set])
        rows = [[next(ids) for _ in range(p)] + [0] * (width - p) for p in per_seq]
        q = torch.randn(case.num_tokens, HQ, D, dtype=DTYPE, device=DEVICE)
        table = torch.tensor(rows, dtype=torch.int32, device=DEVICE)
        batches.append(Batch(q, table, seq_lens, cu_seqlens, torch.empty_like(q), cu))
    return k_cache, v_cache, batches


def reference(q: torch.Tensor, k_cache, v_cache, table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """float32 attention of q [Lq, Hq, D], the last Lq positions of a seq_len context, over its pool blocks."""
    bs = k_cache.shape[1]
    blocks = table[: -(-seq_len // bs)].long()
    k = k_cache[blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(HQ // HKV, dim=1)  # [L, Hq, D]
    v = v_cache[blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(HQ // HKV, dim=1)
    lq = q.shape[0]
    mask = torch.ones(lq, seq_len, dtype=torch.bool, device=q.device).tril(seq_len - lq)  # bottom-right causal
    o = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=SCALE
    )
    return o.transpose(0, 1)


def rel_error(out: torch.Tensor, case: Case, batch: Batch, k_cache, v_cache) -> tuple[float, bool]:
    """(the largest ‖out − ref‖ / ‖ref‖ of any sequence, every element of out finite)."""
    finite = bool(torch.isfinite(out).all())
    worst = 0.0
    for i, seq_len in enumerate(case.seq_lens):
        start, end = batch.cu_host[i], batch.cu_host[i + 1]
        ref = reference(batch.q[start:end], k_cache, v_cache, batch.block_tables[i], seq_len)
        err = ((out[start:end].float() - ref).norm() / ref.norm()).item()
        worst = err if math.isnan(err) else max(worst, err)
        if math.isnan(worst):
            break
    return worst, finite


AttnFn = Callable[[Batch, torch.Tensor, torch.Tensor], torch.Tensor]


PREFILL_SWEEP = [(128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3), (64, 128, 4, 2), (128, 32, 4, 3)]


def attention_impls(case: Case, kernels: dict, fa4: Callable | None) -> dict[str, AttnFn | Exception]:
    """label -> fn(batch, k_cache, v_cache) returning [T, Hq, D], or the import error."""
    impls: dict[str, AttnFn | Exception] = {}
    max_len, max_q = max(case.seq_lens), max(case.q_lens)
    ours = kernels[case.kind]
    if isinstance(ours, Exception):
        impls["ours"] = ours
    elif case.kind == "decode":

        def run_ours(b, kc, vc):
            res = ours(b.q, kc, vc, b.block_tables, b.seq_lens, SCALE, max_len, out=b.out)
            return b.out if res is None else res

        impls["ours"] = run_ours
    else:

        def run_ours(b, kc, vc, config=None):
            res = ours(b.q, kc, vc, b.cu_seqlens_q, b.seq_lens, b.block_tables, max_q, SCALE, out=b.out, config=config)
            return b.out if res is None else res

        impls["ours"] = run_ours
        for config in PREFILL_SWEEP:  # other tile shapes (BLOCK_M, BLOCK_N, warps, stages), to pick the default
            impls["ours[{}x{} w{} s{}]".format(*config)] = functools.partial(run_ours, config=config)
    if fa4 is None:
        return impls

    def unwrap(res) -> torch.Tensor:
        return (res[0] if isinstance(res, tuple) else res).reshape(-1, HQ, D)

    if case.kind == "decode":
        # FA4's default is one split over the KV length; num_splits=0 asks for its own heuristic.
        for label, extra in (("fa4", {}), ("fa4-split", {"num_splits": 0})):
            impls[label] = lambda b, kc, vc, extra=extra: unwrap(
                fa4(b.q.unsqueeze(1), kc, vc, seqused_k=b.seq_lens, page_table=b.block_tables,
                    softmax_scale=SCALE, causal=True, **extra)
            )  # fmt: skip
    else:
        impls["fa4"] = lambda b, kc, vc: unwrap(
            fa4(b.q, kc, vc, cu_seqlens_q=b.cu_seqlens_q, max_seqlen_q=max_q, seqused_k=b.seq_lens,
                page_table=b.block_tables, softmax_scale=SCALE, causal=True)
        )  # fmt: skip
    return impls


def bench_attention(run: Run, case: Case, kernels: dict, fa4: Callable | None) -> None:
    ceil = run.ceilings()
    row: dict[str, Any] = {
        "kind": case.kind,
        "case": case.name,
        "block_size": case.block_size,
        "batch": len(case.seq_lens),
        "mean_ctx": statistics.mean(case.seq_lens),
        "tokens": case.num_tokens,
        "io_bytes": case.io_bytes,
        "flops": case.flops,
        "impls": {},
    }
    run.report["attention"].append(row)  # filled in place: a crash part-way keeps what was measured
    k_cache, v_cache, batches = make_inputs(case)
    row["input_sets"] = len(batches)
    for label, fn in attention_impls(case, kernels, fa4).items():
        res: dict[str, Any] = {}
        row["impls"][label] = res
        if isinstance(fn, Exception):
            res["error"] = f"import: {short(fn)}"
            continue
        try:  # check first, on fresh random inputs, with our output poisoned
            batches[0].out.fill_(float("nan"))
            out = fn(batches[0], k_cache, v_cache)
            torch.cuda.synchronize()
            res["err"], res["finite"] = rel_error(out, case, batches[0], k_cache, v_cache)
            res["ok"] = res["finite"] and res["err"] < TOL
            del out
        except Exception as exc:
            res["error"] = short(exc)
            traceback.print_exc()
            check_alive_after(exc)
            continue
        time_calls(res, [functools.partial(fn, b, k_cache, v_cache) for b in batches])
        t = best_us(res)
        if t and case.kind == "decode":
            res["tbs"] = case.io_bytes / (t * 1e-6) / 1e12
            res["frac_copy"] = res["tbs"] / ceil["copy_tbs"] if ceil else None
        elif t:
            res["tflops"] = case.flops / (t * 1e-6) / 1e12
            res["frac_matmul"] = res["tflops"] / ceil["matmul_tflops"] if ceil else None
        print(f"   {label}: {fmt_impl(res)}")


def bench_store_kv(run: Run, num_tokens: int, store_kv: Callable | Exception) -> None:
    ceil = run.ceilings()
    row_bytes = HKV * D * DTYPE.itemsize
    io_bytes = 4 * num_tokens * row_bytes + 8 * num_tokens  # read k, v; write them; read the slots
    row: dict[str, Any] = {"tokens": num_tokens, "io_bytes": io_bytes}
    run.report["store_kv"].append(row)
    if isinstance(store_kv, Exception):
        row["error"] = f"import: {short(store_kv)}"
        return
    n_sets = max(1, min(MAX_SETS, math.ceil(4 * l2_bytes() / io_bytes)))
    bs = 256
    num_blocks = -(-2 * n_sets * num_tokens // bs)  # a pool twice what is written: slots scattered over it
    k_cache = torch.randn(num_blocks, bs, HKV, D, dtype=DTYPE, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks * bs, device=DEVICE)
    sets = [
        (
            torch.randn(num_tokens, HKV, D, dtype=DTYPE, device=DEVICE),
            torch.randn(num_tokens, HKV, D, dtype=DTYPE, device=DEVICE),
            perm[s * num_tokens : (s + 1) * num_tokens].contiguous(),
        )
        for s in range(n_sets)
    ]
    row["input_sets"] = n_sets
    k, v, slots = sets[0]
    k_flat, v_flat = k_cache.view(-1, HKV, D), v_cache.view(-1, HKV, D)
    k_flat[slots] = float("nan")  # poison the destination rows
    v_flat[slots] = float("nan")
    store_kv(k, v, k_cache, v_cache, slots)
    torch.cuda.synchronize()
    row["ok"] = bool(torch.equal(k_flat[slots], k) and torch.equal(v_flat[slots], v))
    time_calls(row, [functools.partial(store_kv, k, v, k_cache, v_cache, s) for k, v, s in sets])
    t = best_us(row)
    if t:
        row["gbs"] = io_bytes / (t * 1e-6) / 1e9
        row["frac_copy"] = row["gbs"] / 1e3 / ceil["copy_tbs"] if ceil else None
    print(f"   store_kv T={num_tokens}: {fmt_impl(row)}")


def load_kernel(module: str, name: str) -> Callable | Exception:
    """``nanostream.kernels.<module>.<name>``, or the exception that stopped it.

    Where ``nanostream`` itself cannot be imported (the GPU machine may lack the client's pyzmq and
    msgspec), the module is loaded from this checkout's kernels/ as a package of its own.
    """
    try:
        return getattr(importlib.import_module(f"nanostream.kernels.{module}"), name)
    except Exception as exc:
        first = exc
    if isinstance(first, ModuleNotFoundError) and first.name == f"nanostream.kernels.{module}":
        return first  # the kernel does not exist (yet)
    try:
        pkg = "_nanostream_kernels_src"
        if pkg not in sys.modules:
            spec = importlib.util.spec_from_file_location(
                pkg, ROOT / "kernels" / "__init__.py", submodule_search_locations=[str(ROOT / "kernels")]
            )
            mod = importlib.util.module_from_spec(spec)
            sys.modules[pkg] = mod
            spec.loader.exec_module(mod)
        fn = getattr(importlib.import_module(f"{pkg}.{module}"), name)
        print(f"   {module}: nanostream not importable ({short(first)}); loaded from kernels/{module}.py")
        return fn
    except Exception:
        return first


def load_fa4(run: Run) -> Callable | None:
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception as exc:
        run.report["notes"].append(f"FA4 not importable: {short(exc)}")
        print(f"   FA4 not importable: {short(exc)}")
        return None
    return flash_attn_varlen_func


def section_kernels(run: Run) -> None:
    need_cuda()
    run.ceilings()
    kernels = {
        "store_kv": load_kernel("store_kv", "store_kv"),
        "decode": load_kernel("decode_attention", "paged_decode_attention"),
        "prefill": load_kernel("prefill_attention", "paged_prefill_attention"),
    }
    for key, fn in kernels.items():
        if isinstance(fn, Exception):
            print(f"   ours {key}: {short(fn)}")
    fa4 = load_fa4(run)
    torch.manual_seed(run.args.seed)
    for t in (256, 8192):
        run.unit(f"kernels/store_kv T={t}", lambda t=t: bench_store_kv(run, t, kernels["store_kv"]))
    for case in attention_cases(run.args.quick, run.args.seed):
        run.unit(case.uid, lambda case=case: bench_attention(run, case, kernels, fa4))


# ---- whole-model steps -------------------------------------------------------------------------


def make_llm(path: Path, backend: str, eager: bool):
    from nanostream import LLM

    t = time.perf_counter()
    try:
        llm = LLM(str(path), enforce_eager=eager, attention_backend=backend, **STEP_LLM_KWARGS)
    except Exception as exc:
        check_alive_after(exc)
        raise Unavailable(f"LLM(attention_backend={backend!r}, enforce_eager={eager}) failed: {short(exc)}") from exc
    runner = llm.engine.runner
    print(
        f"   LLM({backend}, enforce_eager={eager}): backend {runner.backend.name}, {runner.num_kv_blocks} KV "
        f"blocks of {runner.block_size}, CUDA graphs {uses_graphs(runner)}, built in {time.perf_counter() - t:.1f} s"
    )
    return llm


def uses_graphs(runner) -> bool:
    return getattr(runner, "graphs", None) is not None


def make_chunks(runner, batch: int, ctx: int, new: int, seed: int) -> list:
    """``batch`` sequences of ``ctx`` random tokens whose first ``ctx - new`` are already computed.

    Blocks are disjoint and drawn at random from the runner's pool (the engine's block manager is
    not involved: nothing else runs).
    """
    from nanostream.engine.scheduler import ScheduledChunk
    from nanostream.engine.sequence import Sequence
    from nanostream.sampling_params import SamplingParams

    per = -(-ctx // runner.block_size)
    if batch * per > runner.num_kv_blocks:
        raise RuntimeError(
            f"{batch} sequences of {ctx} tokens need {batch * per} KV blocks; the pool has {runner.num_kv_blocks}"
        )
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(runner.num_kv_blocks, generator=gen)[: batch * per].tolist()
    ids = torch.randint(runner.vocab_size, (batch, ctx), generator=gen).tolist()
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=1)
    chunks = []
    for i in range(batch):
        seq = Sequence(f"bench-{i}", ids[i], params, max_tokens=1, sampling_seed=i, stop_token_ids=frozenset())
        seq.num_computed_tokens = ctx - new
        seq.block_table = blocks[i * per : (i + 1) * per]
        chunks.append(ScheduledChunk(seq, new))  # start = ctx - new; samples: the chunk reaches the end
    return chunks


def time_execute(runner, chunks: list, steps: int, warmup: int) -> list[float]:
    """Seconds of each of ``steps`` calls of ``runner.execute(chunks)``, synchronized around each."""
    for _ in range(warmup):
        runner.execute(chunks)
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        runner.execute(chunks)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times


def randomize_kv(runner) -> None:
    """Random K/V over the whole pool: attention should not read the zeros the pool starts with."""
    try:
        for cache in runner.kv_caches:
            cache.k.normal_()
            cache.v.normal_()
    except Exception as exc:
        print(f"   KV pool left as allocated (cannot fill it: {short(exc)})")


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # tied embeddings counted once


def bench_steps(run: Run, path: Path, backend: str, eager: bool, batches: tuple[int, ...]) -> None:
    ceil = run.ceilings()
    llm = make_llm(path, backend, eager)
    try:
        runner = llm.engine.runner
        randomize_kv(runner)
        spec = runner.spec
        kv_token_bytes = spec.num_layers * spec.num_kv_heads * spec.head_dim * 2 * runner.dtype.itemsize
        steps = min(run.args.steps, 10) if run.args.quick else run.args.steps
        for batch in batches:
            row: dict[str, Any] = {"backend": backend, "mode": "eager" if eager else "graph", "batch": batch}
            row["cuda_graphs"] = uses_graphs(runner)
            run.report["steps"].append(row)
            try:
                chunks = make_chunks(runner, batch, STEP_CONTEXT, 1, run.args.seed + batch)
                times = time_execute(runner, chunks, steps, warmup=5)
            except Exception as exc:
                row["error"] = short(exc)
                traceback.print_exc()
                check_alive_after(exc)
                continue
            row["ms"] = statistics.median(times) * 1e3
            row["min_ms"] = min(times) * 1e3
            row["tok_s"] = batch / (row["ms"] * 1e-3)
            row["bytes"] = weight_bytes(runner.model) + batch * STEP_CONTEXT * kv_token_bytes
            row["floor_ms"] = row["bytes"] / (ceil["copy_tbs"] * 1e12) * 1e3 if ceil else None
            print(f"   B={batch}: {row['ms']:.3f} ms/step (min {row['min_ms']:.3f}), {row['tok_s']:.0f} tok/s")
    finally:
        del llm


def section_steps(run: Run) -> None:
    need_cuda()
    path = run.model_path()
    batches = (1, 64) if run.args.quick else (1, 8, 64, 256)
    for backend in run.args.backends:
        for eager in (True, False):
            uid = f"steps/{backend}/{'eager' if eager else 'graph'}"
            run.unit(uid, lambda b=backend, e=eager: bench_steps(run, path, b, e, batches))


def prefill_flops(runner, seq_lens: list[int], q_lens: list[int]) -> int:
    """Matmul FLOPs of one prefill step: linears over every token, the LM head over the last ones, attention."""
    spec = runner.spec
    linear = sum(p.numel() for p in runner.model.parameters() if p.dim() == 2 and p.shape[0] != spec.vocab_size)
    head = 2 * spec.vocab_size * spec.hidden_size * len(seq_lens)
    pairs = sum(causal_pairs(q, n) for q, n in zip(q_lens, seq_lens))
    return 2 * linear * sum(q_lens) + head + spec.num_layers * 4 * spec.head_dim * spec.num_heads * pairs


def bench_prefill(run: Run, path: Path, backend: str) -> None:
    ceil = run.ceilings()
    num_seqs, length = 8, 1024
    llm = make_llm(path, backend, eager=True)  # prefill steps run eagerly either way
    row: dict[str, Any] = {"backend": backend, "seqs": num_seqs, "len": length, "tokens": num_seqs * length}
    run.report["prefill"].append(row)
    try:
        runner = llm.engine.runner
        chunks = make_chunks(runner, num_seqs, length, length, run.args.seed)
        times = time_execute(runner, chunks, 3 if run.args.quick else 7, warmup=2)
        row["ms"] = statistics.median(times) * 1e3
        row["tok_s"] = row["tokens"] / (row["ms"] * 1e-3)
        row["flops"] = prefill_flops(runner, [length] * num_seqs, [length] * num_seqs)
        row["floor_ms"] = row["flops"] / (ceil["matmul_tflops"] * 1e12) * 1e3 if ceil else None
        print(f"   {backend}: {row['ms']:.2f} ms per {row['tokens']}-token step, {row['tok_s']:.0f} tok/s")
    finally:
        del llm


def section_prefill(run: Run) -> None:
    need_cuda()
    path = run.model_path()
    for backend in run.args.backends:
        run.unit(f"prefill/{backend}", lambda b=backend: bench_prefill(run, path, b))


def section_ceilings(run: Run) -> None:
    need_cuda()

    def measure() -> None:
        run.report["ceilings"] = measure_ceilings(run.args.quick)

    run.unit("ceilings", measure)
    c = run.report["ceilings"]
    if c:
        print(f"   copy {c['copy_tbs']:.2f} TB/s, bf16 matmul {c['matmul_n']}^3 {c['matmul_tflops']:.0f} TFLOP/s")


SECTION_FNS: dict[str, Callable[[Run], None]] = {
    "ceilings": section_ceilings,
    "kernels": section_kernels,
    "steps": section_steps,
    "prefill": section_prefill,
}


# ---- the run: units, report, recovery ----------------------------------------------------------


class Run:
    """The report being built, and which units (one case, one engine) are done."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.report: dict[str, Any] = {
            "argv": sys.argv[1:],
            "env": {},
            "ceilings": json.loads(args.ceilings_json) if args.ceilings_json else {},
            "store_kv": [],
            "attention": [],
            "steps": [],
            "prefill": [],
            "errors": {},
            "skipped": {},
            "notes": [],
        }
        self.done: list[str] = []
        self.skip = set(json.loads(args.skip_units)) if args.skip_units else set()
        self._model: Path | None = None
        self.start = time.monotonic()

    def unit(self, uid: str, fn: Callable[[], None]) -> None:
        """Run one unit of work; its error is recorded and the next unit runs (unless CUDA is lost)."""
        if uid in self.skip or (self.args.only and not re.search(self.args.only, uid)):
            return
        if self.remaining() <= 0:
            print(f"-- {uid}: skipped, over the --budget of {self.args.budget:.0f} s")
            self.report["skipped"][uid] = "over the time budget"
            return
        print(f"-- {uid}", flush=True)
        t = time.perf_counter()
        try:
            fn()
        except ContextLost:
            self.report["errors"].setdefault(uid, "CUDA context lost")
            raise
        except Unavailable as exc:
            print(f"   skipped: {exc}")
            self.report["skipped"][uid] = str(exc)
        except Exception as exc:
            traceback.print_exc()
            self.report["errors"][uid] = short(exc)
            check_alive_after(exc)
        finally:
            self.done.append(uid)
            free_cuda()
            self.save()
            print(f"   ({time.perf_counter() - t:.1f} s)", flush=True)

    def remaining(self) -> float:
        return self.args.budget - (time.monotonic() - self.start)

    def ceilings(self) -> dict | None:
        """The measured ceilings, measuring them now if no earlier section did; None if that fails."""
        if not self.report["ceilings"]:
            try:
                self.report["ceilings"] = measure_ceilings(self.args.quick)
            except Exception as exc:
                self.report["errors"]["ceilings"] = short(exc)
                check_alive_after(exc)
                return None
        return self.report["ceilings"]

    def model_path(self) -> Path:
        """The Qwen3-0.6B-shaped random model in --build-dir, built on first use (apps/bench.py's logic)."""
        if self._model is None:
            from bench import model_dir

            spec = SimpleNamespace(model=None, preset="qwen3-0.6b", tiny_config={}, build_dir=self.args.build_dir)
            with model_dir(spec) as path:  # a build dir is kept on exit
                self._model = path
        return self._model

    def save(self) -> None:
        if self.args.out:
            out = Path(self.args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(self.report, indent=1, default=str))

    def respawn(self, sections: list[str]) -> None:
        """Run ``sections`` in a fresh process, skipping the units done here (the crashed one too); merge."""
        if self.args.depth >= MAX_RESPAWNS:
            self.report["notes"].append(f"CUDA context lost; {MAX_RESPAWNS} fresh processes already: stopping")
            return
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "report.json"
            a = self.args
            cmd = [sys.executable, str(Path(__file__).resolve()), "--sections", ",".join(sections)]
            cmd += ["--build-dir", a.build_dir, "--backends", ",".join(a.backends), "--steps", str(a.steps)]
            cmd += ["--seed", str(a.seed), "--budget", str(max(0.0, self.remaining())), "--out", str(out)]
            cmd += ["--depth", str(a.depth + 1), "--no-table"]
            cmd += ["--skip-units", json.dumps(sorted(self.skip | set(self.done)))]
            cmd += ["--ceilings-json", json.dumps(self.report["ceilings"])] if self.report["ceilings"] else []
            cmd += ["--quick"] if a.quick else []
            cmd += ["--only", a.only] if a.only else []
            print(f"== continuing in a fresh process: {' '.join(sections)} ==", flush=True)
            rc = subprocess.call(cmd)
            if not out.is_file():
                self.report["errors"]["respawn"] = f"the fresh process exited {rc} without a report"
                return
            child = json.loads(out.read_text())
        for key, value in child.items():
            if isinstance(value, list) and key != "argv":
                self.report[key].extend(value)
            elif isinstance(value, dict) and key in ("errors", "skipped"):
                self.report[key].update(value)
        self.report["ceilings"] = self.report["ceilings"] or child.get("ceilings", {})
        self.report["notes"].append(f"continued in a fresh process after a lost CUDA context (exit {rc})")


def environment() -> dict:
    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception as exc:
        env["triton"] = short(exc)
    try:
        from importlib.metadata import version

        env["flash_attn_4"] = version("flash-attn-4")
    except Exception:
        env["flash_attn_4"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = props.name
        env["gpu_memory_gb"] = round(props.total_memory / 1e9, 1)
        env["sms"] = props.multi_processor_count
        env["l2_mb"] = round(l2_bytes() / 2**20, 1)
    else:
        env["gpu"] = None
    return env


# ---- the final table ---------------------------------------------------------------------------


def fmt(x: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def fmt_err(res: dict | None) -> str:
    if not res:
        return "-"
    if "error" in res:
        return "ERR"
    if "err" not in res:
        return "-"
    return f"{res['err']:.1e}" + ("" if res.get("ok") else " BAD")


def fmt_impl(res: dict) -> str:
    if "error" in res:
        return res["error"]
    parts = [f"graph {fmt(res.get('graph_us'))} µs", f"eager {fmt(res.get('eager_us'))} µs"]
    parts += [f"{k} {res[k]:.3g}" for k in ("tbs", "tflops", "gbs", "err") if res.get(k) is not None]
    parts += [] if res.get("ok", True) else ["WRONG"]
    return ", ".join(parts)


def table(rows: list[list[str]]) -> list[str]:
    """Plain-text lines: the first column left-aligned, the others right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join([r[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(r[1:], widths[1:]))]) for r in rows]


def best_fa4(impls: dict) -> tuple[str | None, dict | None]:
    timed = [(best_us(r), k, r) for k, r in impls.items() if k.startswith("fa4") and best_us(r)]
    if not timed:
        return None, impls.get("fa4")
    _, label, res = min(timed, key=lambda x: x[0])
    return label, res


def ratio(fa4: dict | None, ours: dict | None) -> str:
    """ours / FA4 throughput: graph to graph when both were captured, else eager to eager."""
    if not fa4 or not ours:
        return "-"
    key = "graph_us" if "graph_us" in fa4 and "graph_us" in ours else "eager_us"
    if key not in fa4 or key not in ours:
        return "-"
    return f"{fa4[key] / ours[key]:.2f}x" + ("" if key == "graph_us" else " (eager)")


def summary(report: dict) -> str:
    env = report["env"]
    lines = ["", "== bench_kernels summary =="]
    lines.append(
        f"{env.get('gpu')}; torch {env.get('torch')} (cuda {env.get('cuda')}), triton {env.get('triton')}, "
        f"FA4 {env.get('flash_attn_4')}"
    )
    c = report["ceilings"]
    if c:
        lines.append(
            f"ceilings: copy {c['copy_tbs']:.2f} TB/s (read + write, {c['copy_buffer_bytes'] / 1e9:.1f} GB buffers), "
            f"bf16 matmul {c['matmul_n']}^3 {c['matmul_tflops']:.0f} TFLOP/s"
        )
    if report["store_kv"]:
        rows = [["store_kv", "graph µs", "eager µs", "GB/s", "%copy", "check"]]
        for r in report["store_kv"]:
            check = "ERR" if "error" in r else ("ok" if r.get("ok") else "BAD")
            rows.append([
                f"T={r['tokens']}", fmt(r.get("graph_us")), fmt(r.get("eager_us")), fmt(r.get("gbs"), ".0f"),
                fmt(r.get("frac_copy") and 100 * r["frac_copy"], ".0f"), check,
            ])  # fmt: skip
        lines += ["", *table(rows)]
    for kind, unit, key, frac in (("decode", "TB/s", "tbs", "%copy"), ("prefill", "TFLOP/s", "tflops", "%mm")):
        cases = [r for r in report["attention"] if r["kind"] == kind]
        if not cases:
            continue
        head = [kind, "bs", "ours µs", "eager", unit, frac, "fa4 µs", "eager", unit, "fa4", "ours/fa4",
                "err ours", "err fa4"]  # fmt: skip
        rows = [head]
        for r in cases:
            ours = r["impls"].get("ours")
            label, fa4 = best_fa4(r["impls"])
            f = (ours or {}).get("frac_copy" if kind == "decode" else "frac_matmul")
            rows.append([
                r["case"], str(r["block_size"]), fmt(best_us(ours)), fmt((ours or {}).get("eager_us")),
                fmt((ours or {}).get(key), ".2f" if kind == "decode" else ".0f"), fmt(f and 100 * f, ".0f"),
                fmt(best_us(fa4)), fmt((fa4 or {}).get("eager_us")),
                fmt((fa4 or {}).get(key), ".2f" if kind == "decode" else ".0f"), label or "-",
                ratio(fa4, ours), fmt_err(ours), fmt_err(fa4),
            ])  # fmt: skip
        lines += ["", *table(rows)]
    if report["attention"]:
        lines.append("(µs: per call in a graph replay, else eager; eager: do_bench median, host overhead included)")
    if report["steps"]:
        rows = [
            [
                f"decode step (ctx {STEP_CONTEXT})",
                "B",
                "eager ms",
                "graph ms",
                "tok/s",
                "floor ms",
                "%floor",
                "eager/graph",
            ]
        ]
        for backend, batch in dict.fromkeys((r["backend"], r["batch"]) for r in report["steps"]):
            by_mode = {r["mode"]: r for r in report["steps"] if (r["backend"], r["batch"]) == (backend, batch)}
            e, g = by_mode.get("eager", {}).get("ms"), by_mode.get("graph", {}).get("ms")
            best = min((x for x in (e, g) if x), default=None)
            floor = next((r.get("floor_ms") for r in by_mode.values() if r.get("floor_ms")), None)
            no_graphs = "graph" in by_mode and not by_mode["graph"].get("cuda_graphs", True)
            rows.append([
                backend, str(batch), fmt(e, ".3f"), fmt(g, ".3f", "*" if no_graphs else ""),
                fmt(best and batch / best * 1e3, ".0f"),
                fmt(floor, ".3f"), fmt(floor and best and 100 * floor / best, ".0f"), fmt(e and g and e / g, ".2f"),
            ])  # fmt: skip
        lines += ["", *table(rows)]
        if any(r["mode"] == "graph" and not r.get("cuda_graphs", True) for r in report["steps"]):
            lines.append("(* no CUDA graphs were captured: enforce_eager=False ran eagerly)")
    if report["prefill"]:
        rows = [["prefill step", "tokens", "ms", "tok/s", "floor ms", "%floor"]]
        for r in report["prefill"]:
            ms, floor = r.get("ms"), r.get("floor_ms")
            rows.append([
                r["backend"], str(r["tokens"]), fmt(ms, ".2f"), fmt(r.get("tok_s"), ".0f"), fmt(floor, ".2f"),
                fmt(ms and floor and 100 * floor / ms, ".0f"),
            ])  # fmt: skip
        lines += ["", *table(rows)]
    for name, why in report["skipped"].items():
        lines.append(f"skipped {name}: {why}")
    if report["errors"]:
        lines += ["", "errors:"] + [f"  {uid}: {msg[:200]}" for uid, msg in report["errors"].items()]
    lines += [f"note: {n}" for n in report["notes"]]
    return "\n".join(lines)


# ---- command line ------------------------------------------------------------------------------


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
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)  # the log interleaves with a child's after a respawn
    run = Run(args)
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
