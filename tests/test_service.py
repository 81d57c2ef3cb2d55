"""``nanostream serve MODEL --openai-port P`` as one service, and how local clients find an engine
without its address: real processes, the official ``openai`` client."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from nanostream import LLM, AsyncClient, SamplingParams
from nanostream.frontends.openai_server.routes import ROUTES

pytestmark = pytest.mark.slow  # engine processes, servers or browsers: not in the fast lane


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def gone(pids: list[int], within: float = 20.0) -> bool:
    deadline = time.monotonic() + within
    while any(Path(f"/proc/{p}").exists() and "(zombie)" not in Path(f"/proc/{p}/status").read_text() for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def wait_for_health(port: int, status: int, within: float = 60.0):
    """GET /health until it answers ``status`` (or ``within`` is over: the last answer)."""
    import httpx

    deadline = time.monotonic() + within
    while True:
        try:
            health = httpx.get(f"http://127.0.0.1:{port}/health")
            if health.status_code == status or time.monotonic() > deadline:
                return health
        except httpx.ConnectError:  # not listening yet
            assert time.monotonic() < deadline, "nothing listens at the port"
        time.sleep(0.2)


@pytest.fixture
def runtime_dir(tmp_path, monkeypatch):
    """A private runtime directory: the engines these tests start are the only ones recorded there."""
    path = tmp_path / "run"
    path.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(path))
    monkeypatch.delenv("NANOSTREAM_ADDRESS", raising=False)
    return path


def serve(model: Path, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "nanostream", "serve", str(model), "--device", "cpu", "--max-model-len", "256", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def ready(proc: subprocess.Popen) -> str:
    for line in proc.stdout:
        if line.startswith("nanostream engine ready at "):
            return line.split(" at ", 1)[1].strip()
    raise AssertionError(f"no engine came up: {proc.stderr.read()}")


def test_serve_with_openai_port_is_the_whole_server_and_sigterm_stops_everything(qwen3_dir, runtime_dir):
    from openai import OpenAI

    port = free_port()
    proc = serve(qwen3_dir, "--openai-port", str(port))
    try:
        ready(proc)
        api = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=20)
        got = api.completions.create(model=qwen3_dir.name, prompt=[5, 6, 7], max_tokens=8, temperature=0)
        ref = LLM(str(qwen3_dir), device="cpu", max_model_len=256).generate(
            [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
        )[0]
        assert got.choices[0].text == ref.text
        kids = children(proc.pid)
        assert len(kids) >= 2  # the engine and the frontend
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    assert code == 0
    assert gone(kids), "a child of the service outlived it"


def test_serve_openai_workers_2_runs_two_servers_behind_one_port_and_both_answer(qwen3_dir, runtime_dir):
    """Started on the engine's ready line (as the service starts them), both workers serve at once."""
    import httpx

    port = free_port()
    proc = serve(qwen3_dir, "--openai-port", str(port), "--openai-workers", "2", "--max-num-seqs", "32")
    try:
        engine = ready(proc)
        assert "(2 server processes)" in proc.stdout.readline()
        routes = [proc.stdout.readline().split() for _ in ROUTES]  # then the routes it serves, a line each
        for route in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"):
            assert ["POST", route] in routes, routes
        body = {"prompt": [5, 6, 7], "max_tokens": 240, "temperature": 0, "ignore_eos": True, "stream": True}
        url = f"http://127.0.0.1:{port}/v1/completions"
        assert wait_for_health(port, 200).status_code == 200, "the workers never served"

        async def holders() -> set[str]:
            """The engine's clients that hold requests now: each worker is one."""
            async with AsyncClient(engine) as client:
                return {name for name, n in (await client.stats()).requests_by_client.items() if n}

        async def requests_and_holders() -> tuple[list[str], set[str]]:
            """Requests on connections of their own, one every 0.1 s (a burst of connections would be
            accepted by whichever worker woke first), until two engine clients hold some."""
            seen: set[str] = set()
            first_texts: list[str] = []

            async def one() -> None:
                async with httpx.AsyncClient() as http, http.stream("POST", url, json=body, timeout=60) as reply:
                    async for line in reply.aiter_lines():
                        if line.startswith("data: {"):
                            first_texts.append(json.loads(line[6:])["choices"][0]["text"])
                            await anyio.sleep_forever()  # held open until the test has seen both workers

            async with anyio.create_task_group() as tg:
                for _ in range(40):
                    tg.start_soon(one)
                    await anyio.sleep(0.1)
                    seen |= await holders()
                    if len(seen) == 2:
                        break
                tg.cancel_scope.cancel()  # closing the connections aborts the requests
            return first_texts, seen

        texts, seen = anyio.run(requests_and_holders)
        assert len(seen) == 2, f"the requests went to {len(seen)} of the 2 workers"
        # one store of responses for both workers: a stored response is found on any connection
        body = {"model": qwen3_dir.name, "input": "Hi", "max_output_tokens": 2}
        made = httpx.post(f"http://127.0.0.1:{port}/v1/responses", json=body, timeout=60).json()["id"]
        for _ in range(8):  # a new connection each: either worker
            assert httpx.get(f"http://127.0.0.1:{port}/v1/responses/{made}", timeout=60).status_code == 200
        # the same greedy text, whichever worker served it; a first chunk may carry more than one token
        longest = max(texts, key=len)
        assert texts and all(longest.startswith(text) for text in texts), texts
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    assert code == 0


