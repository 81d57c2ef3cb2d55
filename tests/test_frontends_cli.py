"""The frontend plug-in point, the terminal chat and ``nanostream demo``, as a user runs them:
real processes, a real engine, entry points discovered from installed distribution metadata."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from nanostream import LLM, SamplingParams
from nanostream.client.launch import EngineProcess

pytestmark = pytest.mark.slow  # engine processes, servers or browsers: not in the fast lane

ENGINE_OPTIONS = dict(kvcache_block_size=16, device="cpu")


def nanostream(*args, stdin=None, env=None, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "nanostream", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )


@pytest.fixture(scope="module")
def engine(qwen3_dir):
    with EngineProcess(str(qwen3_dir), **ENGINE_OPTIONS) as engine:
        yield engine


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(str(qwen3_dir), **ENGINE_OPTIONS)


def test_list_shows_the_built_in_frontends():
    out = nanostream("frontend", "--list")
    assert out.returncode == 0, out.stderr
    names = [line.split()[0] for line in out.stdout.splitlines() if line.strip()]
    assert {"openai", "gradio", "chat"} <= set(names)


def test_a_third_party_package_adds_a_frontend_through_its_entry_point(tmp_path, engine):
    # An installed distribution as pip leaves it: a module plus a dist-info with entry_points.txt.
    (tmp_path / "hello_frontend.py").write_text(
        textwrap.dedent(
            """
            import anyio
            from nanostream import AsyncClient
            from nanostream.frontends import Frontend

            class Hello(Frontend):
                description = "greets, then prints the engine's model"

                @classmethod
                def add_arguments(cls, parser):
                    parser.add_argument("--greeting", default="hello")

                def run(self, args):
                    async def main():
                        async with AsyncClient(args.engine) as client:
                            out = await client.generate([5, 6, 7], max_tokens=3, temperature=0, ignore_eos=True)
                            print(args.greeting, client.model, len(out.token_ids))
                    anyio.run(main)
                    return 0
            """
        )
    )
    dist = tmp_path / "hello_frontend-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: hello-frontend\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[nanostream.frontends]\nhello = hello_frontend:Hello\n")
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    listed = nanostream("frontend", "--list", env=env)
    assert "hello" in listed.stdout and "greets" in listed.stdout
    out = nanostream("frontend", "hello", "--engine", engine.address, "--greeting", "hi", env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "hi" and out.stdout.split()[-1] == "3"


def test_unknown_frontend_names_the_registered_ones():
    out = nanostream("frontend", "nope")
    assert out.returncode == 2
    assert "no frontend named 'nope'" in out.stderr and "openai" in out.stderr


def test_terminal_chat_streams_replies_with_the_history(engine, llm):
    settings = ["--temperature", "0", "--max-tokens", "12"]
    out = nanostream("chat", "--engine", engine.address, *settings, stdin="Hello there\nAnd then?\n/exit\n")
    assert out.returncode == 0, out.stderr
    params = SamplingParams(temperature=0, max_tokens=12)
    first = llm.chat([{"role": "user", "content": "Hello there"}], params, use_tqdm=False)[0].text
    second = llm.chat(
        [
            {"role": "user", "content": "Hello there"},
            {"role": "assistant", "content": first},
            {"role": "user", "content": "And then?"},
        ],
        params,
        use_tqdm=False,
    )[0].text
    # Each reply is printed after a prompt marker; the second one saw the first exchange.
    assert f"> {first}\n> {second}\n> " in out.stdout


def test_terminal_chat_waits_for_its_engine_then_says_it_is_not_there(tmp_path):
    address = f"ipc://{tmp_path}/nobody.sock"
    out = nanostream("chat", "--engine", address, "--engine-wait", "1", stdin="hi\n", timeout=60)
    assert out.returncode == 1  # a runtime failure (2: a mistake in the command)
    assert out.stderr.splitlines() == [
        f"nanostream chat: waiting up to 1 s for the engine at {address}",
        f"nanostream: no engine answers at {address} within 1 s (--engine-wait): start one with `nanostream serve`, "
        "or pass its --engine ADDR",
    ]


def test_demo_runs_to_completion_and_exits_zero(qwen3_dir):
    out = nanostream("demo", "--model", str(qwen3_dir), "--prompts", "5", "--max-tokens", "8", timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("[p")]
    assert len(lines) == 5  # one line per reply without a terminal
    assert {line[1:6] for line in lines} == {"p0/s0", "p0/s1", "p1/s0", "p1/s1"}  # 2 processes x 2 streams
    assert "5 replies from 2 client processes" in out.stdout


def test_demo_ctrl_c_stops_the_clients_and_the_engine(qwen3_dir):
    # Ctrl-C in a terminal signals the demo's whole process group (its client processes too).
    proc = subprocess.Popen(
        [sys.executable, "-m", "nanostream", "demo", "--model", str(qwen3_dir), "--prompts", "1000", "--plain"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    engine_pid = None
    for line in proc.stdout:  # the engine's pid is in its default address; wait for a first reply
        if line.startswith("engine ready at"):
            engine_pid = int(line.split("nanostream-")[1].split("-")[0])
        if line.startswith("[p"):
            break
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    assert "stopped" in proc.stdout.read()
    with pytest.raises(ProcessLookupError):  # the engine process is gone too
        for _ in range(100):
            os.kill(engine_pid, 0)
            time.sleep(0.1)


def test_openai_frontend_workers_share_one_port_and_stop_together(engine, llm):
    """``--workers 3``: three server processes on one port, each its own engine client; the official
    client's streams through them equal the offline output; SIGTERM stops every worker."""
    import socket

    import anyio
    from openai import OpenAI

    from nanostream import AsyncClient

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "nanostream", "frontend", "openai", "--engine", engine.address]
    proc = subprocess.Popen([*cmd, "--port", str(port), "--workers", "3"], stdout=subprocess.PIPE, text=True)
    try:
        api = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=30)

        async def clients() -> int:
            async with AsyncClient(engine.address) as client:
                return (await client.stats()).clients - 1  # less this one

        deadline = time.monotonic() + 120
        while anyio.run(clients) < 3:  # every worker has said hello to the engine
            assert proc.poll() is None and time.monotonic() < deadline, "the workers did not all connect"
            time.sleep(0.5)
        ref = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        for _ in range(6):  # new connections: the kernel spreads them over the workers
            with OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none") as fresh:
                events = fresh.completions.create(
                    model=api.models.list().data[0].id,
                    prompt=[5, 6, 7],
                    max_tokens=12,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                assert "".join(e.choices[0].text for e in events if e.choices) == ref[0].text
        workers = [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
        assert len(workers) >= 3
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    deadline = time.monotonic() + 10  # (multiprocessing's resource tracker, a child too, leaves on its own)
    while any(os.path.exists(f"/proc/{pid}") for pid in workers):
        assert time.monotonic() < deadline, "a worker outlived the frontend command"
        time.sleep(0.1)
