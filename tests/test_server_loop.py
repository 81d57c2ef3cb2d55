"""The engine process's busy loop keeps the engine's pipelined step: a step is launched before the
previous step's tokens are routed to clients, so routing, encoding and sending overlap the device's
work; and every token still reaches its stream, in order, once, with a delivery stamp."""

from __future__ import annotations

import tempfile
import threading
import time

import anyio
import pytest

from nanostream import LLM, AsyncClient, SamplingParams
from nanostream.config import EngineConfig, ServerConfig
from nanostream.engine.process.server import EngineServer

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


@pytest.mark.anyio
async def test_a_burst_of_adds_is_read_a_few_steps_worth_at_a_time_with_steps_launched_between(qwen3_dir):
    # Twelve 100-token prompts wait in the socket at once (the loop is held inside a step); with
    # max_num_batched_tokens 128 the loop reads Adds of at most 2 x 128 prompt tokens (the one that
    # crosses it included) before it launches the next step, so the device has work while the rest
    # are read. Every stream still gets exactly its tokens.
    options = {**OPTIONS, "max_num_batched_tokens": 128, "max_num_seqs": 16}
    address = f"ipc://{tempfile.mkdtemp(prefix='ns-')}/engine.sock"
    server = EngineServer(EngineConfig(model=str(qwen3_dir), **options), ServerConfig(address=address))
    events, gate = [], threading.Event()
    engine, runner = server.engine, server.engine.runner
    add, launch = engine.add_request, runner.launch

    def adding(request_id, prompt, params, images=()):
        events.append(("add", len(prompt)))
        return add(request_id, prompt, params, images)

    def launching(chunks, *args, **kwargs):
        events.append(("launch", len(chunks)))
        gate.wait(10)  # the first step holds the loop until the burst is queued
        return launch(chunks, *args, **kwargs)

    engine.add_request, runner.launch = adding, launching
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[3 + (i * 7 + j) % 400 for j in range(100)] for i in range(13)]
    try:
        async with AsyncClient(server.address) as client:

            async def run(prompt):
                return [t async for chunk in client.stream(prompt, params) for t in chunk.token_ids]

            async with anyio.create_task_group() as tg:
                results = {}

                async def keep(i):
                    results[i] = await run(prompts[i])

                tg.start_soon(keep, 0)
                while not events:
                    await anyio.sleep(0.01)
                for i in range(1, len(prompts)):
                    tg.start_soon(keep, i)
                await anyio.sleep(0.3)  # the twelve Adds are sent: they wait in the socket
                gate.set()
    finally:
        gate.set()
        server._stop.set()
        thread.join(10)
    per_iteration, taken = [], 0
    for kind, n in events:
        if kind == "add":
            taken += n
        elif taken:
            per_iteration.append(taken)
            taken = 0
    assert sum(per_iteration) + taken == 100 * len(prompts)
    assert max(per_iteration) <= 2 * 128 + 99, per_iteration
    assert len(per_iteration) >= 4, per_iteration  # 1,200 tokens of the burst, 300 an iteration at most
    ref = LLM(str(qwen3_dir), **options).generate(prompts, params, use_tqdm=False)
    assert [results[i] for i in range(len(prompts))] == [o.token_ids for o in ref]
