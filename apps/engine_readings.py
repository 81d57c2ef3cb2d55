"""What the streaming benchmarks read from the engine and the machine: the engine's counters
(``protocol.EngineStats``) around a timed run, process and machine CPU time from /proc."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from nanostream.protocol import EngineStats, step_ms_quantile


def percentiles(values: list[float]) -> tuple[float, float, float]:
    """p50, p90, p99 (nan when there are no values)."""
    if not values:
        return float("nan"), float("nan"), float("nan")
    return tuple(float(v) for v in np.percentile(values, [50, 90, 99]))


def ms(values: tuple[float, ...]) -> str:
    return " / ".join(f"{1e3 * v:.2f}" for v in values)


def machine_jiffies() -> tuple[int, int]:
    """(busy, total) CPU time of the whole machine so far, in clock ticks, from /proc/stat (0, 0 off Linux)."""
    try:
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return 0, 0
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)  # less idle and iowait; guest time is in user


def busy_cores(before: tuple[int, int], after: tuple[int, int]) -> float:
    """Cores the whole machine kept busy between two ``machine_jiffies()`` (nan when unknown)."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total * (os.cpu_count() or 1) if total > 0 else float("nan")


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (Linux; just ``pid`` elsewhere)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def process_cpu(pid: int) -> float:
    """CPU seconds process ``pid`` has used so far, all its threads: utime + stime from /proc/PID/stat
    (nan off Linux)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # after the command name
    except (OSError, IndexError):
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # fields 14 and 15 of proc(5)


def window(before: EngineStats, after: EngineStats) -> EngineStats:
    """The engine's counters of the window between two readings."""

    def diff(a, b):
        if isinstance(a, dict):
            return {k: v - b.get(k, 0) for k, v in a.items()}
        if isinstance(a, list):
            return [x - y for x, y in zip(a, b)]
        return a - b

    return EngineStats(**{f: diff(getattr(after, f), getattr(before, f)) for f in EngineStats.__struct_fields__})


@dataclass
class Reading:
    """One moment of a run: the engine's counters, its process's CPU seconds, the machine's jiffies."""

    stats: EngineStats
    cpu: float
    machine: tuple[int, int]
    time: float = field(default_factory=time.perf_counter)


@dataclass
class EngineRun:
    """One timed run, seen from the engine: its counters over the run, and the CPU it and the machine used."""

    stats: EngineStats  # the window's: after − before
    elapsed: float  # s, the run's, from its client's side (offline: the generate call)
    cores: float  # the engine process's CPU time (all its threads) / wall time, between the two readings
    machine: float  # cores the whole machine kept busy: every process, this benchmark's and others'

    @classmethod
    def between(cls, before: Reading, after: Reading, elapsed: float) -> EngineRun:
        cores = (after.cpu - before.cpu) / (after.time - before.time)
        return cls(window(before.stats, after.stats), elapsed, cores, busy_cores(before.machine, after.machine))

    @property
    def steps(self) -> int:
        return sum(self.stats.steps.values())

    def kinds(self) -> str:
        return " / ".join(str(self.stats.steps.get(k, 0)) for k in ("prefill", "decode", "mixed"))

    def mean_step(self) -> float:
        return self.stats.step_seconds / max(self.steps, 1)

    def period(self) -> float:
        """s, elapsed / steps: the loop's mean period."""
        return self.elapsed / max(self.steps, 1)

    def mean_batch(self) -> float:
        return self.stats.scheduled_requests / max(self.steps, 1)

    def quantiles(self) -> str:
        return " / ".join(f"{step_ms_quantile(self.stats.step_ms_buckets, q):g}" for q in (0.5, 0.9, 0.99))

    def host_ms(self) -> float:
        """ms per step the host spent in LLMEngine.step other than waiting for the device."""
        return 1e3 * (self.stats.step_seconds - self.stats.device_wait_seconds) / max(self.steps, 1)

    def first_token_means(self) -> tuple[float, float]:
        """The engine's part of the time to first token, mean s per request: in its queue, then from its
        first step to that token read back."""
        st, n = self.stats, max(self.stats.first_tokens, 1)
        return st.queue_seconds / n, st.prefill_seconds / n

    def first_token_split(self) -> str:
        queue, prefill = self.first_token_means()
        return f"queue {1e3 * queue:.0f} + prefill {1e3 * prefill:.0f} ms"

    def wait_ms(self) -> float:
        """ms per step the host waited for the device (near 0: the device waits for the host)."""
        return 1e3 * self.stats.device_wait_seconds / max(self.steps, 1)
