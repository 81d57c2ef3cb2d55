"""Streaming throughput and latency: apps/bench.py's workload through client processes against one engine process.

Usage::

    python apps/bench_stream.py --threads 1       # tiny model, the full workload, 4 processes × 64 streams
    python apps/bench_stream.py --threads 1 --num-requests 64 --max-input-len 256 \\
        --min-output-len 32 --max-output-len 128 --processes 4 --streams-per-process 16
    python apps/bench_stream.py --model /models/Qwen3-0.6B --stream-interval 4

One run, in this order (so that the two never share the CPU):

1. offline: a child process runs apps/bench.py's ``run_nanostream`` (warm-up, then one timed
   ``LLM.generate`` of the whole workload), reading ``llm.engine.stats()`` just before and after it.
2. streamed: ``EngineProcess`` starts a plain ``nanostream serve`` with the same engine options (and
   ``--stream-interval``; ``--threads`` reaches it, and the client processes, as ``OMP_NUM_THREADS``).
   ``--processes`` client processes each open one ``AsyncClient`` with ``--streams-per-process``
   concurrent streams. Request i goes to stream i mod (processes × streams), and each stream runs its
   requests one after another (one each when the two numbers are equal). Every client process first
   runs its share of 1.'s warm-up requests; once all are done, this process reads the engine's counters
   (``AsyncClient.stats()``) and its CPU time, then the client processes start together.

What is measured, with ``time.perf_counter`` (CLOCK_MONOTONIC: one clock for every process on Linux):

- elapsed: offline, the ``generate`` call; streamed, from the first request sent to the last chunk
  received. Output tok/s counts the tokens each request asked for and received, as apps/bench.py does.
- TTFT: a request's first chunk's arrival − the moment before ``client.stream()`` was called.
- client ITL per token: for each chunk after a request's first, (its arrival − the previous chunk's
  arrival) / tokens in it; one sample per chunk. With --stream-interval 1 a chunk holds one token
  unless the consumer fell behind and the client merged several. Chunk gap: the same, undivided.
  Chunks/s: ``StreamChunk``s received by all clients / elapsed.
- engine side, in both runs: the engine's own counters (``protocol.EngineStats``), the difference of
  the readings before and after the timed run: steps by kind, requests per step (mean batch), wall
  time in ``LLMEngine.step`` (its mean, and p50/p90/p99 as the upper bounds of the
  ``STEP_MS_BUCKETS`` histogram bucket that holds them), and elapsed / steps (the loop's mean period:
  the step plus what the loop does between steps, offline detokenization or the server's routing).
- CPU: the engine process's CPU time over the timed run (offline ``time.process_time()``, streamed
  utime + stime from /proc/PID/stat), the client processes' own, and the whole machine's busy cores
  (/proc/stat); "everything else" = machine − this benchmark's processes.

"Added latency per step" is streamed elapsed / steps − offline elapsed / steps: the loop's period,
each run's wall time from its client's side over its engine's step count, with the same weighting
(every step alike), once through the server and clients, once in-process. Client ITL p50 − offline
mean ``LLMEngine.step`` is printed too; it charges streaming with all the work between steps (the
offline loop has some as well). Before the engine counted for itself (apps/serve_timed.py timed every
step and token from outside), added latency was client ITL p50 − offline per-token gap p50, and a
token's delivery latency (its arrival − the end of its step) was printed: the engine keeps no
per-token times, so both are gone; compare recorded figures of those with care.
``--profile DIR`` writes cProfiles of every client process over the timed run and of the engine's
main thread (its busy loop) over its whole life, start-up and warm-up included (a profiled run is
slower: do not record its figures).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import cProfile
import multiprocessing as mp
import os
import pstats
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import numpy as np
from bench import (
    TEMPERATURE,
    Request,
    Result,
    add_workload_args,
    check_workload_args,
    engine_options,
    load_workload,
    make_warmup,
    model_dir,
    run_nanostream,
)
from tables import format_table

from nanostream import AsyncClient, SamplingParams
from nanostream.cli import add_engine_args
from nanostream.client.launch import EngineProcess
from nanostream.config import ServerConfig
from nanostream.protocol import EngineStats, step_ms_quantile

WARMUP_REQUESTS = 16  # apps/bench.py's warm-up at its default --hf-batch-size
STARTUP_TIMEOUT = 600.0  # s for the client processes to connect and warm up
THROUGHPUT_TARGET = 0.97  # streamed output tok/s ≥ 0.97 × offline, at 4 processes × 64 streams
ADDED_LATENCY_TARGET = 1e-3  # s at p50


def params_of(r: Request) -> SamplingParams:
    return SamplingParams(temperature=TEMPERATURE, ignore_eos=True, max_tokens=r.max_tokens)


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

    def line(self, name: str, output_tokens: int) -> str:
        n = max(self.steps, 1)
        in_steps = self.stats.step_seconds / self.elapsed
        return (
            f"{name}: {self.steps} steps (prefill / decode / mixed {self.kinds()}; {output_tokens / n:.1f} output "
            f"tokens, {self.mean_batch():.1f} requests each); LLMEngine.step mean {1e3 * self.mean_step():.2f} ms, "
            f"p50/p90/p99 ≤ {self.quantiles()} ms (bucket upper bounds); elapsed / steps {1e3 * self.period():.2f} "
            f"ms, {100 * in_steps:.0f}% in steps; engine process {self.cores:.2f} cores; machine {self.machine:.2f} "
            f"of {os.cpu_count()} busy"
        )


# ---- 1. offline ----------------------------------------------------------------------------------


def offline_worker(
    model: Path, workload: list[Request], warmup: list[Request], engine_kwargs: dict, seed: int, threads: int | None
) -> tuple[Result, EngineRun]:
    """apps/bench.py's timed generate, in a process of its own, with the engine's counters read around it."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    readings: list[Reading] = []

    def read(llm) -> None:
        readings.append(Reading(llm.engine.stats(), time.process_time(), machine_jiffies()))

    result = run_nanostream(model, workload, warmup, engine_kwargs, seed, instrument=read, after=read)
    return result, EngineRun.between(*readings, result.elapsed)