def test_an_openai_frontend_started_before_its_engine_answers_503_then_serves(qwen3_dir, tmp_path):
    import httpx

    from nanostream.client.launch import EngineProcess

    address, port = f"ipc://{tmp_path}/engine.sock", free_port()
    cmd = [sys.executable, "-m", "nanostream", "frontend", "openai", "--engine", address, "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        said = f"nanostream frontend openai: waiting up to 60 s for the engine at {address}"
        assert said in iter(lambda: proc.stderr.readline().strip(), ""), "it did not say what it waits for"
        health = wait_for_health(port, 503)
        assert health.status_code == 503 and "waiting for the engine at" in health.json()["error"]["message"]
        with EngineProcess(str(qwen3_dir), address=address, device="cpu", max_model_len=256):
            assert (health := wait_for_health(port, 200)).status_code == 200, health.text
            reply = httpx.post(
                f"http://127.0.0.1:{port}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0}
            )
            ref = LLM(str(qwen3_dir), device="cpu", max_model_len=256).generate(
                [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
            )[0]
            assert reply.json()["choices"][0]["text"] == ref.text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_an_openai_frontend_with_no_engine_within_engine_wait_exits_with_one_line(tmp_path, workers):
    address = f"ipc://{tmp_path}/engine.sock"
    cmd = [sys.executable, "-m", "nanostream", "frontend", "openai", "--engine", address, "--port", str(free_port())]
    out = subprocess.run(
        [*cmd, "--engine-wait", "1", "--workers", workers], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 1
    lines = [line for line in out.stderr.splitlines() if line.startswith("nanostream")]
    assert lines == [
        f"nanostream frontend openai: waiting up to 1 s for the engine at {address}",
        f"nanostream frontend openai: no engine answers at {address} within 1 s (--engine-wait): "
        "start one with `nanostream serve`, or pass its --engine ADDR",
    ], out.stderr


def test_the_service_stops_with_a_message_when_its_engine_dies(qwen3_dir, runtime_dir):
    proc = serve(qwen3_dir, "--openai-port", str(free_port()), "--no-register")  # server options pass through
    try:
        ready(proc)
        assert list(runtime_dir.glob("nanostream/engine-*.json")) == [], "--no-register: no record"
        engine = next(p for p in children(proc.pid) if "serve" in Path(f"/proc/{p}/cmdline").read_text())
        os.kill(engine, signal.SIGKILL)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    assert code == 1
    assert "the engine was killed by signal 9; stopping the service" in err and "Traceback" not in err


def test_a_client_with_no_address_finds_the_one_local_engine_and_names_several(qwen3_dir, runtime_dir):
    async def model_of(address=None) -> str:
        async with AsyncClient(address) as client:
            return client.model

    first = serve(qwen3_dir)
    second = None
    try:
        address = ready(first)
        assert anyio.run(model_of) == str(qwen3_dir)  # found with no address
        second = serve(qwen3_dir)
        other = ready(second)
        with pytest.raises(ValueError) as error:
            anyio.run(model_of)
        assert "2 local engines are running" in str(error.value)
        assert address in str(error.value) and other in str(error.value)
        os.environ["NANOSTREAM_ADDRESS"] = other  # the variable still wins
        try:
            assert anyio.run(model_of) == str(qwen3_dir)
        finally:
            del os.environ["NANOSTREAM_ADDRESS"]
    finally:
        for proc in (first, second):
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)
    assert list(runtime_dir.glob("nanostream/engine-*.json")) == [], "an engine left its record behind"
    with pytest.raises(ValueError, match="no local engine is running: start one with `nanostream serve"):
        anyio.run(model_of)
