"""``nanostream serve MODEL --openai-port P`` as one service, and how local clients find an engine
without its address: real processes, the official ``openai`` client."""

from __future__ import annotations

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
