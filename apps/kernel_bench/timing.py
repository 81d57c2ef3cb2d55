"""Timing a list of calls that cycle through input sets: eagerly (host overhead included) and in a CUDA graph."""

from __future__ import annotations

import itertools
import math
import statistics
import traceback
from collections.abc import Callable
from typing import Any

import torch

from kernel_bench.harness import check_alive_after, short


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
