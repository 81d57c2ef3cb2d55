"""A serving benchmark with vLLM's metric definitions, through ``AsyncClient`` or HTTP.

Usage::

    python apps/bench_serve.py --threads 1 --concurrency 1,4,16 --num-prompts 32     # tiny model, CPU
    python apps/bench_serve.py --model DIR --concurrency 1,8,32,128,256,512 --rates 8,32,inf \\
        --input-len 512 --output-len 256 --out docs/serving      # JSON + PNG plots
    python apps/bench_serve.py --model DIR --http-workers 4 --concurrency 64,256 --prefix-len 256

It starts ``nanostream serve`` with the engine options given (and, with ``--http-workers W``,
``nanostream frontend openai --workers W`` on it), then runs one sweep point after another in this
process, one event loop, as ``vllm bench serve`` does:

- ``--concurrency C``: requests sent as fast as C may be in flight at once (max(16, 4 C) of them,
  at most ``--num-prompts``);
- ``--rates R``: requests sent at Poisson arrivals of R per second (``inf``: all at once), at most
  ``--max-concurrency`` in flight.

The workload: ``--num-prompts`` random prompts (ids below 10,000) of ``input-len`` tokens and
``output-len`` max_tokens, each drawn in [len × (1 − range-ratio), len × (1 + range-ratio)];
``--prefix-len`` prepends one shared random prefix to every prompt (the prefix cache's case).
Metrics, as vLLM defines them: TTFT (request sent → first token), TPOT per request ((E2E − TTFT) /
(output tokens − 1), first token excluded), ITL (the gap before each chunk after the first), E2EL,
request and output throughput. ``--out DIR`` writes ``DIR/bench_serve.json`` and latency–throughput
plots (matplotlib).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import signal
import sys
import time
from pathlib import Path

from engine_readings import percentiles
from presets import PRESETS
from stream_clients import Target, http_session, openai_frontend, stream_client, stream_http
from workload import PROMPT_VOCAB, Request, engine_options, model_dir

from nanostream import AsyncClient
from nanostream.client.launch import EngineProcess
from nanostream.options import add_engine_args


def make_workload(args: argparse.Namespace, vocab_size: int, point: int = 0) -> list[Request]:
    """Point ``point``'s prompts: fresh ones per sweep point, so no point finds another's in the prefix cache."""
    rng, high = random.Random(f"{args.seed} {point}"), min(PROMPT_VOCAB, vocab_size)

    def length(n: int) -> int:
        return max(1, rng.randint(int(n * (1 - args.range_ratio)), int(n * (1 + args.range_ratio))))

    prefix = [rng.randrange(high) for _ in range(args.prefix_len)]
    return [
        Request(prefix + [rng.randrange(high) for _ in range(length(args.input_len))], length(args.output_len))
        for _ in range(args.num_prompts)
    ]


async def run_point(one, workload: list[Request], concurrency: int | None, rate: float, seed: int) -> dict:
    """One sweep point: every request of ``workload``, at most ``concurrency`` in flight, sent at
    Poisson arrivals of ``rate`` per second (inf: no waiting)."""
    limit = asyncio.Semaphore(concurrency or len(workload))
    rng = random.Random(seed)

    async def request(r: Request):
        async with limit:
            return await one(r)

    tasks = []
    start = time.perf_counter()
    for r in workload:
        tasks.append(asyncio.create_task(request(r)))
        if math.isfinite(rate):
            await asyncio.sleep(rng.expovariate(rate))
    traces = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    return metrics(traces, duration) | {"concurrency": concurrency, "rate": rate}


def metrics(traces, duration: float) -> dict:
    done = [t for t in traces if t.arrivals and t.error is None]
    ttft = [t.arrivals[0] - t.sent for t in done]
    e2el = [t.arrivals[-1] - t.sent for t in done]
    tpot = [(e - f) / (t.tokens - 1) for t, e, f in zip(done, e2el, ttft) if t.tokens > 1]
    itl = [b - a for t in done for a, b in zip(t.arrivals, t.arrivals[1:])]
    output = sum(t.tokens for t in done)

    def stats(values: list[float]) -> dict:
        p50, p90, p99 = percentiles(values)
        mean = sum(values) / len(values) if values else float("nan")
        return {"mean_ms": 1e3 * mean, "p50_ms": 1e3 * p50, "p90_ms": 1e3 * p90, "p99_ms": 1e3 * p99}

    return {
        "completed": len(done),
        "failed": len(traces) - len(done),
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_throughput": output / duration,
        "total_token_throughput": (output + sum(t.prompt_tokens for t in done)) / duration,
        "ttft": stats(ttft),
        "tpot": stats(tpot),
        "itl": stats(itl),
        "e2el": stats(e2el),
    }


async def sweep(args: argparse.Namespace, target: Target, vocab_size: int) -> list[dict]:
    points = [(c, math.inf) for c in args.concurrency] + [(args.max_concurrency, r) for r in args.rates]
    warmup = make_workload(args, vocab_size, -1)[:8]
    async with contextlib.AsyncExitStack() as stack:
        if target.base_url is not None:
            http = await stack.enter_async_context(http_session())
            one = lambda r: stream_http(http, target, r)
        else:
            client = await stack.enter_async_context(AsyncClient(target.address, timeout=60.0))
            one = lambda r: stream_client(client, r)
        await asyncio.gather(*(one(r) for r in warmup))
        results = []
        for i, (concurrency, rate) in enumerate(points):
            workload = make_workload(args, vocab_size, i)
            if math.isinf(rate):  # a concurrency point: enough requests for 4 waves, within --num-prompts
                workload = workload[: max(16, 4 * concurrency)]
            result = await run_point(one, workload, concurrency, rate, args.seed + i)
            results.append(result)
            print(line(result), flush=True)
    return results


def line(r: dict) -> str:
    point = f"rate {r['rate']:g}/s" if math.isfinite(r["rate"]) else f"concurrency {r['concurrency']}"
    return (
        f"{point:>18}: {r['completed']} done ({r['failed']} failed) in {r['duration_s']:.2f} s; "
        f"{r['request_throughput']:.2f} req/s, {r['output_throughput']:,.0f} out tok/s; "
        f"TTFT p50/p99 {r['ttft']['p50_ms']:.1f}/{r['ttft']['p99_ms']:.1f} ms, TPOT p50 {r['tpot']['p50_ms']:.2f} ms, "
        f"ITL p50/p99 {r['itl']['p50_ms']:.2f}/{r['itl']['p99_ms']:.2f} ms, E2EL p50 {r['e2el']['p50_ms']:.0f} ms"
    )


def plot(results: list[dict], out: Path, title: str) -> list[Path]:
    """Latency against output throughput, one curve per metric, for each sweep (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for kind, label in (("concurrency", "concurrency"), ("rate", "request rate /s")):
        points = [r for r in results if (kind == "rate") == math.isfinite(r["rate"])]
        if len(points) < 2:
            continue
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
        x = [r["output_throughput"] for r in points]
        for ax, metric, name in zip(axes, ("ttft", "tpot", "e2el"), ("TTFT", "TPOT", "E2E latency")):
            for q, style in (("p50_ms", "o-"), ("p99_ms", "s--")):
                ax.plot(x, [r[metric][q] for r in points], style, label=f"{name} {q[:3]}")
            for r, xi in zip(points, x):
                tag = r["concurrency"] if kind == "concurrency" else f"{r['rate']:g}"
                ax.annotate(str(tag), (xi, r[metric]["p50_ms"]), textcoords="offset points", xytext=(3, 4), fontsize=7)
            ax.set_xlabel("output tokens/s")
            ax.set_ylabel("ms")
            ax.set_yscale("log")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(f"{title}: latency vs throughput, by {label}")
        fig.tight_layout()
        path = out / f"bench_serve_{kind}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    def numbers(kind):
        return lambda text: [kind(x) for x in text.split(",") if x]

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--range-ratio", type=float, default=0.5, help="lengths drawn in len × (1 ± this)")
    parser.add_argument("--prefix-len", type=int, default=0, help="a shared prefix of this many tokens on every prompt")
    parser.add_argument("--concurrency", type=numbers(int), default=[1, 16, 64, 256], help="comma-separated")
    parser.add_argument("--rates", type=numbers(float), default=[], help="Poisson request rates /s, comma-separated")
    parser.add_argument("--max-concurrency", type=int, help="in flight at once during the rate sweep")
    parser.add_argument("--http-workers", type=int, default=0, help="through the OpenAI frontend with W workers")
    parser.add_argument("--threads", type=int, help="OMP threads of the engine process")
    parser.add_argument("--out", type=Path, help="write bench_serve.json and the plots into this directory")
    parser.add_argument("--label", default="nanostream", help="the plots' title")
    model = parser.add_argument_group("model (default: the tiny random model, built into a temp dir)")
    model.add_argument("--model")
    model.add_argument("--preset", choices=sorted(PRESETS))
    model.add_argument("--tiny-config")
    model.add_argument("--build-dir")
    add_engine_args(parser, skip=("seed",))
    args = parser.parse_args(argv)
    args.tiny_config = json.loads(args.tiny_config) if args.tiny_config else {}
    if min(args.concurrency, default=1) < 1 or any(r <= 0 for r in args.rates):
        parser.error("--concurrency values must be ≥ 1 and --rates > 0")
    return args


def main(argv: list[str] | None = None) -> None:
    import os

    # A `timeout` that stops this run still stops what it started (engine, frontend, clients).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args = parse_args(argv)
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    with model_dir(args) as model, EngineProcess(str(model), seed=args.seed, **engine_options(args)) as engine:
        vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
        workload = make_workload(args, vocab_size)
        print(
            f"workload per point: {len(workload)} prompts, {sum(len(r.prompt_token_ids) for r in workload)} prompt "
            f"tokens (prefix {args.prefix_len}), {sum(r.max_tokens for r in workload)} output tokens, seed {args.seed}"
        )
        with contextlib.ExitStack() as stack:
            target = Target(address=engine.address)
            if args.http_workers:
                base, _ = stack.enter_context(openai_frontend(engine.address, args.http_workers))
                target = Target(base_url=base, model=model.name)
            results = asyncio.run(sweep(args, target, vocab_size))
    for line_ in engine.log:  # what stalled every stream mid-sweep
        if "after start-up" in line_:
            print(f"engine: {line_}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        via = f"HTTP, {args.http_workers} frontend workers" if args.http_workers else "AsyncClient"
        summary = {"args": {k: str(v) for k, v in vars(args).items()}, "via": via, "results": results}
        (args.out / "bench_serve.json").write_text(json.dumps(summary, indent=1))
        for path in plot(results, args.out, f"{args.label} ({via})"):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
