"""What several test modules need: engines started together, an engine gone idle, an app on HTTP."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import anyio

from nanostream import AsyncClient
from nanostream.client.launch import EngineProcess


@contextlib.contextmanager
def engine_processes(model: str, options: dict[str, dict]) -> Iterator[dict[str, EngineProcess]]:
    """One engine process per name, with its options, started at once (a start is mostly loading)."""
    started = {name: EngineProcess(model, **opts) for name, opts in options.items()}
    try:
        with ThreadPoolExecutor(len(started)) as pool:
            list(pool.map(EngineProcess.start, started.values()))
        yield started
    finally:
        for engine in started.values():
            engine.stop()


async def wait_idle(client: AsyncClient, within: float) -> float:
    """Seconds until the engine runs nothing and every KV block is free; fails after ``within``."""
    start = time.monotonic()
    while True:
        stats = await client.stats()
        if stats.running == stats.waiting == 0 and stats.free_kv_blocks == stats.total_kv_blocks:
            return time.monotonic() - start
        if time.monotonic() - start > within:
            raise AssertionError(f"the engine still holds requests {within} s later: {stats}")
        await anyio.sleep(0.02)


API_KEY = "sk-test-key"  # what the OpenAI frontend tests start their servers with


def forced(text: str, **extra) -> dict:
    """A request body's fields that make the tiny model write exactly ``text`` (a scripted reply, reasoning
    included), through vLLM's structured_outputs."""
    return {"structured_outputs": {"choice": [text], "enable_in_reasoning": True}, **extra}


def run_in_thread(main, *args):
    """``anyio.run(main, *args)`` in a thread of its own (the caller's thread may run an event loop)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(anyio.run, main, *args).result()


def wait_engine_idle(address: str, within: float) -> float:
    """``wait_idle`` from synchronous code, through a client of its own."""

    async def main() -> float:
        async with AsyncClient(address) as client:
            return await wait_idle(client, within)

    return run_in_thread(main)


def serve_http(app) -> tuple[str, object]:
    """Run an ASGI ``app`` on uvicorn in a thread, on a port the OS picks: (base URL, stop function)."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the HTTP server did not start"
        time.sleep(0.02)

    def stop() -> None:
        server.should_exit = True
        thread.join(10)

    return f"http://127.0.0.1:{sock.getsockname()[1]}", stop


def outputs_at_one_and_two_ranks(path, prompts: list[list[int]], params, **options) -> list[list]:
    """``prompts`` through an engine of one rank, then one of two (worker processes): the first prompt alone, then
    the rest (hitting its prefix); each engine must preempt and hit the prefix cache. The two runs' outputs."""
    from nanostream import LLM

    runs = []
    for size in (1, 2):
        with LLM(str(path), tensor_parallel_size=size, **options) as llm:
            outputs = llm.generate(prompts[:1], params, use_tqdm=False)
            outputs += llm.generate(prompts[1:], params, use_tqdm=False)
            stats = llm.engine.stats()
        assert stats.preemptions > 0 and stats.prefix_cache_hits > 0
        runs.append(outputs)
    return runs


@contextlib.contextmanager
def served_openai(path, runtime_dir, monkeypatch, extra: tuple[str, ...] = ()) -> Iterator[tuple[object, list[str]]]:
    """``nanostream serve PATH --openai-port P`` on the CPU as a user starts it (a process of its own, its runtime
    files under ``runtime_dir``): yields an ``openai.OpenAI`` client on it and the lines serve printed up to its
    ready line; stopped by SIGTERM after, which it must answer with exit code 0. ``extra``: more of serve's options."""
    import signal
    import subprocess
    import sys

    import openai

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime_dir))
    monkeypatch.delenv("NANOSTREAM_ADDRESS", raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "nanostream", "serve", str(path), "--device", "cpu", "--max-model-len", "256",
           "--kvcache-block-size", "16", "--openai-port", str(port), *extra]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    said = []  # what serve prints up to its ready line
    try:
        while not (said and said[-1].startswith("nanostream engine ready at ")):
            said.append(proc.stdout.readline())
            assert said[-1], f"no engine came up: {proc.stderr.read()}"
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=20), said
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    assert code == 0