def run_offline(args: argparse.Namespace, model: Path, workload, warmup, engine_kwargs) -> tuple[Result, EngineRun]:
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(offline_worker, model, workload, warmup, engine_kwargs, args.seed, args.threads).result()


# ---- 2. streamed: the client processes -----------------------------------------------------------


@dataclass
class Trace:
    """One streamed request as its client saw it (times: ``time.perf_counter()``)."""

    request_id: str  # the client's; the engine's id for it is "<client>/<request_id>"
    max_tokens: int
    sent: float  # just before client.stream()
    arrivals: list[float]  # one per chunk that carried tokens
    counts: list[int]  # tokens in each of those chunks


async def run_stream(client: AsyncClient, requests: list[Request], traces: list[Trace]) -> None:
    """One stream: its requests one after another, every chunk's arrival time recorded."""
    for r in requests:
        arrivals: list[float] = []
        counts: list[int] = []
        sent = time.perf_counter()
        async with client.stream(r.prompt_token_ids, params_of(r)) as stream:
            async for chunk in stream:
                arrivals.append(time.perf_counter())
                counts.append(len(chunk.token_ids))
        keep = [i for i, n in enumerate(counts) if n]  # chunks with tokens only
        trace = Trace(stream.request_id, r.max_tokens, sent, [arrivals[i] for i in keep], [counts[i] for i in keep])
        traces.append(trace)


async def client_main(
    address: str, streams: list[list[Request]], warmup: list[Request], barrier, go, profile: Path | None
) -> tuple[list[Trace], float]:
    """The traces of this process's streams, and its CPU seconds over them."""
    async with AsyncClient(address, timeout=60.0) as client:
        await asyncio.gather(*(client.generate(r.prompt_token_ids, params_of(r)) for r in warmup))
        await asyncio.to_thread(barrier.wait, STARTUP_TIMEOUT)  # the client's reader keeps running meanwhile
        if not await asyncio.to_thread(go.wait, STARTUP_TIMEOUT):  # the engine's counters are read meanwhile
            raise RuntimeError("no start signal after the warm-up")
        traces: list[Trace] = []
        profiler = cProfile.Profile() if profile else None
        cpu = time.process_time()
        if profiler is not None:
            profiler.enable()
        await asyncio.gather(*(run_stream(client, s, traces) for s in streams))
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(profile)
        return traces, time.process_time() - cpu


