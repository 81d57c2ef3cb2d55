"""``nanostream demo``: one engine, several client processes streaming at once, one live terminal view.

The engine runs in a child process (``EngineProcess``) on the embedded model unless ``--model`` or
``--engine`` says otherwise. ``--processes`` client processes each open ``--streams`` concurrent
streams; the prompts are dealt out round-robin and every chunk is reported to this process, which
draws each stream's text, tokens/s and time to first token. Everything stops cleanly at the end or on
Ctrl-C. ``--gradio`` opens the chat app on the engine instead.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import queue as queue_mod
import signal
import sys
import time
from dataclasses import dataclass, field

# What the embedded demo model was trained to answer (apps/train_demo_model.py wraps a quarter of its
# documents as one of these chat turns); any prompt works with a real model.
PROMPTS = [
    "Tell me a fortune.",
    "Read me Psalms chapter 23.",
    "Say something wise.",
    "Read me Genesis chapter 1.",
    "Give me a quote.",
    "Read me Proverbs chapter 3.",
    "Tell me something.",
    "Read me Ecclesiastes chapter 1.",
]


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="Hugging Face model directory (default: the embedded demo model)")
    parser.add_argument("--engine", metavar="ADDR", help="use this running engine instead of starting one")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="prompts to stream in all (default: 8)")
    parser.add_argument("--processes", type=int, default=2, help="client processes (default: 2)")
    parser.add_argument("--streams", type=int, default=2, help="concurrent streams per process (default: 2)")
    parser.add_argument("--max-tokens", type=int, default=96, help="most tokens per reply (default: 96)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default: 0.8)")
    parser.add_argument("--gradio", action="store_true", help="open the Gradio chat app on the engine instead")
    parser.add_argument("--port", type=int, default=7860, help="the Gradio app's port (default: 7860)")
    parser.add_argument("--plain", action="store_true", help="one line per reply instead of the live view")


# ---- client processes ------------------------------------------------------------------------------


def _client_process(address: str, jobs: list[tuple[int, list[str]]], sampling: dict, events) -> None:
    import anyio

    with contextlib.suppress(KeyboardInterrupt):  # the demo is stopping: leaving the client aborts its streams
        anyio.run(_client_main, address, jobs, sampling, events)


async def _client_main(address: str, jobs: list[tuple[int, list[str]]], sampling: dict, events) -> None:
    import anyio

    from nanostream.client import AsyncClient

    async with AsyncClient(address) as client, anyio.create_task_group() as tg:
        for stream_id, prompts in jobs:
            tg.start_soon(_stream_prompts, client, stream_id, prompts, sampling, events)


async def _stream_prompts(client, stream_id: int, prompts: list[str], sampling: dict, events) -> None:
    for prompt in prompts:
        start = time.perf_counter()
        events.put(("start", stream_id, prompt))
        stream = (
            client.chat([{"role": "user", "content": prompt}], **sampling)
            if client.chat_template
            else client.stream(prompt, **sampling)
        )
        tokens, first, reason = 0, None, None
        try:
            async with stream:
                async for chunk in stream:
                    now = time.perf_counter()
                    first = now if first is None else first
                    tokens += len(chunk.token_ids)
                    reason = chunk.finish_reason
                    events.put(("text", stream_id, chunk.text, tokens, first - start, now - first))
        except Exception as exc:  # reported on the view; the other streams go on
            events.put(("error", stream_id, f"{type(exc).__name__}: {exc}"))
            continue
        events.put(("done", stream_id, reason))


# ---- the view ----------------------------------------------------------------------------------------


@dataclass
class StreamView:
    name: str
    prompt: str = ""
    text: str = ""
    tokens: int = 0
    ttft: float | None = None  # seconds, of the current reply
    decode_time: float = 0.0  # seconds from the first to the last token of the current reply
    status: str = "waiting"
    replies: int = 0
    ttfts: list[float] = field(default_factory=list)
    all_tokens: int = 0

    @property
    def tok_s(self) -> float | None:
        return (self.tokens - 1) / self.decode_time if self.decode_time > 0 and self.tokens > 1 else None


def _table(views: list[StreamView], address: str, elapsed: float):
    from rich.table import Table

    table = Table(title=f"nanostream demo: engine at {address}, {elapsed:.1f} s", expand=True)
    for name, kw in (("stream", {}), ("reply (latest text)", {"ratio": 1}), ("tokens", {"justify": "right"})):
        table.add_column(name, **kw)
    table.add_column("tok/s", justify="right")
    table.add_column("TTFT ms", justify="right")
    table.add_column("status")
    for v in views:
        tail = " ".join(v.text.split())[-90:]
        table.add_row(
            v.name,
            f"[dim]{v.prompt[:40]}[/dim]\n{tail}",
            str(v.tokens),
            f"{v.tok_s:.0f}" if v.tok_s else "-",
            f"{v.ttft * 1000:.0f}" if v.ttft is not None else "-",
            v.status,
        )
    return table


def _apply(views: list[StreamView], event: tuple, plain: bool) -> None:
    kind, sid = event[0], event[1]
    v = views[sid]
    if kind == "start":
        v.prompt, v.text, v.tokens, v.ttft, v.decode_time, v.status = event[2], "", 0, None, 0.0, "streaming"
    elif kind == "text":
        v.text += event[2]
        v.tokens, v.ttft, v.decode_time = event[3], event[4], event[5]
    elif kind in ("done", "error"):
        v.status = event[2] if kind == "done" else f"error: {event[2]}"
        v.replies += 1
        v.all_tokens += v.tokens
        if v.ttft is not None:
            v.ttfts.append(v.ttft)
        if plain:
            rate = f"{v.tok_s:.0f} tok/s" if v.tok_s else "- tok/s"
            ttft = f"{v.ttft * 1000:.0f} ms" if v.ttft is not None else "-"
            print(f"[{v.name}] {v.prompt!r} -> {v.text!r} ({v.tokens} tokens, {rate}, TTFT {ttft}, {v.status})")


def _stream_demo(args: argparse.Namespace, address: str) -> int:
    from rich.console import Console
    from rich.live import Live

    num_streams = args.processes * args.streams
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.prompts)]
    per_stream = [prompts[s::num_streams] for s in range(num_streams)]
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    ctx = multiprocessing.get_context("spawn")
    events = ctx.Queue()
    procs = []
    for p in range(args.processes):
        jobs = [(s, per_stream[s]) for s in range(p * args.streams, (p + 1) * args.streams) if per_stream[s]]
        if jobs:
            procs.append(ctx.Process(target=_client_process, args=(address, jobs, sampling, events), daemon=True))
    views = [StreamView(f"p{s // args.streams}/s{s % args.streams}") for s in range(num_streams)]
    console = Console()
    plain = args.plain or not console.is_terminal
    start = time.perf_counter()
    for proc in procs:
        proc.start()
    try:
        with Live(_table(views, address, 0), console=console, refresh_per_second=8, transient=plain) as live:
            while any(proc.is_alive() for proc in procs) or not events.empty():
                with contextlib.suppress(queue_mod.Empty):
                    _apply(views, events.get(timeout=0.1), plain)
                if not plain:
                    live.update(_table(views, address, time.perf_counter() - start))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
            proc.join(5)
    elapsed = time.perf_counter() - start
    replies = sum(v.replies for v in views)
    tokens = sum(v.all_tokens for v in views)
    ttfts = sorted(t for v in views for t in v.ttfts)
    median = f"{ttfts[len(ttfts) // 2] * 1000:.0f} ms" if ttfts else "-"
    print(
        f"{replies} replies from {len(procs)} client processes, {tokens} tokens in {elapsed:.1f} s "
        f"({tokens / elapsed:.0f} tok/s in all), median time to first token {median}"
    )
    failed = sum(v.status.startswith("error") for v in views)
    return 0 if replies == args.prompts and not failed and all(p.exitcode == 0 for p in procs) else 1


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM or a closed terminal: stop as Ctrl-C does, engine included


def run_demo(args: argparse.Namespace) -> int:
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    for name in ("prompts", "processes", "streams", "max_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    from nanostream.sampling_params import SamplingParams

    SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)  # a bad value: before any engine starts
    engine = None
    address = args.engine
    if address is None:
        from nanostream.client.launch import EngineProcess
        from nanostream.demo_model import default_model_dir

        model = args.model or str(default_model_dir())
        print(f"starting an engine on {model} ...", flush=True)
        engine = EngineProcess(model).start()
        address = engine.address
        print(f"engine ready at {address}", flush=True)
    try:
        if args.gradio:
            from nanostream.frontends import frontend_main

            print(f"Gradio chat at http://127.0.0.1:{args.port} (Ctrl-C to stop)", flush=True)
            return frontend_main("gradio", ["--engine", address, "--port", str(args.port)])
        return _stream_demo(args, address)
    except KeyboardInterrupt:
        print("\nstopped", file=sys.stderr)
        return 130
    finally:
        if engine is not None:
            engine.stop()
