"""The "kernels" section: store_kv, paged decode and paged prefill, ours and FlashAttention-4, checked then timed;
and the "window" section: decode at a 4,096-token context with sliding windows of 128 and 1,024 tokens and
without one, the same way (FA4 with ``window_size``)."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
import statistics
import sys
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from kernel_bench.attention_cases import Batch, Case, attention_cases, make_inputs, rel_error, window_cases
from kernel_bench.harness import (
    DEVICE,
    DTYPE,
    HKV,
    HQ,
    KERNELS,
    MAX_SETS,
    SCALE,
    TOL,
    D,
    check_alive_after,
    l2_bytes,
    need_cuda,
    short,
)
from kernel_bench.report import fmt_impl
from kernel_bench.timing import best_us, time_calls

if TYPE_CHECKING:
    from kernel_bench.run import Run


AttnFn = Callable[[Batch, torch.Tensor, torch.Tensor], torch.Tensor]


PREFILL_SWEEP = [(128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3), (64, 128, 4, 2), (128, 32, 4, 3)]


def attention_impls(case: Case, kernels: dict, fa4: Callable | None) -> dict[str, AttnFn | Exception]:
    """label -> fn(batch, k_cache, v_cache) returning [T, Hq, D], or the import error."""
    impls: dict[str, AttnFn | Exception] = {}
    max_len, max_q = max(case.seq_lens), max(case.q_lens)
    ours = kernels[case.kind]
    # no window: the calls as they were (a kernel without the argument still runs the other cases)
    window = {} if case.window is None else {"window": case.window}
    fa4_window = {} if case.window is None else {"window_size": (case.window - 1, 0)}
    if isinstance(ours, Exception):
        impls["ours"] = ours
    elif case.kind == "decode":

        def run_ours(b, kc, vc):
            res = ours(b.q, kc, vc, b.block_tables, b.seq_lens, SCALE, max_len, out=b.out, **window)
            return b.out if res is None else res

        impls["ours"] = run_ours
    else:

        def run_ours(b, kc, vc, config=None):
            res = ours(
                b.q, kc, vc, b.cu_seqlens_q, b.seq_lens, b.block_tables, max_q, SCALE, out=b.out, config=config,
                **window,
            )  # fmt: skip
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
        for label, extra in (("fa4", fa4_window), ("fa4-split", {"num_splits": 0, **fa4_window})):
            impls[label] = lambda b, kc, vc, extra=extra: unwrap(
                fa4(b.q.unsqueeze(1), kc, vc, seqused_k=b.seq_lens, page_table=b.block_tables,
                    softmax_scale=SCALE, causal=True, **extra)
            )  # fmt: skip
    else:
        impls["fa4"] = lambda b, kc, vc: unwrap(
            fa4(b.q, kc, vc, cu_seqlens_q=b.cu_seqlens_q, max_seqlen_q=max_q, seqused_k=b.seq_lens,
                page_table=b.block_tables, softmax_scale=SCALE, causal=True, **fa4_window)
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
    msgspec), the module is loaded from this checkout's nanostream/kernels/ as a package of its own.
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
                pkg, KERNELS / "__init__.py", submodule_search_locations=[str(KERNELS)]
            )
            mod = importlib.util.module_from_spec(spec)
            sys.modules[pkg] = mod
            spec.loader.exec_module(mod)
        fn = getattr(importlib.import_module(f"{pkg}.{module}"), name)
        print(f"   {module}: nanostream not importable ({short(first)}); loaded from nanostream/kernels/{module}.py")
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


def load_attention_kernels() -> dict[str, Callable | Exception]:
    kernels = {
        "store_kv": load_kernel("store_kv", "store_kv"),
        "decode": load_kernel("decode_attention", "paged_decode_attention"),
        "prefill": load_kernel("prefill_attention", "paged_prefill_attention"),
    }
    for key, fn in kernels.items():
        if isinstance(fn, Exception):
            print(f"   ours {key}: {short(fn)}")
    return kernels


def section_kernels(run: Run) -> None:
    need_cuda()
    run.ceilings()
    kernels = load_attention_kernels()
    fa4 = load_fa4(run)
    torch.manual_seed(run.args.seed)
    for t in (256, 8192):
        run.unit(f"kernels/store_kv T={t}", lambda t=t: bench_store_kv(run, t, kernels["store_kv"]))
    for case in attention_cases(run.args.quick, run.args.seed):
        run.unit(case.uid, lambda case=case: bench_attention(run, case, kernels, fa4))


def section_window(run: Run) -> None:
    """Decode at a 4k context: windows of 128 and 1,024 tokens against full attention. Its rows join the
    summary's decode table (names "... w128", "... full"); TB/s and %copy count the KV the window covers.
    At batch 1 with a 128-token window the MAX_SETS input sets read 32 MB in all, less than an H200's L2:
    that row's times are L2-warm, a lower bound."""
    need_cuda()
    run.ceilings()
    kernels = load_attention_kernels()
    fa4 = load_fa4(run)
    torch.manual_seed(run.args.seed)
    for case in window_cases(run.args.quick):
        run.unit(case.uid, lambda case=case: bench_attention(run, case, kernels, fa4))
