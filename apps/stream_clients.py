"""The client side of apps/bench_stream.py and apps/bench_serve.py: streams that record when each
chunk arrived, through ``AsyncClient`` or through the OpenAI frontend's server-sent events.

A client process runs rounds: before each it waits at a barrier twice (all processes idle, so the
parent can read the engine's counters; then the start), runs its streams, and reports that round's
traces, its own CPU seconds and its garbage collector's full passes on a queue. ``openai_frontend``
starts the frontend that the HTTP streams go through.
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import functools
import gc
import json
import socket
import subprocess
import sys
import time
import traceback
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from engine_readings import process_tree
from workload import TEMPERATURE, Request, params_of

from nanostream import AsyncClient

STARTUP_TIMEOUT = 600.0  # s for the client processes to connect and warm up


@dataclass
class Trace:
    """One streamed request as its client saw it (times: ``time.perf_counter()``, which is
    CLOCK_MONOTONIC, as is the engine's ``time.monotonic()``: one clock for every process on Linux)."""

    max_tokens: int
    prompt_tokens: int
    sent: float  # just before the request was made
    arrivals: list[float] = field(default_factory=list)  # one per chunk (SSE event) that carried tokens
    counts: list[int] = field(default_factory=list)  # tokens in each; HTTP: all on the last (from usage)
    delivery: list[float] = field(default_factory=list)  # s, arrival − the end of the engine step (client only)
    wire: list[float] = field(default_factory=list)  # s, the client's reader took it − the end of the step
    received: list[float | None] = field(default_factory=list)  # per chunk: when the reader took its message
    events: int = 0  # SSE events with a choice (HTTP only)
    served_prompt: int = 0  # HTTP: the prompt's tokens as the server counted them (the dialects' chat template on)
    error: str | None = None

    @property
    def tokens(self) -> int:
        return sum(self.counts)


@dataclass(frozen=True)
class Target:
    """Where the streams go: an engine (``address``) or an OpenAI frontend (``base_url``)."""

    address: str | None = None
    base_url: str | None = None
    model: str | None = None
    api: str = "completions"  # or the dialects translated onto the chat route: "responses", "messages"
    tokenizer: str | None = None  # the dialects take text: the prompt ids decoded with this model's tokenizer


async def stream_client(client: AsyncClient, r: Request) -> Trace:
    trace = Trace(r.max_tokens, len(r.prompt_token_ids), time.perf_counter())
    async with client.stream(r.prompt_token_ids, params_of(r)) as stream:
        async for chunk in stream:
            if chunk.token_ids:
                now = time.perf_counter()
                trace.arrivals.append(now)
                trace.counts.append(len(chunk.token_ids))
                trace.received.append(stream.received)
                if stream.produced is not None:
                    trace.delivery.append(now - stream.produced)
                    trace.wire.append(stream.received - stream.produced)
    return trace


APIS = {"completions": "/v1/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
# the dialects' events that carry tokens (a reasoning model's thinking among them)
_DELTAS = {"response.output_text.delta", "response.reasoning_text.delta", "content_block_delta"}


@functools.cache
def _tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _completion_body(target: Target, r: Request) -> dict:
    body = {"model": target.model, "temperature": TEMPERATURE, "ignore_eos": True, "stream": True}
    if target.api == "completions":
        prompt = {"prompt": r.prompt_token_ids, "max_tokens": r.max_tokens}
        return {**body, **prompt, "stream_options": {"include_usage": True}}
    text = _tokenizer(target.tokenizer).decode(r.prompt_token_ids)  # (the chat template adds its own tokens)
    if target.api == "responses":
        return {**body, "input": text, "max_output_tokens": r.max_tokens, "store": False}
    return {**body, "messages": [{"role": "user", "content": text}], "max_tokens": r.max_tokens}


def as_served(model: str, api: str, requests: list[Request]) -> list[Request]:
    """``requests`` as the server runs them on ``api``'s route: a dialect's prompt is the ids decoded to text, one user
    message under the chat template (``_completion_body``), so offline runs on these do the streamed rounds' work
    (ids 0-10,000 re-encode to ~5% more tokens, and the template adds its own). Completions: as they are."""
    if api == "completions":
        return requests
    from nanostream.client.chat_template import render_chat

    tokenizer = _tokenizer(model)
    return [
        Request(
            render_chat(tokenizer, [{"role": "user", "content": tokenizer.decode(r.prompt_token_ids)}]), r.max_tokens
        )
        for r in requests
    ]


def _take_event(trace: Trace, data: str) -> int | None:
    """Record one SSE ``data:`` payload; the completion tokens if it is the usage event (or the dialects'
    last: response.completed / response.incomplete, message_delta)."""
    if data == "[DONE]":
        return None
    event = json.loads(data)
    kind = event.get("type")
    if "error" in event or kind in ("error", "response.failed"):
        trace.error = str(event.get("error") or event)
    elif event.get("choices") or kind in _DELTAS:
        trace.events += 1
        trace.arrivals.append(time.perf_counter())
        trace.counts.append(0)
    elif kind in ("response.completed", "response.incomplete"):
        trace.served_prompt = event["response"]["usage"]["input_tokens"]
        return event["response"]["usage"]["output_tokens"]
    elif kind == "message_start":
        trace.served_prompt = event["message"]["usage"]["input_tokens"]
    elif kind == "message_delta":
        return event["usage"]["output_tokens"]
    elif event.get("usage") and not kind:
        trace.served_prompt = event["usage"]["prompt_tokens"]
        return event["usage"]["completion_tokens"]
    return None


def _finish(trace: Trace, completion_tokens: int) -> Trace:
    if trace.counts:
        trace.counts[-1] = completion_tokens  # per-event counts are unknown; the total is exact
    return trace


async def stream_http(http, target: Target, r: Request) -> Trace:
    """One ``/v1/completions`` request (or ``target.api``'s) as server-sent events through an
    ``http_session()``: aiohttp's (what ``vllm bench serve`` reads with; about half httpx's client CPU per
    token, 39 against 76 us in bench_stream's 4x16 HTTP rounds on a 2-core CPU) or httpx's."""
    body = _completion_body(target, r)
    trace = Trace(r.max_tokens, len(r.prompt_token_ids), time.perf_counter())
    completion_tokens = 0
    if not hasattr(http, "stream"):  # aiohttp: lines split at \n only, as SSE has them
        async with http.post(target.base_url + APIS[target.api], json=body) as response:
            if response.status != 200:
                trace.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
                return trace
            async for raw in response.content:
                line = raw.decode().rstrip("\r\n")
                if line.startswith("data: "):
                    completion_tokens = _take_event(trace, line[6:]) or completion_tokens
        return _finish(trace, completion_tokens)
    async with http.stream("POST", target.base_url + APIS[target.api], json=body) as response:
        if response.status_code != 200:
            trace.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            return trace
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                completion_tokens = _take_event(trace, line[6:]) or completion_tokens
    return _finish(trace, completion_tokens)


def http_session():
    """An async HTTP session for ``stream_http`` with no connection limit: aiohttp's where it is installed
    (not a dependency of nanostream), else httpx's."""
    try:
        import aiohttp
    except ImportError:
        import httpx

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        return httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits)
    connector = aiohttp.TCPConnector(limit=0)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600.0))


