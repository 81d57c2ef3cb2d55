"""``nanostream serve`` with every ``LLMEngine.step`` timed: the engine side of apps/bench_stream.py.

    python apps/serve_timed.py --out STEPS.json [--threads N] [--cprofile PROF] serve [MODEL] [serve options]

SIGUSR1 opens the measurement window, SIGUSR2 closes it. On shutdown (SIGTERM, as ``EngineProcess.stop``
sends) STEPS.json gets ``StepTimer``'s records, in ``time.perf_counter()`` seconds (CLOCK_MONOTONIC on
Linux, so comparable with other processes' clocks), and the window's wall and process CPU seconds. ``--cprofile``
profiles the busy loop (the main thread only: not the io and encoder threads) inside the window.
The engine itself is untouched: this only wraps ``LLMEngine.step`` at class level before it starts.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import signal
import sys
import time
from array import array
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path


class StepTimer:
    """Times an engine's ``step``: each step's (start, end), and when each request's tokens came out.

    A token comes out at the end of the step that produced it: on the engine's side, before any
    routing, encoding or transport. Offline and in the engine process alike.
    """

    def __init__(self) -> None:
        self.steps = array("d")  # start, end, start, end, ...
        self.tokens: dict[str, array] = {}  # request id -> its tokens' step ends, one per token

    def wrap(self, step: Callable) -> Callable:
        def timed_step(*args):  # ~0.1 µs per request in the batch, against steps of milliseconds
            start = time.perf_counter()
            result = step(*args)
            end = time.perf_counter()
            self.steps.extend((start, end))
            tokens = self.tokens
            for delta in result.deltas:
                times = tokens.get(delta.request_id)
                if times is None:
                    times = tokens[delta.request_id] = array("d")
                times.extend([end] * len(delta.token_ids))
            return result

        return timed_step

    def window(self, start: float, end: float) -> tuple[list[float], list[float]]:
        """Inside [start, end]: each step's duration, and each token's gap since its request's previous one."""
        durations = [e - s for s, e in zip(self.steps[::2], self.steps[1::2]) if start <= s and e <= end]
        gaps = [b - a for t in self.tokens.values() for a, b in pairwise(t) if start <= b <= end]
        return durations, gaps

    def to_json(self) -> dict:
        return {"steps": list(self.steps), "tokens": {rid: list(t) for rid, t in self.tokens.items()}}

    @classmethod
    def from_json(cls, data: dict) -> StepTimer:
        timer = cls()
        timer.steps.extend(data["steps"])
        timer.tokens = {rid: array("d", t) for rid, t in data["tokens"].items()}
        return timer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file for the step times and the window's CPU time")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads before the engine starts")
    parser.add_argument("--cprofile", help="write a cProfile of the busy loop, inside the window, here")
    parser.add_argument("serve_argv", nargs=argparse.REMAINDER, help="`serve` and its arguments")
    args = parser.parse_args()

    import torch

    from nanostream import cli
    from nanostream.engine.llm_engine import LLMEngine

    if args.threads:
        torch.set_num_threads(args.threads)
    timer = StepTimer()
    LLMEngine.step = timer.wrap(LLMEngine.step)
    window: dict[str, float] = {}
    profiler = cProfile.Profile() if args.cprofile else None

    def open_window(*_: object) -> None:
        window.update(start=time.perf_counter(), cpu_start=time.process_time())
        if profiler is not None:
            profiler.enable()  # signal handlers run in the main thread: the busy loop's

    def close_window(*_: object) -> None:
        if profiler is not None:
            profiler.disable()
        window.update(end=time.perf_counter(), cpu_end=time.process_time())

    signal.signal(signal.SIGUSR1, open_window)
    signal.signal(signal.SIGUSR2, close_window)
    try:
        return cli.main(args.serve_argv)
    finally:
        if profiler is not None:
            profiler.dump_stats(args.cprofile)
        wall = window.get("end", 0.0) - window.get("start", 0.0)
        cpu = window.get("cpu_end", 0.0) - window.get("cpu_start", 0.0)
        Path(args.out).write_text(json.dumps({**timer.to_json(), "window_wall": wall, "window_cpu": cpu}))


if __name__ == "__main__":
    sys.exit(main())