def client_process(index: int, address: str, streams, warmup, barrier, go, results, profile: Path | None) -> None:
    try:
        results.put((index, asyncio.run(client_main(address, streams, warmup, barrier, go, profile))))
    except BaseException:
        barrier.abort()  # nobody waits forever for a process that is gone
        results.put((index, traceback.format_exc()))


# ---- 2. streamed: the engine and the run ---------------------------------------------------------


def split(workload: list[Request], processes: int, per_process: int) -> list[list[list[Request]]]:
    """[process][stream] -> requests. Request i goes to stream i mod S; stream g = m × processes + p
    is process p's m-th, so consecutive requests also go round-robin over the processes."""
    total = processes * per_process
    return [[workload[m * processes + p :: total] for m in range(per_process)] for p in range(processes)]


def drain(results) -> str:
    """Whatever the client processes reported, without waiting long."""
    found = []
    with contextlib.suppress(queue.Empty):
        while True:
            found.append(str(results.get(timeout=2)[1]))
    return "\n".join(found) or "(nothing reported)"


def collect(procs: list, results) -> dict[int, tuple[list[Trace], float]]:
    """Every client process's report; raises if one failed or died without reporting."""
    collected = {}
    while len(collected) < len(procs):
        try:
            index, report = results.get(timeout=5)
        except queue.Empty:
            dead = [i for i, p in enumerate(procs) if i not in collected and not p.is_alive()]
            if dead:
                raise RuntimeError(f"client process(es) {dead} exited without a result") from None
            continue
        if isinstance(report, str):
            raise RuntimeError(f"client process {index} failed:\n{report}")
        collected[index] = report
    return collected


@dataclass
class Streamed:
    result: Result
    traces: list[Trace]
    client_cpu: float  # s, all client processes together
    engine: EngineRun

    def ttft(self) -> list[float]:
        return [t.arrivals[0] - t.sent for t in self.traces if t.arrivals]

    def itl(self) -> list[float]:
        return [(b - a) / n for t in self.traces for (a, b), n in zip(pairwise(t.arrivals), t.counts[1:])]

    def chunk_gaps(self) -> list[float]:
        return [b - a for t in self.traces for a, b in pairwise(t.arrivals)]

    def chunks(self) -> int:
        return sum(len(t.counts) for t in self.traces)


def engine_counters(address: str) -> EngineStats:
    """The engine's counters now, through a client of this process's own."""

    async def read() -> EngineStats | None:
        async with AsyncClient(address, timeout=60.0) as client:
            return (await client.stats()).engine

    stats = asyncio.run(read())
    if stats is None:
        raise RuntimeError(f"the engine at {address} sent no counters (Stats.engine is None)")
    return stats