async def run_streams(target: Target, streams: list[list[Request]], warmup: list[Request], rounds: int, sync) -> None:
    """Warm up, then ``rounds`` rounds of ``streams`` (each stream's requests one after another)."""
    barrier, results, index, profile = sync
    if target.base_url is not None:
        async with http_session() as http:
            one = lambda r: stream_http(http, target, r)
            await asyncio.gather(*(one(r) for r in warmup))
            await _rounds(one, streams, rounds, barrier, results, index, profile)
    else:
        async with AsyncClient(target.address, timeout=60.0) as client:
            one = lambda r: stream_client(client, r)
            await asyncio.gather(*(one(r) for r in warmup))
            await _rounds(one, streams, rounds, barrier, results, index, profile)


class CollectorPauses:
    """The garbage collector's full passes in this process (each stops every stream it runs), as
    seconds each, since the last ``take()``."""

    def __init__(self) -> None:
        self.pauses: list[float] = []
        self._start = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if info["generation"] == 2:
            if phase == "start":
                self._start = time.perf_counter()
            else:
                self.pauses.append(time.perf_counter() - self._start)

    def take(self) -> list[float]:
        pauses, self.pauses = self.pauses, []
        return pauses


async def _rounds(one, streams, rounds, barrier, results, index, profile: Path | None) -> None:
    collector = CollectorPauses()
    for round_ in range(rounds):
        await asyncio.to_thread(barrier.wait, STARTUP_TIMEOUT)  # idle: the parent reads the counters
        await asyncio.to_thread(barrier.wait, STARTUP_TIMEOUT)  # go
        traces: list[Trace] = []

        async def stream(requests: list[Request], traces: list[Trace] = traces) -> None:
            for r in requests:
                traces.append(await one(r))

        profiler = cProfile.Profile() if profile is not None and round_ == rounds - 1 else None
        cpu = time.process_time()
        collector.take()
        if profiler is not None:
            profiler.enable()
        await asyncio.gather(*(stream(s[round_]) for s in streams))
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(profile)
        results.put((index, round_, traces, time.process_time() - cpu, collector.take()))


def loop_factory(loop: str):
    """``asyncio.Runner``'s loop_factory for ``loop``: "asyncio" (None: asyncio's own) or "uvloop"."""
    if loop == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return None


def client_process(
    index: int, target: Target, streams, warmup, rounds: int, barrier, results, profile, loop: str = "asyncio"
) -> None:
    """``streams[s][round]``: the requests stream s runs in that round; ``loop``: asyncio's or uvloop's."""
    try:
        with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
            runner.run(run_streams(target, streams, warmup, rounds, (barrier, results, index, profile)))
    except BaseException:
        barrier.abort()  # nobody waits forever for a process that is gone
        results.put((index, -1, traceback.format_exc(), 0.0, []))


# ---- the OpenAI frontend the HTTP streams go through ------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, proc: subprocess.Popen, failure: str, timeout: float = 180) -> None:
    """Until ``base``/health answers; ``RuntimeError(failure)`` if ``proc`` exits or ``timeout`` s pass first."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5):
                return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(failure) from None
            time.sleep(0.5)


@contextlib.contextmanager
def openai_frontend(address: str, workers: int):
    """``nanostream frontend openai --workers W`` on the engine; yields (base URL, its pids)."""
    port = free_port()
    cmd = [sys.executable, "-m", "nanostream", "frontend", "openai", "--engine", address, "--port", str(port)]
    proc = subprocess.Popen([*cmd, "--workers", str(workers)])
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, f"the OpenAI frontend did not come up ({cmd})")
        yield base, lambda: process_tree(proc.pid)
    finally:
        proc.terminate()
        proc.wait(30)
