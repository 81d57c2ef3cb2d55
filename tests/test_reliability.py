"""The engine process against faults from outside: each test is one way a hostile or unlucky client
once cost others their streams (docs/reliability.md lists them). Real engine processes, real
sockets; a raw DEALER (``Peer`` in test_protocol) sends what no well-behaved client would.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import anyio
import httpx
import msgspec
import pytest
import zmq
from helpers import engine_processes, serve_http, wait_idle
from test_protocol import Peer

import nanostream.client.connection
from nanostream import LLM, AsyncClient, SamplingParams
from nanostream import protocol as p
from nanostream.client.launch import EngineProcess
from nanostream.config import EngineConfig, ServerConfig
from nanostream.engine.llm_engine import MAX_FAILED_STEPS, LLMEngine
from nanostream.errors import (
    ConnectionLostError,
    EngineBusyError,
    EngineDeadError,
    RequestFailedError,
    RequestTimeoutError,
)

pytestmark = pytest.mark.slow  # engine processes, servers or browsers: not in the fast lane

ENGINE_OPTIONS = dict(max_model_len=256, kvcache_block_size=16, num_kvcache_blocks=96, device="cpu")
ROOMY = {**ENGINE_OPTIONS, "max_model_len": 2048, "num_kvcache_blocks": 160}  # room for LONG
CLIENT_TIMEOUT = 1.5
LIVELY = dict(heartbeat_interval=0.2, client_timeout=CLIENT_TIMEOUT, **ROOMY)
# Small queues: two requests run, four wait; one client may hold six.
LIMITED = dict(max_num_seqs=2, max_num_queued_reqs=4, max_client_reqs=6, **ENGINE_OPTIONS)
TOKEN = "reliability-token"
GREEDY = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
LONG = dict(temperature=0.0, max_tokens=2000, ignore_eos=True)  # seconds of decoding, unless aborted


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def engines(qwen3_dir):
    options = {
        "main": LIVELY,
        "limited": LIMITED,
        "tcp": dict(address="tcp://127.0.0.1:0", auth_token=TOKEN, **ENGINE_OPTIONS),
        "to_stop": LIVELY,
    }
    with engine_processes(str(qwen3_dir), options) as started:
        yield started


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(str(qwen3_dir), **ENGINE_OPTIONS)


@pytest.fixture
def zctx():
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


def offline(llm, prompt, **params):
    return llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


# ---- 1. a frame nested 1,000 deep, before any hello, on ipc and on tcp with a token ----------------


@pytest.mark.anyio
@pytest.mark.parametrize("where", ["main", "tcp"])
async def test_deeply_nested_frame_before_hello_leaves_the_engine_serving(engines, llm, zctx, where):
    engine = engines[where]
    token = TOKEN if where == "tcp" else None
    peer = Peer(zctx, engine.address)
    try:
        for frame in (b"\x91" * 1000 + b"\x00", b"\x91" * 8000 + b"\x00", b"\x81\xa4type" + b"\x91" * 4000):
            await peer.send(frame)
            reply = await peer.recv(5)
            assert isinstance(reply, p.Error) and not reply.fatal, reply
    finally:
        peer.close()
    async with AsyncClient(engine.address, auth_token=token) as client:
        out = await client.generate("Once upon a time", **GREEDY)
        assert out.token_ids == offline(llm, "Once upon a time", **GREEDY).token_ids
    if where == "tcp":  # (this engine serves no other test) and SIGTERM still stops it cleanly
        assert engine.stop() == 0


# ---- 2. parameters: bounded where they enter --------------------------------------------------------


def test_extreme_parameters_are_refused_with_a_clear_error():
    for kwargs, what in [
        (dict(top_k=2**64 - 1), "top_k"),
        (dict(temperature=float("nan")), "temperature must be a finite"),
        (dict(temperature=float("inf")), "temperature must be a finite"),
        (dict(repetition_penalty=float("nan")), "repetition_penalty must be a finite"),
        (dict(seed=2**64), "seed must be a 64-bit"),
        (dict(min_tokens=2**63, max_tokens=None), "min_tokens"),
        (dict(stop=["x"] * 20_000), "stop takes at most 64 strings"),
        (dict(stop=["x" * 5000]), "at most 1024 characters"),
        (dict(stop_token_ids=list(range(1000))), "stop_token_ids takes at most"),
    ]:
        with pytest.raises(ValueError, match=what):
            SamplingParams(**kwargs)


@pytest.mark.anyio
async def test_extreme_parameters_on_the_wire_end_their_request_and_nothing_else(engines, llm, zctx):
    engine = engines["main"]
    peer = Peer(zctx, engine.address)
    try:
        assert isinstance(await peer.hello(), p.Welcome)
        for i, (params, finish) in enumerate(
            [
                ({"top_k": 2**64 - 1}, "error"),
                ({"temperature": float("nan")}, "error"),
                ({"repetition_penalty": float("nan")}, "error"),
                ({"stop": ["x"] * 20_000}, "error"),
                ({"max_tokens": 2**63 - 1}, "error"),
                ({"seed": 2**64 - 1, "max_tokens": 2}, "length"),  # the largest seed is a seed
                ({"temperature": 3e38, "top_k": 2**63 - 1, "max_tokens": 2}, "length"),
                ({"temperature": 1e-30, "repetition_penalty": 1e-30, "max_tokens": 2}, "length"),
            ]
        ):
            add = {"type": "add", "request_id": f"x{i}", "prompt_token_ids": [1, 2, 3], "params": params}
            await peer.send(msgspec.msgpack.encode(add))
            out = (await peer.outputs())[-1]
            assert (out.request_id, out.finish_reason) == (f"x{i}", finish), out
            assert out.code == ("invalid" if finish == "error" else None), out
    finally:
        peer.close()
    async with AsyncClient(engine.address) as client:
        # top_k past the vocabulary keeps every token: the same draw as no top_k at all.
        wide = await client.generate("The river", temperature=1.0, top_k=10**9, seed=5, max_tokens=16)
        plain = await client.generate("The river", temperature=1.0, seed=5, max_tokens=16)
        assert wide.token_ids == plain.token_ids
        greedy = await client.generate("The river", **GREEDY)
        assert greedy.token_ids == offline(llm, "The river", **GREEDY).token_ids
        await wait_idle(client, 5)


# ---- 3. liveness from the hello on; a dropped client is told and registers again --------------------


@pytest.mark.anyio
async def test_a_slow_tokenizer_load_does_not_get_the_client_dropped(engines, llm, monkeypatch):
    engine = engines["main"]
    load = nanostream.client.connection._load_tokenizer

    def slow_load(*args):
        time.sleep(CLIENT_TIMEOUT * 2.5)  # a cold transformers import on a loaded machine
        return load(*args)

    async with AsyncClient(engine.address) as observer:
        before = (await observer.stats()).dropped_clients
    monkeypatch.setattr(nanostream.client.connection, "_load_tokenizer", slow_load)
    async with AsyncClient(engine.address) as client:
        out = await client.generate("Once upon a time", **GREEDY)
        assert out.token_ids == offline(llm, "Once upon a time", **GREEDY).token_ids
        assert (await client.stats()).dropped_clients == before


@pytest.mark.anyio
async def test_a_dropped_client_is_told_and_registers_again(engines, llm):
    engine = engines["main"]
    async with AsyncClient(engine.address) as client:
        stream = client.stream("Once upon a time", **LONG)
        await stream.__anext__()
        time.sleep(CLIENT_TIMEOUT + 0.6)  # the whole event loop stalls: no heartbeats, like a stopped process
        with pytest.raises(ConnectionLostError, match="dropped this client.*silent"):
            async for _ in stream:
                pass
        with anyio.fail_after(5):  # registered again at once: the next request runs
            out = await client.generate("The river", **GREEDY)
        assert out.token_ids == offline(llm, "The river", **GREEDY).token_ids
        stats = await client.stats()
        assert stats.requests_by_client.get(client.client_id.encode().hex(), 0) == 0
    assert f"client {client.client_id.encode().hex()} was silent" in engine.output()


# ---- 4. admission control: busy, not unbounded -------------------------------------------------------


@pytest.mark.anyio
async def test_a_flood_is_refused_as_busy_and_the_accepted_requests_run_exactly(engines, llm):
    engine = engines["limited"]
    prompts = [[5 + i, 6, 7] for i in range(40)]
    outcome: dict[int, object] = {}

    async with AsyncClient(engine.address) as client:

        async def one(i: int) -> None:
            try:
                outcome[i] = await client.generate(prompts[i], **GREEDY)
            except EngineBusyError as exc:
                outcome[i] = exc

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        busy = [i for i, o in outcome.items() if isinstance(o, EngineBusyError)]
        done = [i for i in outcome if i not in busy]
        assert len(done) >= 4 and len(busy) >= 20, (len(done), len(busy))  # at least the queue's worth ran
        assert "retry later" in str(outcome[busy[0]]) or "open requests" in str(outcome[busy[0]])
        refs = llm.generate([prompts[i] for i in done], SamplingParams(**GREEDY), use_tqdm=False)
        assert [outcome[i].token_ids for i in done] == [r.token_ids for r in refs]
        await wait_idle(client, 5)


@pytest.mark.anyio
async def test_requests_waiting_for_their_grammar_count_as_waiting(qwen3_dir, monkeypatch):
    """A constrained request waits before the scheduler while its grammar compiles: the stats show it,
    and the queue limits count it (a flood of slow grammars is refused as busy like any other)."""
    from nanostream.engine import grammar as grammar_module
    from nanostream.engine.process.server import EngineServer
    from nanostream.structured_outputs import StructuredOutputsParams

    release = threading.Event()
    compile_ = grammar_module.GrammarCompiler._compile
    monkeypatch.setattr(
        grammar_module.GrammarCompiler, "_compile", lambda self, s: release.wait(30) and compile_(self, s)
    )
    address = f"ipc://{tempfile.mkdtemp(prefix='ns-')}/engine.sock"
    server = EngineServer(
        EngineConfig(model=str(qwen3_dir), **ENGINE_OPTIONS), ServerConfig(address=address, max_num_queued_reqs=2)
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        async with AsyncClient(address, timeout=5) as client:
            params = dict(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[0-9]{4}"))
            outputs: list = []

            async def constrained(prompt: list[int]) -> None:
                outputs.append(await client.generate(prompt, **params))

            async with anyio.create_task_group() as tg:
                tg.start_soon(constrained, [5, 6, 7])
                tg.start_soon(constrained, [8, 9, 10, 11])
                with anyio.fail_after(5):
                    while (stats := await client.stats()).waiting < 2:
                        await anyio.sleep(0.01)
                assert (stats.waiting, stats.waiting_tokens, stats.running) == (2, 7, 0)
                with pytest.raises(EngineBusyError, match="2 requests wait to run"):
                    await client.generate([12, 13], **GREEDY)
                release.set()
            assert sorted(len(o.text) for o in outputs) == [4, 4] and all(o.text.isdigit() for o in outputs)
            assert (await client.stats()).waiting == 0
    finally:
        release.set()
        server._stop.set()
        thread.join(10)


@pytest.mark.anyio
async def test_what_one_client_sends_does_not_grow_the_engine(engines, zctx):
    """300 adds of 20,000 stop strings each, and one add of 30 million ids."""
    engine = engines["main"]
    peer = Peer(zctx, engine.address)
    try:
        assert isinstance(await peer.hello(), p.Welcome)
        before = rss_mib(engine.pid)
        params = {"max_tokens": 4, "stop": [f"stop {i}" for i in range(20_000)]}
        for i in range(300):
            add = {"type": "add", "request_id": f"s{i}", "prompt_token_ids": [1, 2, 3], "params": params}
            await peer.send(msgspec.msgpack.encode(add))
        got = await peer.outputs(finished=300, timeout=60)
        assert {o.code for o in got} == {"invalid"} and "<= 64 - at `$.params.stop`" in got[0].error
        big = {"type": "add", "request_id": "big", "prompt_token_ids": [1] * 30_000_000}  # 30 MB
        await peer.send(msgspec.msgpack.encode(big))
        assert await peer.disconnected(timeout=10), "ZeroMQ cuts off a peer whose frame exceeds the limit"
        grown = rss_mib(engine.pid) - before
        print(f"engine RSS {before:.1f} MiB, {grown:+.1f} MiB after the adds")
        assert grown < 24, f"the engine grew by {grown:.0f} MiB"
    finally:
        peer.close()
    async with AsyncClient(engine.address) as client:
        await wait_idle(client, 5)


def test_http_flood_gets_429_with_retry_after(engines):
    from nanostream.frontends.openai_server import create_app

    base, stop = serve_http(create_app(engines["limited"].address))
    try:

        async def flood() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=base, timeout=60) as http:
                body = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}
                responses: list[httpx.Response] = []

                async def one() -> None:
                    responses.append(await http.post("/v1/completions", json=body))

                async with anyio.create_task_group() as tg:
                    for _ in range(30):
                        tg.start_soon(one)
                return responses

        responses = anyio.run(flood)
        codes = sorted(r.status_code for r in responses)
        assert set(codes) == {200, 429} and codes.count(429) >= 10, codes
        refused = next(r for r in responses if r.status_code == 429)
        assert refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert (error["type"], error["code"]) == ("rate_limit_error", "engine_busy")
    finally:
        stop()


# ---- 5. the ipc socket: private, a stale file replaced, a live one refused ----------------------------


def test_ipc_socket_is_private_and_a_stale_file_is_replaced(qwen3_dir):
    address = f"ipc://{tempfile.mkdtemp(prefix='ns-')}/engine.sock"
    path = Path(address.removeprefix("ipc://"))
    old = os.umask(0)  # the engine process inherits it: its socket must be 0600 all the same
    try:
        first = EngineProcess(str(qwen3_dir), address=address, startup_timeout=120, **ENGINE_OPTIONS).start()
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert sorted(os.listdir(path.parent)) == ["engine.sock"], "the private bind directory is gone"
        again = subprocess.run(
            [sys.executable, "-m", "nanostream", "serve", str(qwen3_dir), "--address", address, "--device", "cpu"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert again.returncode == 2 and "address in use" in again.stderr, again.stderr
        first.proc.kill()
        first.proc.wait()
        assert path.exists(), "a killed engine leaves its socket file"
        with EngineProcess(str(qwen3_dir), address=address, startup_timeout=120, **ENGINE_OPTIONS) as second:

            async def main() -> str:
                async with AsyncClient(second.address) as client:
                    return (await client.generate("Once", max_tokens=4)).finish_reason

            assert anyio.run(main) == "length"
        assert not path.exists()
    finally:
        first.stop()


# ---- 6. a hung engine is dead within the client's timeout, not a second later ------------------------


@pytest.mark.anyio
async def test_a_hung_engine_is_reported_within_the_timeout(engines):
    engine, timeout = engines["to_stop"], 1.0
    async with AsyncClient(engine.address, timeout=timeout) as client:
        stream = client.stream([3, 4, 5], **LONG)
        await stream.__anext__()
        os.kill(engine.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            with pytest.raises(EngineDeadError, match="sent nothing"):
                async for _ in stream:
                    pass
            elapsed = time.monotonic() - stopped
        finally:
            os.kill(engine.pid, signal.SIGCONT)
        # Its last message came at most one heartbeat (0.2 s) before it stopped.
        assert timeout - 0.3 <= elapsed <= timeout + 0.15, elapsed


# ---- 7. a request's own timeout --------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_request_timeout_aborts_it_in_the_engine(engines):
    async with AsyncClient(engines["main"].address) as client:
        start = time.monotonic()
        with pytest.raises(RequestTimeoutError, match="timeout passed"):
            async for _ in client.stream([9, 8, 7], timeout=0.5, **LONG):
                pass
        assert 0.45 < time.monotonic() - start < 2.0
        await wait_idle(client, 2)


# ---- 8. a step that raises fails its requests; the engine goes on ---------------------------------------


def test_a_failed_step_fails_its_requests_and_the_engine_serves_on(qwen3_dir, llm):
    engine = LLMEngine(EngineConfig(model=str(qwen3_dir), **ENGINE_OPTIONS))
    launch, calls = engine.runner.launch, []

    def flaky(chunks, *args):
        calls.append(len(calls))
        if len(calls) == 3:
            raise RuntimeError("a kernel blew up")
        return launch(chunks, *args)

    engine.runner.launch = flaky
    engine.add_request("a", [1, 2, 3], SamplingParams(**GREEDY))
    engine.add_request("b", [4, 5, 6], SamplingParams(**GREEDY))
    ends = {}
    while engine.has_unfinished():
        for delta in engine.step().deltas:
            if delta.finish_reason:
                ends[delta.request_id] = (delta.finish_reason, delta.error)
    assert ends["a"][0] == ends["b"][0] == "error" and "a kernel blew up" in ends["a"][1]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks

    engine.add_request("c", [1, 2, 3], SamplingParams(**GREEDY))  # and the next request runs exactly
    tokens = []
    while engine.has_unfinished():
        tokens += [t for d in engine.step().deltas for t in d.token_ids]
    assert tokens == offline(llm, [1, 2, 3], **GREEDY).token_ids

    engine.runner.launch = lambda *args: (_ for _ in ()).throw(RuntimeError("the device is gone"))
    engine.add_request("d", [1, 2, 3], SamplingParams(**GREEDY))
    with pytest.raises(RuntimeError, match="the device is gone"):
        for _ in range(MAX_FAILED_STEPS):
            engine.add_request(f"e{_}", [1, 2, 3], SamplingParams(**GREEDY))
            engine.step()


@pytest.mark.anyio
async def test_a_failed_step_reaches_the_stream_as_request_failed_error(qwen3_dir, llm):
    from nanostream.engine.process.server import EngineServer

    address = f"ipc://{tempfile.mkdtemp(prefix='ns-')}/engine.sock"
    server = EngineServer(EngineConfig(model=str(qwen3_dir), **ENGINE_OPTIONS), ServerConfig(address=address))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        async with AsyncClient(address) as client:
            launch = server.engine.runner.launch

            def once(*args):
                server.engine.runner.launch = launch
                raise RuntimeError("a kernel blew up")

            server.engine.runner.launch = once
            with pytest.raises(RequestFailedError, match="internal error.*a kernel blew up"):
                await client.generate([1, 2, 3], **GREEDY)
            out = await client.generate([1, 2, 3], **GREEDY)  # the engine serves on
            assert out.token_ids == offline(llm, [1, 2, 3], **GREEDY).token_ids
    finally:
        server._stop.set()
        thread.join(10)


# ---- 9. a bug that escapes every handler takes the engine down loudly, never deaf -------------------


@pytest.mark.anyio
async def test_a_bug_escaping_the_socket_handling_stops_the_engine_and_every_client_hears_of_it(qwen3_dir):
    from nanostream.engine.process.server import EngineServer

    address = f"ipc://{tempfile.mkdtemp(prefix='ns-')}/engine.sock"
    server = EngineServer(EngineConfig(model=str(qwen3_dir), **ROOMY), ServerConfig(address=address))
    failure: list[BaseException] = []

    def serve() -> None:
        try:
            server.serve_forever()
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    async with AsyncClient(address, timeout=5) as client:
        stream = client.stream([1, 2, 3], **LONG)
        await stream.__anext__()

        def explode(frames):  # what no frame can do: a BaseException out of the frame handling
            raise SystemExit("a bug that escapes every handler")

        server.transport._receive = explode
        client.connection._dealer.send(p.encode(p.Heartbeat()))  # a frame for the exploding handler
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="a bug that escapes every handler"):
            async for _ in stream:
                pass
        assert time.monotonic() - start < 2.0
    thread.join(10)
    assert not thread.is_alive() and isinstance(failure[0], SystemExit), failure


def test_offline_generate_raises_when_a_step_fails_and_leaves_nothing_running(llm):
    launch = llm.engine.runner.launch
    llm.engine.runner.launch = lambda *args: (_ for _ in ()).throw(RuntimeError("a kernel blew up"))
    try:
        with pytest.raises(RequestFailedError, match="a kernel blew up"):
            llm.generate([[1, 2, 3], [4, 5]], SamplingParams(**GREEDY), use_tqdm=False)
    finally:
        llm.engine.runner.launch = launch
    assert not llm.engine.has_unfinished()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    assert llm.generate([1, 2, 3], SamplingParams(**GREEDY), use_tqdm=False)[0].finish_reason == "length"


def test_an_engine_started_by_a_program_stops_when_the_program_is_killed(qwen3_dir):
    """EngineProcess's engine does not outlive its owner, even one that dies by SIGKILL (no cleanup ran)."""
    owner = textwrap.dedent(
        f"""
        import time
        from nanostream.client.launch import EngineProcess
        engine = EngineProcess({str(qwen3_dir)!r}, device="cpu", max_model_len=256, heartbeat_interval=0.2,
                               client_timeout=1.0).start()
        print(engine.pid, flush=True)
        time.sleep(600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", owner], stdout=subprocess.PIPE, text=True)
    engine_pid = int(proc.stdout.readline())
    os.kill(engine_pid, 0)  # it runs
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 15
    while os.path.exists(f"/proc/{engine_pid}") and "zombie" not in _state(engine_pid):
        assert time.monotonic() < deadline, "the engine outlived the program that started it"
        time.sleep(0.1)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (OSError, IndexError):
        return "zombie"