def run_streamed(args: argparse.Namespace, model: Path, workload, warmup, engine_kwargs) -> Streamed:
    engine = EngineProcess(str(model), seed=args.seed, stream_interval=args.stream_interval, **engine_kwargs)
    if args.profile:  # the same `serve`, under cProfile: its main thread (the busy loop), its whole life
        if engine.cmd[1:4] != ["-m", "nanostream", "serve"]:
            raise RuntimeError(f"unexpected EngineProcess command {engine.cmd}; update run_streamed")
        engine.cmd[1:2] = ["-m", "cProfile", "-o", str(args.profile / "engine.prof"), "-m"]
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(args.processes + 1)
    go = ctx.Event()
    results = ctx.Queue()
    procs = []
    with engine:
        print(f"streamed: engine pid {engine.pid} at {engine.address}, stream_interval {args.stream_interval}")
        try:
            for i, streams in enumerate(split(workload, args.processes, args.streams_per_process)):
                prof = args.profile / f"client-{i}.prof" if args.profile else None
                work = (i, engine.address, streams, warmup[i :: args.processes], barrier, go, results, prof)
                procs.append(ctx.Process(target=client_process, args=work))
                procs[-1].start()
            try:
                barrier.wait(STARTUP_TIMEOUT)
            except threading.BrokenBarrierError:
                raise RuntimeError("a client process failed before the start:\n" + drain(results)) from None
            # Every warm-up request has finished: the engine is idle until `go`.
            before = Reading(engine_counters(engine.address), process_cpu(engine.pid), machine_jiffies())
            go.set()
            collected = collect(procs, results)
            after = Reading(engine_counters(engine.address), process_cpu(engine.pid), machine_jiffies())
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.terminate()
                proc.join()
    traces = [t for i in range(len(procs)) for t in collected[i][0]]
    start = min(t.sent for t in traces)
    end = max(t.arrivals[-1] for t in traces if t.arrivals)
    received = [sum(t.counts) for t in traces]
    short = sum(n < t.max_tokens for n, t in zip(received, traces))
    if short:
        print(f"warning: {short} streamed request(s) received fewer tokens than max_tokens")
    output_tokens = sum(min(n, t.max_tokens) for n, t in zip(received, traces))
    name = f"streamed ({args.processes} × {args.streams_per_process})"
    result = Result(name, len(workload), sum(len(r.prompt_token_ids) for r in workload), output_tokens, end - start)
    engine_run = EngineRun.between(before, after, result.elapsed)
    return Streamed(result, traces, sum(c[1] for c in collected.values()), engine_run)


# ---- report --------------------------------------------------------------------------------------


def print_profiles(profile_dir: Path, top: int = 12) -> None:
    for name in ("engine.prof", "client-0.prof"):
        path = profile_dir / name
        if path.is_file():
            print(f"== cProfile {path}: top {top} by own time ==")
            pstats.Stats(str(path)).sort_stats("tottime").print_stats(top)


