"""The engine process's busy loop keeps the engine's pipelined step: a step is launched before the
previous step's tokens are routed to clients, so routing, encoding and sending overlap the device's
work; and every token still reaches its stream, in order, once, with a delivery stamp."""

from __future__ import annotations

import tempfile
import threading
import time

import pytest

from nanostream import LLM, AsyncClient, SamplingParams
from nanostream.config import EngineConfig, ServerConfig
from nanostream.engine.server import EngineServer

OPTIONS = dict(device="cpu", kvcache_block_size=16, max_model_len=512)


@pytest.fixture
def anyio_backend():
    return "asyncio"  # the client runs on asyncio (its socket is read in an asyncio reader callback)


@pytest.fixture
def server(qwen3_dir):
    address = f"ipc://{tempfile.mkdtemp(prefix='ns-')}/engine.sock"
    server = EngineServer(EngineConfig(model=str(qwen3_dir), **OPTIONS), ServerConfig(address=address))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server._stop.set()
    thread.join(10)


def record(server: EngineServer) -> list[tuple[str, int]]:
    """("launch", chunks) and ("route", tokens) in the order the busy loop does them."""
    events: list[tuple[str, int]] = []
    runner, book = server.engine.runner, server.requests
    launch, route = runner.launch, book.route

    def launching(chunks, *args):
        events.append(("launch", len(chunks)))
        return launch(chunks, *args)

    def routing(deltas, *args):
        events.append(("route", sum(len(d.token_ids) for d in deltas)))
        return route(deltas, *args)

    runner.launch, book.route = launching, routing
    return events


@pytest.mark.anyio
async def test_each_step_is_launched_before_the_previous_steps_tokens_are_routed(server, qwen3_dir):
    events = record(server)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    async with AsyncClient(server.address) as client:
        stream = client.stream([5, 6, 7, 8], params)
        chunks = [chunk async for chunk in stream]
        delivered = time.monotonic() - stream.produced
        assert stream.produced <= stream.received <= time.monotonic(), "the reader took the step's tokens after it"
    launches = routed = 0
    for kind, n in events:
        if kind == "launch":
            launches += 1
        elif n:
            routed += n  # tokens of steps 1..routed: step routed + 1 must be on the device already
            assert launches >= routed + 1 or routed == 40, f"step {routed}'s tokens routed before step {routed + 1} ran"
    assert routed == 40 and launches >= 40
    ref = LLM(str(qwen3_dir), **OPTIONS).generate([[5, 6, 7, 8]], params, use_tqdm=False)[0]
    assert [t for c in chunks for t in c.token_ids] == ref.token_ids
    assert 0 <= delivered < 5, "stream.produced is the engine's clock when the last token's step ended"
