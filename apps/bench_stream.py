"""Streaming throughput and latency: the bench workload (apps/workload.py) through client processes against one
engine process, in several rounds and shapes, against the offline ``LLM`` on the same workload.

Usage::

    python apps/bench_stream.py --threads 1 --num-requests 64 --max-input-len 256 \\
        --min-output-len 32 --max-output-len 128 --shapes 4x16 --runs 2     # a quick look on a CPU
    python apps/bench_stream.py --model DIR --shapes 4x64,8x32 --runs 5    # the recorded runs
    python apps/bench_stream.py --model DIR --shapes 4x64 --runs 3 --http-workers 4   # and through HTTP
    python apps/bench_stream.py --model DIR --shapes 4x64 --runs 2 --http-workers 2,8 --http-only \\
        --stream-interval 4                          # HTTP only, with 2 then 8 frontend workers
    python apps/bench_stream.py --model DIR --shapes 4x64 --runs 3 --http-workers 8 --http-only \\
        --http-api completions,responses,messages    # each route in turn, all on the dialects' prompt ids

What runs, in this order (the two never share the machine):

1. offline: a child process builds one ``LLM``, warms it up, and times ``--runs`` ``generate`` calls,
   reading ``llm.engine.stats()`` around each; then it steps the engine itself over one more copy of
   the workload, to time each request's first token (the offline TTFT: all requests queued at once).
2. streamed: ``EngineProcess`` starts ``nanostream serve`` with the same engine options. For each
   shape P×S, P client processes each run S concurrent streams (request i goes to stream i mod P×S;
   a stream runs its requests one after another), ``--runs`` rounds, the engine's counters read
   around each. Then, with ``--http-workers W[,W...]``, for each W in turn, ``--runs`` rounds of the
   first shape through ``nanostream frontend openai --workers W`` on the same engine, as server-sent
   events (read with aiohttp, as ``vllm bench serve`` reads them, where it is installed; else with
   httpx). ``--http-only`` skips the AsyncClient rounds (not the offline runs: the ratios need them).

Every run and round has a workload of its own: the bench workload's lengths with fresh prompt ids (the
first offline run: exactly apps/bench.py's), so that the prefix cache helps none of them.

Per round: output tok/s and streamed ÷ offline (the median of the offline runs), TTFT p50 (request
sent → first chunk) and the prompt phase's pace (when the requests holding 10, 50 and 90% of the
prompt tokens had their first tokens, from the first send; offline: from the first add), delivery
p50 (a chunk's arrival − the end of the engine step that produced its newest token; client mode; in
brackets its wire part, up to the client's reader taking the message off its socket, the rest being
that process's event loop), tokens per chunk or SSE event, elapsed / engine steps (the loop's period),
the engine's host time and device wait per step (``EngineStats.device_wait_seconds``: near 0 means
the device waited for the host), the CPU cores of the engine, clients and frontend, and the
frontend's CPU µs per output token (what ``--stream-interval`` saves it). One HTTP table per worker
count.
``--profile DIR`` writes cProfiles of the engine's busy loop (its whole life) and of each client's
last round (a profiled run is slower: do not record its figures).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import gc
import multiprocessing as mp
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

from engine_readings import EngineRun, Reading, machine_jiffies, percentiles, process_cpu, process_tree
from stream_clients import (
    APIS,
    STARTUP_TIMEOUT,
    Target,
    Trace,
    as_served,
    client_process,
    free_port,
    openai_frontend,
    wait_healthy,
)
from tables import format_table
from workload import (
    Request,
    add_workload_args,
    check_workload_args,
    engine_options,
    load_workload,
    make_warmup,
    model_dir,
    params_of,
    round_workload,
    sync,
)

from nanostream import LLM, AsyncClient
from nanostream.client.launch import READY, EngineProcess
from nanostream.config import ServerConfig
from nanostream.options import add_engine_args
from nanostream.protocol import EngineStats
from nanostream.service import openai_workers

WARMUP_REQUESTS = 16  # apps/bench.py's warm-up at its default --hf-batch-size
THROUGHPUT_TARGET = 0.98  # streamed output tok/s ≥ 0.98 × offline through AsyncClient
HTTP_TARGET = 0.9  # through the OpenAI frontend
DELIVERY_TARGET = 1e-3  # s, p50


# ---- 1. offline ----------------------------------------------------------------------------------


@dataclass
class Offline:
    runs: list[tuple[float, int, EngineRun]]  # (elapsed s, output tokens, engine counters) per round
    ttft: list[float]  # s, each request's first token after all were queued
    ttft_split: str = ""  # that run's engine part of it (EngineRun.first_token_split)
    pace: str = ""  # that run's prompt_pace


PACE_SHARES = (0.1, 0.5, 0.9)


def prompt_pace(firsts: list[tuple[float, int]]) -> str:
    """``firsts``: (a request's first token, s after the start; its prompt tokens). When the requests
    holding 10, 50 and 90% of the prompt tokens had their first tokens: the start of the prompt phase
    and the pace of it, which a TTFT p50 alone mixes together."""
    if not firsts:
        return ""
    firsts = sorted(firsts)
    total, done, marks, shares = sum(n for _, n in firsts), 0, [], list(PACE_SHARES)
    for at, n in firsts:
        done += n
        while shares and done >= shares[0] * total:
            marks.append(at)
            shares.pop(0)
    return "first tokens for 10/50/90% of the prompt tokens at " + " / ".join(f"{1e3 * m:.0f}" for m in marks) + " ms"


def offline_worker(model: Path, rounds: list[list[Request]], warmup, engine_kwargs, seed, threads) -> Offline:
    import torch

    if threads:
        torch.set_num_threads(threads)
    llm = LLM(str(model), seed=seed, **engine_kwargs)
    llm.generate([r.prompt_token_ids for r in warmup], [params_of(r) for r in warmup], use_tqdm=False)
    gc.collect()
    gc.freeze()  # as `nanostream serve` does
    runs = []
    for workload in rounds[:-1]:
        before = Reading(llm.engine.stats(), time.process_time(), machine_jiffies())
        sync(llm.config.device)
        start = time.perf_counter()
        outputs = llm.generate([r.prompt_token_ids for r in workload], [params_of(r) for r in workload], use_tqdm=False)
        sync(llm.config.device)
        elapsed = time.perf_counter() - start
        after = Reading(llm.engine.stats(), time.process_time(), machine_jiffies())
        tokens = sum(min(len(o.token_ids), r.max_tokens) for o, r in zip(outputs, workload))
        runs.append((elapsed, tokens, EngineRun.between(before, after, elapsed)))
        run = runs[-1][2]
        prompts = sum(len(r.prompt_token_ids) for r in workload)
        print(
            f"offline run {len(runs) - 1}: {tokens / elapsed:,.0f} out tok/s, {prompts:,} prompt tokens, "
            f"{run.steps} steps, period {1e3 * run.period():.2f} ms, host {run.host_ms():.2f} + device wait "
            f"{run.wait_ms():.2f} ms/step, "
            f"first token: {run.first_token_split()}",
            flush=True,
        )
    # The offline TTFT: every request queued at once, the engine stepped until each has a token. The
    # clock starts before the requests are added, as generate()'s would, and as a streamed request's
    # starts before it is sent: admitting them is part of the time to the first tokens.
    engine, first = llm.engine, {}
    before = Reading(engine.stats(), time.process_time(), machine_jiffies())
    start = time.perf_counter()
    for i, r in enumerate(rounds[-1]):
        engine.add_request(f"ttft-{i}", r.prompt_token_ids, params_of(r))
    while engine.has_unfinished():
        now = None
        for delta in engine.step().deltas:
            if delta.token_ids and delta.request_id not in first:
                first[delta.request_id] = (now := now or time.perf_counter()) - start
    after = Reading(engine.stats(), time.process_time(), machine_jiffies())
    split = EngineRun.between(before, after, time.perf_counter() - start).first_token_split()
    pace = prompt_pace([(first[f"ttft-{i}"], len(r.prompt_token_ids)) for i, r in enumerate(rounds[-1])])
    return Offline(runs, list(first.values()), split, pace)


def run_offline(args, model: Path, rounds, warmup, engine_kwargs) -> Offline:
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(offline_worker, model, rounds, warmup, engine_kwargs, args.seed, args.threads).result()


# ---- 2. streamed ---------------------------------------------------------------------------------


@dataclass
class Round:
    shape: str
    index: int
    traces: list[Trace]
    client_cpu: float  # s, all client processes
    engine: EngineRun
    workers: int = 0  # the frontend's; 0: through AsyncClient
    frontend_cpu: float = float("nan")  # s, all frontend processes
    frontend_cores: float = float("nan")
    # Per client process: when it sent its first request, and when the first request of its last stream
    # (perf_counter s): how late a process came to the start, and how long it took to send its burst.
    sends: list[tuple[float, float]] = field(default_factory=list)
    collector_pauses: list[float] = field(default_factory=list)  # s, the client processes' full GC passes

    @property
    def elapsed(self) -> float:
        return self.engine.elapsed

    def output_tokens(self) -> int:
        return sum(min(t.tokens, t.max_tokens) for t in self.traces)

    def ttft(self) -> list[float]:
        return [t.arrivals[0] - t.sent for t in self.traces if t.arrivals]

    def ttft_parts(self) -> str:
        """The mean TTFT taken apart: the Add's way in (sent -> the engine took it: what the rest leaves),
        the engine's queue and prefill (its own counters), the first token's way out (its delivery)."""
        firsts = [(t.arrivals[0] - t.sent, t.delivery[0]) for t in self.traces if t.delivery]
        if not firsts or not self.engine.stats.first_tokens:
            return ""
        queue, prefill = self.engine.first_token_means()
        ttft, out = (sum(x) / len(firsts) for x in zip(*firsts))
        parts = (ttft, ttft - queue - prefill - out, queue, prefill, out)
        return "; TTFT mean {:.1f} ms = in {:.1f} + queue {:.1f} + prefill {:.1f} + out {:.1f}".format(
            *(1e3 * x for x in parts)
        )

    def chunks(self) -> int:
        return sum(len(t.arrivals) for t in self.traces)

    def prompt_pace(self) -> str:
        """``prompt_pace`` from the round's first send."""
        start = min(t.sent for t in self.traces)
        return prompt_pace([(t.arrivals[0] - start, t.prompt_tokens) for t in self.traces if t.arrivals])

    def send_spread(self) -> str:
        """How far apart the client processes began sending, and the longest a process took to send
        the first request of each of its streams (the burst a round starts with)."""
        if not self.sends:
            return ""
        began = [first for first, _ in self.sends]
        burst = max(last - first for first, last in self.sends)
        text = f"; sends: processes began within {1e3 * (max(began) - min(began)):.1f} ms, burst ≤ {1e3 * burst:.1f} ms"
        if self.collector_pauses:
            text += f"; client full GC passes: {', '.join(f'{1e3 * p:.0f}' for p in self.collector_pauses)} ms"
        return text

    def label(self) -> str:
        return f"{self.shape} w{self.workers}" if self.workers else self.shape


def split(workload: list[Request], processes: int, per_process: int) -> list[list[list[Request]]]:
    """[process][stream] -> requests. Request i goes to stream i mod S; stream g = m × processes + p
    is process p's m-th, so consecutive requests also go round-robin over the processes."""
    total = processes * per_process
    return [[workload[m * processes + p :: total] for m in range(per_process)] for p in range(processes)]


def engine_counters(address: str) -> EngineStats:
    async def read() -> EngineStats:
        async with AsyncClient(address, timeout=60.0) as client:
            return (await client.stats()).engine

    return asyncio.run(read())


def collect_round(procs, results, round_: int, streams: int) -> tuple[list[Trace], float, list, list[float]]:
    """Every process's traces of round ``round_``, their CPU seconds, per process (first send, the send of
    its ``streams``-th request), and the full passes of their garbage collectors (s each)."""
    traces, cpu, seen, sends, pauses = [], 0.0, set(), [], []
    while len(seen) < len(procs):
        try:
            index, r, report, used, gc_passes = results.get(timeout=5)
        except queue.Empty:
            dead = [i for i, p in enumerate(procs) if i not in seen and not p.is_alive()]
            if dead:
                raise RuntimeError(f"client process(es) {dead} exited without a result") from None
            continue
        if r < 0:
            raise RuntimeError(f"client process {index} failed:\n{report}")
        assert r == round_, (r, round_)
        seen.add(index)
        traces += report
        cpu += used
        pauses += gc_passes
        sent = sorted(t.sent for t in report)
        if sent:
            sends.append((sent[0], sent[min(streams, len(sent)) - 1]))
    return traces, cpu, sends, pauses


def run_shape(args, shape: tuple[int, int], rounds, warmup, engine: EngineProcess, target: Target, fpids, workers=0):
    processes, per_process = shape
    ctx = mp.get_context("spawn")
    barrier, results, procs = ctx.Barrier(processes + 1), ctx.Queue(), []
    # streams[p][s][round]
    splits = [split(w, processes, per_process) for w in rounds]
    out: list[Round] = []
    try:
        for p in range(processes):
            streams = [[splits[r][p][s] for r in range(len(rounds))] for s in range(per_process)]
            prof = args.profile / f"client-{processes}x{per_process}-{p}.prof" if args.profile else None
            work = (p, target, streams, warmup[p::processes], len(rounds), barrier, results, prof, args.client_loop)
            procs.append(ctx.Process(target=client_process, args=work))
            procs[-1].start()
        for r in range(len(rounds)):
            try:
                barrier.wait(STARTUP_TIMEOUT)  # every client idle
                before = Reading(engine_counters(engine.address), process_cpu(engine.pid), machine_jiffies())
                front = sum(process_cpu(pid) for pid in fpids())
                barrier.wait(STARTUP_TIMEOUT)  # go
            except threading.BrokenBarrierError:
                raise RuntimeError("a client process failed:\n" + str(results.get(timeout=5)[2])) from None
            traces, cpu, sends, pauses = collect_round(procs, results, r, per_process)
            after = Reading(engine_counters(engine.address), process_cpu(engine.pid), machine_jiffies())
            elapsed = max(t.arrivals[-1] for t in traces if t.arrivals) - min(t.sent for t in traces)
            engine_run = EngineRun.between(before, after, elapsed)
            run = Round(
                f"{processes}x{per_process}", r, traces, cpu, engine_run, workers, sends=sends, collector_pauses=pauses
            )
            if workers:
                run.frontend_cpu = sum(process_cpu(pid) for pid in fpids()) - front
                run.frontend_cores = run.frontend_cpu / (after.time - before.time)
            errors = [t.error for t in traces if t.error]
            if errors:
                print(f"warning: {len(errors)} request(s) failed, e.g. {errors[0]}")
            out.append(run)
            print(progress(run), flush=True)  # a run cut short still says this much
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
            proc.join()
    return out


def run_connections(args, fresh, warmup, engine, target: Target, fpids, workers: int) -> None:
    """``--connections N``: N requests at once, each on an SSE connection of its own (the workload's
    lengths, repeated, with fresh ids), from the first shape's processes. Prints whether every one
    completed, the errors by kind, and whether the engine was idle after with every KV block free."""
    processes = args.shapes[0][0]
    copies = -(-args.connections // args.num_requests)
    workload = [r for i in range(copies) for r in fresh(20_000 + i)][: args.connections]
    (run,) = run_shape(
        args, (processes, -(-args.connections // processes)), [workload], warmup, engine, target, fpids, workers
    )
    errors = [t.error for t in run.traces if t.error]
    server_errors = [e for e in errors if e.startswith("HTTP 5")]
    done = sum(1 for t in run.traces if not t.error and t.tokens == t.max_tokens)

    async def stats():
        async with AsyncClient(engine.address, timeout=60.0) as client:
            return await client.stats()

    after = asyncio.run(stats())
    idle = after.running == 0 and after.waiting == 0 and after.free_kv_blocks == after.total_kv_blocks
    print(
        f"connections: {len(workload)} at once, {done} completed with every token, {len(errors)} errors "
        f"({len(server_errors)} HTTP 5xx{', e.g. ' + errors[0] if errors else ''}); engine after: {after.running} "
        f"running, {after.waiting} waiting, {after.free_kv_blocks}/{after.total_kv_blocks} KV blocks free: "
        f"{'idle' if idle else 'NOT IDLE'}",
        flush=True,
    )


@dataclass
class ServiceEngine:
    """The engine of a ``nanostream serve --openai-port`` service, as run_shape reads an EngineProcess."""

    address: str
    pid: int


@contextlib.contextmanager
def openai_service(model: Path, args, engine_kwargs: dict):
    """``nanostream serve MODEL --openai-port P`` (engine and frontend as one command, at its default
    --openai-workers unless ``--http-service N``); yields (its engine, base URL, frontend pids, workers)."""
    port = free_port()
    cmd = [sys.executable, "-m", "nanostream", "serve", str(model), "--openai-port", str(port), "--no-register"]
    cmd += ["--seed", str(args.seed), "--stream-interval", str(args.stream_interval)]
    if args.http_service != "auto":
        cmd += ["--openai-workers", args.http_service]
    for name, value in engine_kwargs.items():  # as EngineProcess passes them
        flag = "--" + name.replace("_", "-")
        cmd += [flag] if value is True else [f"--no-{flag[2:]}"] if value is False else [flag, str(value)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    base = f"http://127.0.0.1:{port}"
    try:
        address = None
        for line in proc.stdout:
            print(f"service: {line.rstrip()}", flush=True)
            if line.startswith(READY):
                address = line[len(READY) :].strip()
                break
        if address is None:
            raise RuntimeError(f"the service did not start ({' '.join(cmd)})")
        # the count `serve` starts: the same function on the same options and machine
        workers = openai_workers(None if args.http_service == "auto" else args.http_service, engine_kwargs)
        threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # keep its pipe drained
        wait_healthy(base, proc, "the service's OpenAI API did not come up")
        kids = process_tree(proc.pid)[1:]
        engine_pid = next(p for p in kids if b"serve" in Path(f"/proc/{p}/cmdline").read_bytes())
        frontend = next(p for p in kids if b"frontend" in Path(f"/proc/{p}/cmdline").read_bytes())
        yield ServiceEngine(address, engine_pid), base, lambda: process_tree(frontend), workers
    finally:
        proc.terminate()
        proc.wait(60)


def run_streamed(args, model: Path, fresh, warmup, engine_kwargs) -> tuple[list[Round], list[tuple[int, str, list]]]:
    """The AsyncClient rounds of every shape, then the HTTP rounds per worker count and route, as (workers, route,
    rounds); ``fresh(i)``: workload number i."""
    if args.http_service:
        with openai_service(model, args, engine_kwargs) as (engine, base, fpids, workers):
            print(f"service: engine pid {engine.pid} at {engine.address}, {workers} frontend worker(s)")
            http = []
            for j, api in enumerate(args.http_api):
                target = Target(base_url=base, model=model.name, api=api, tokenizer=str(model))
                rounds = [http_workload(args, model, api, fresh(10_000 + 10 * j + r)) for r in range(args.runs)]
                http.append(
                    (workers, api, run_shape(args, args.shapes[0], rounds, warmup, engine, target, fpids, workers))
                )
            if args.connections:  # (its own line, not a row of the table: it is not the offline workload)
                run_connections(args, fresh, warmup, engine, target, fpids, workers)
        return [], http
    engine = EngineProcess(str(model), seed=args.seed, stream_interval=args.stream_interval, **engine_kwargs)
    if args.profile:  # the same `serve`, under cProfile: its main thread (the busy loop), its whole life
        engine.cmd[1:2] = ["-m", "cProfile", "-o", str(args.profile / "engine.prof"), "-m"]
    direct, http = [], []
    with engine:
        print(f"streamed: engine pid {engine.pid} at {engine.address}, stream_interval {args.stream_interval}")
        for k, shape in enumerate([] if args.http_only else args.shapes):
            rounds = [fresh(100 * (k + 1) + r) for r in range(args.runs)]
            direct += run_shape(args, shape, rounds, warmup, engine, Target(address=engine.address), list)
        for k, workers in enumerate(args.http_workers):
            with openai_frontend(engine.address, workers) as (base, fpids):
                for j, api in enumerate(args.http_api):
                    rounds = [
                        http_workload(args, model, api, fresh(10_000 + 100 * k + 10 * j + r)) for r in range(args.runs)
                    ]
                    target = Target(base_url=base, model=model.name, api=api, tokenizer=str(model))
                    http.append(
                        (workers, api, run_shape(args, args.shapes[0], rounds, warmup, engine, target, fpids, workers))
                    )
    return direct, http


def http_workload(args, model: Path, api: str, requests: list[Request]) -> list[Request]:
    """A round's requests for ``api``: the token-id route takes the prompts as a dialect's route would render them
    where one is measured beside it (``served_as``); a dialect's route renders them itself."""
    return as_served(str(model), served_as(args), requests) if api == "completions" else requests


# ---- report --------------------------------------------------------------------------------------


def progress(r: Round) -> str:
    eng = r.engine
    # The worker count after the round: gpu_suite.sh waits for "^http [0-9x]* round 0".
    via = f"http {r.shape} round {r.index} w{r.workers}" if r.workers else f"client {r.shape} round {r.index}"
    return (
        f"{via}: {r.output_tokens() / r.elapsed:,.0f} out tok/s, "
        f"TTFT p50 {1e3 * percentiles(r.ttft())[0]:.1f} ms (engine mean: {eng.first_token_split()}), "
        f"delivery p50 {delivery(r)} ms{fan_out(r)}{r.ttft_parts()}; {r.prompt_pace()}{r.send_spread()}, "
        f"{eng.steps} steps, period {1e3 * eng.period():.2f} ms, host {eng.host_ms():.2f} + device wait "
        f"{eng.wait_ms():.2f} ms/step, engine {eng.cores:.2f} cores{served_prompts(r)}"
    )


def served_prompts(r: Round) -> str:
    """HTTP: the prompt tokens the server counted against the workload's (the dialects send the prompt as text
    under the chat template: a tokenizer that cannot spell the ids' text would make the round a lighter one)."""
    served, workload = sum(t.served_prompt for t in r.traces), sum(t.prompt_tokens for t in r.traces)
    return f", prompts served as {served:,} tokens (workload {workload:,})" if served else ""


def delivery(r: Round) -> str:
    """Delivery p50, and in brackets its wire part's p50: engine step end → the client's reader."""
    total = percentiles([d for t in r.traces for d in t.delivery])[0]
    wire = percentiles([d for t in r.traces for d in t.wire])[0]
    return f"{1e3 * total:.2f} ({1e3 * wire:.2f})"


def fan_out(r: Round) -> str:
    """The client's part of delivery, per message a client's reader took: how long after it the first
    and the last of its streams had their chunk (p50 over messages). First: the event loop's wake-up
    and one stream's work; last − first: the other streams', one after another."""
    after: dict[float, list[float]] = {}
    for t in r.traces:
        for arrival, received in zip(t.arrivals, t.received):
            if received is not None:
                after.setdefault(received, []).append(arrival - received)
    if not after:
        return ""
    first = percentiles([min(v) for v in after.values()])[0]
    last = percentiles([max(v) for v in after.values()])[0]
    return f" (a message's first stream +{1e3 * first:.2f}, last +{1e3 * last:.2f} ms)"


def report(args, offline: Offline, rounds: list[Round], workers: int = 0, api: str = "") -> str:
    """One table: AsyncClient's rounds, or (``workers`` > 0) those through a frontend with that many workers on
    ``api``'s route."""
    target = HTTP_TARGET if workers else THROUGHPUT_TARGET
    off_ttft = percentiles(offline.ttft)
    if workers:
        own = ("tokens/event", "frontend cores", "frontend µs/token")
    else:
        own = ("delivery p50 ms (wire)", "tokens/chunk")
    rows = [
        (
            "shape",
            "round",
            "offline tok/s (this run)",
            "streamed tok/s",
            "ratio",
            "TTFT p50 ms",
            *own,
            "period ms (off)",
            "host ms/step (off)",
            "device wait ms/step (off)",
            "engine cores",
            "client cores",
        )
    ]
    worst = float("inf")
    tps = sorted(tokens / elapsed for elapsed, tokens, _ in offline.runs)
    median = tps[len(tps) // 2] if len(tps) % 2 else (tps[len(tps) // 2 - 1] + tps[len(tps) // 2]) / 2
    for r in rounds:
        elapsed, tokens, off = offline.runs[min(r.index, len(offline.runs) - 1)]
        ratio = (r.output_tokens() / r.elapsed) / median
        worst = min(worst, ratio)
        eng = r.engine
        tokens_out = max(r.output_tokens(), 1)
        if workers:
            events = max(sum(t.events for t in r.traces), 1)
            own = (f"{tokens_out / events:.2f}", f"{r.frontend_cores:.2f}", f"{1e6 * r.frontend_cpu / tokens_out:.1f}")
        else:
            own = (delivery(r), f"{tokens_out / max(r.chunks(), 1):.2f}")
        rows.append(
            (
                r.label(),
                str(r.index),
                f"{tokens / elapsed:,.0f}",
                f"{r.output_tokens() / r.elapsed:,.0f}",
                f"{ratio:.3f}",
                f"{1e3 * percentiles(r.ttft())[0]:.0f}",
                *own,
                f"{1e3 * eng.period():.2f} ({1e3 * off.period():.2f})",
                f"{eng.host_ms():.2f} ({off.host_ms():.2f})",
                f"{eng.wait_ms():.2f} ({off.wait_ms():.2f})",
                f"{eng.cores:.2f}",
                f"{r.client_cpu / r.elapsed:.2f}",
            )
        )
    gaps = [b - a for r in rounds for t in r.traces for a, b in pairwise(t.arrivals)]
    via = f"HTTP {APIS.get(api, '')} ({workers} frontend worker(s))" if workers else "AsyncClient"
    via += f", clients on {args.client_loop}"
    lines = [
        f"== {via}, stream_interval {args.stream_interval}: {args.runs} round(s) per shape; ratio: streamed ÷ the "
        f"offline median {median:,.0f} tok/s (runs: {', '.join(f'{t:,.0f}' for t in tps)}); offline TTFT p50/p90 "
        f"(all {len(offline.ttft)} queued at once) {1e3 * off_ttft[0]:.1f} / {1e3 * off_ttft[1]:.0f} ms, engine mean: "
        f"{offline.ttft_split}; {offline.pace} ==",
        *format_table(rows),
        f"chunk gap p50/p90/p99 ms: {' / '.join(f'{1e3 * g:.2f}' for g in percentiles(gaps))}",
        f"worst streamed ÷ offline: {worst:.3f} (target ≥ {target}): {'met' if worst >= target else 'MISSED'}",
    ]
    return "\n".join(lines)


def parse_apis(text: str) -> list[str]:
    apis = text.split(",")
    if not apis or any(a not in APIS for a in apis) or len(set(apis)) < len(apis):
        raise argparse.ArgumentTypeError(f"--http-api takes some of {', '.join(APIS)}, comma-separated, not {text!r}")
    return apis


def served_as(args) -> str:
    """The route whose rendering every round's prompts take: a dialect's where one is measured (the ids as text
    under the chat template), else the ids as they are."""
    return next((a for a in args.http_api if a != "completions"), "completions")


def parse_shapes(text: str) -> list[tuple[int, int]]:
    try:
        shapes = [tuple(int(n) for n in part.lower().split("x")) for part in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise argparse.ArgumentTypeError(f"--shapes takes PROCESSESxSTREAMS[,...] such as 4x64,8x32, not {text!r}")
    return shapes


def parse_workers(text: str) -> list[int]:
    """``2,8`` -> [2, 8]; ``0``: no HTTP rounds."""
    try:
        counts = [int(n) for n in text.split(",")]
    except ValueError:
        counts = []
    if counts == [0]:
        return []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--http-workers takes counts such as 8 or 2,8 (0: no HTTP), not {text!r}")
    return counts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add_workload_args(parser)
    clients = parser.add_argument_group("clients")
    clients.add_argument(
        "--shapes", type=parse_shapes, default="4x64", help="client processes x streams in each, comma-separated"
    )
    clients.add_argument("--runs", type=int, default=1, help="rounds per shape (and offline runs)")
    clients.add_argument(
        "--http-workers",
        type=parse_workers,
        default="0",
        help="then the first shape through the OpenAI frontend with W workers, for each W of a comma-separated "
        "list in turn (one table each); 0: no HTTP",
    )
    clients.add_argument(
        "--http-service",
        nargs="?",
        const="auto",
        metavar="WORKERS",
        help="the HTTP rounds through the one command, `nanostream serve MODEL --openai-port P` (its engine, "
        "its frontend at --openai-workers WORKERS, default: its own auto), instead of --http-workers; no "
        "AsyncClient rounds",
    )
    clients.add_argument(
        "--connections",
        type=int,
        default=0,
        help="with --http-service: then one round of this many requests at once, each on its own SSE connection",
    )
    clients.add_argument(
        "--http-api",
        type=parse_apis,
        default=["completions"],
        help="the HTTP rounds' routes, one after another on one engine: completions (/v1/completions, token ids), "
        "responses or messages (/v1/responses, /v1/messages: the prompt decoded to text, one user message under the "
        "chat template). With a dialect among them, every route and the offline runs take the prompts as the "
        "dialect's route renders them, so all do the same work (default completions)",
    )
    clients.add_argument(
        "--http-only",
        action="store_true",
        help="skip the AsyncClient rounds (the offline runs still happen: the ratios need them)",
    )
    clients.add_argument(
        "--stream-interval",
        type=int,
        default=ServerConfig.stream_interval,
        help="the engine's stream_interval: send a request's tokens every N tokens",
    )
    clients.add_argument(
        "--client-loop",
        choices=("asyncio", "uvloop"),
        default="asyncio",
        help="the client processes' event loop (uvloop: as a production client may run)",
    )
    clients.add_argument("--profile", type=Path, help="write cProfiles of the engine and the clients into this dir")
    add_engine_args(parser, skip=("seed",))
    args = parser.parse_args(argv)
    check_workload_args(parser, args)
    if args.runs < 1 or args.stream_interval < 1:
        parser.error("--runs and --stream-interval must be positive")
    if args.connections and not args.http_service:
        parser.error("--connections is a round of --http-service: give it too")
    if args.http_only and not args.http_workers:
        parser.error("--http-only skips the AsyncClient rounds: give --http-workers W for the HTTP ones")
    for p, s in args.shapes:
        if p * s > args.num_requests:
            parser.error(f"shape {p}x{s} has more streams than --num-requests ({args.num_requests})")
    if args.profile:
        args.profile = args.profile.resolve()
        args.profile.mkdir(parents=True, exist_ok=True)
    return args


def main(argv: list[str] | None = None) -> None:
    import torch

    # A `timeout` that stops this run still stops what it started (engine, frontend, clients).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args = parse_args(argv)
    engine_kwargs = engine_options(args)
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the engine process's: `serve` has no option for it
    with model_dir(args) as model:
        hf_config, _, workload = load_workload(args, model, engine_kwargs)
        warmup = make_warmup(args.seed, hf_config.vocab_size, WARMUP_REQUESTS)

        def fresh(i: int) -> list[Request]:
            return round_workload(workload, args.seed, i, hf_config.vocab_size)

        # One workload per offline run, and one more for the offline TTFT; a dialect's as its route serves it.
        offline_rounds = [as_served(str(model), served_as(args), fresh(i)) for i in range(args.runs + 1)]
        offline = run_offline(args, model, offline_rounds, warmup, engine_kwargs)
        direct, http = run_streamed(args, model, fresh, warmup, engine_kwargs)
    if direct:
        print(report(args, offline, direct))
    for workers, api, rounds in http:
        print(report(args, offline, rounds, workers, api))


if __name__ == "__main__":
    main()