def report(args: argparse.Namespace, offline: Result, off: EngineRun, streamed: Streamed) -> str:
    """The streamed run's details, then the summary table."""
    s, eng = streamed.result, streamed.engine
    ttft, itl = percentiles(streamed.ttft()), percentiles(streamed.itl())
    chunk_gaps = percentiles(streamed.chunk_gaps())
    chunks = streamed.chunks()
    client_cores = streamed.client_cpu / s.elapsed
    ratio = s.output_tps / offline.output_tps
    added = eng.period() - off.period()
    other = eng.machine - eng.cores - client_cores
    lines = [
        eng.line("streamed engine", s.output_tokens),
        f"streamed clients: {chunks} chunks, {chunks / s.elapsed:.0f} chunks/s, {s.output_tokens / chunks:.2f} "
        f"tokens per chunk; client processes {client_cores:.2f} cores in all",
        f"TTFT p50/p90/p99: {ms(ttft)} ms",
        f"client ITL per token p50/p90/p99: {ms(itl)} ms; chunk gap p50/p90/p99: {ms(chunk_gaps)} ms",
        f"added latency per step = streamed elapsed / steps − offline elapsed / steps = {1e3 * eng.period():.2f} − "
        f"{1e3 * off.period():.2f} = {1e3 * added:.2f} ms",
        f"client ITL p50 − offline mean LLMEngine.step = {1e3 * itl[0]:.2f} − {1e3 * off.mean_step():.2f} = "
        f"{1e3 * (itl[0] - off.mean_step()):.2f} ms",
    ]
    verdict = lambda ok: "met" if ok else "MISSED"
    rows = [
        ("", "streamed", "offline", "target", "result"),
        ("output tok/s", f"{s.output_tps:.1f}", f"{offline.output_tps:.1f}", f"≥ {THROUGHPUT_TARGET}x", ""),
        ("  streamed / offline", f"{ratio:.3f}x", "", "", verdict(ratio >= THROUGHPUT_TARGET)),
        ("elapsed s", f"{s.elapsed:.2f}", f"{offline.elapsed:.2f}", "", ""),
        ("engine steps", str(eng.steps), str(off.steps), "", ""),
        ("  prefill / decode / mixed", eng.kinds(), off.kinds(), "", ""),
        ("mean batch (requests/step)", f"{eng.mean_batch():.1f}", f"{off.mean_batch():.1f}", "", ""),
        ("LLMEngine.step mean ms", f"{1e3 * eng.mean_step():.2f}", f"{1e3 * off.mean_step():.2f}", "", ""),
        ("LLMEngine.step p50/p90/p99 ms ≤", eng.quantiles(), off.quantiles(), "bucket bounds", ""),
        ("elapsed / step ms", f"{1e3 * eng.period():.2f}", f"{1e3 * off.period():.2f}", "", ""),
        ("client ITL/token p50/p90/p99 ms", ms(itl), "", "", ""),
        ("added latency/step ms", f"{1e3 * added:.2f}", "", f"< {1e3 * ADDED_LATENCY_TARGET:g}", ""),
        ("  (streamed − offline elapsed / step)", "", "", "", verdict(added < ADDED_LATENCY_TARGET)),
        ("TTFT p50/p90/p99 ms", ms(ttft), "", "", ""),
        ("chunks/s received", f"{chunks / s.elapsed:.0f}", "", "", ""),
        ("CPU cores: engine process", f"{eng.cores:.2f}", f"{off.cores:.2f}", "", ""),
        ("CPU cores: client processes", f"{client_cores:.2f}", "", "", ""),
        ("CPU cores: everything else", f"{other:.2f}", f"{off.machine - off.cores:.2f}", f"of {os.cpu_count()}", ""),
    ]
    head = f"== summary: {args.processes} processes × {args.streams_per_process} streams, "
    head += f"{s.num_requests} requests, {s.output_tokens} output tokens, stream_interval {args.stream_interval} =="
    return "\n".join([*lines, head, *format_table(rows)])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add_workload_args(parser)
    clients = parser.add_argument_group("clients")
    clients.add_argument("--processes", type=int, default=4, help="client processes")
    clients.add_argument("--streams-per-process", type=int, default=64, help="concurrent streams in each")
    clients.add_argument(
        "--stream-interval",
        type=int,
        default=ServerConfig.stream_interval,
        help="the engine's stream_interval: send a request's tokens every N tokens",
    )
    clients.add_argument("--profile", type=Path, help="write cProfiles of the engine and the clients into this dir")
    add_engine_args(parser, skip=("seed",))
    args = parser.parse_args(argv)
    check_workload_args(parser, args)
    if args.processes < 1 or args.streams_per_process < 1 or args.stream_interval < 1:
        parser.error("--processes, --streams-per-process and --stream-interval must be positive")
    if args.processes * args.streams_per_process > args.num_requests:
        parser.error(
            f"{args.processes} × {args.streams_per_process} streams but only {args.num_requests} requests: "
            "lower --processes or --streams-per-process, or raise --num-requests"
        )
    if args.profile:
        args.profile = args.profile.resolve()
        args.profile.mkdir(parents=True, exist_ok=True)
    return args


def main(argv: list[str] | None = None) -> None:
    import torch

    args = parse_args(argv)
    engine_kwargs = engine_options(args)
    if args.threads:
        torch.set_num_threads(args.threads)  # for the env line; the offline engine sets its own
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the engine process's: `serve` has no option for it
    with model_dir(args) as model:
        hf_config, _, workload = load_workload(args, model, engine_kwargs)
        warmup = make_warmup(args.seed, hf_config.vocab_size, WARMUP_REQUESTS)
        offline, offline_engine = run_offline(args, model, workload, warmup, engine_kwargs)
        print(offline.line())
        print(offline_engine.line("offline engine", offline.output_tokens))
        streamed = run_streamed(args, model, workload, warmup, engine_kwargs)
        print(streamed.result.line())
    if args.profile:
        print_profiles(args.profile)
    print(report(args, offline, offline_engine, streamed))


if __name__ == "__main__":
    main()
