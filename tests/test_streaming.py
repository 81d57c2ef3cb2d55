"""Streaming through real engine processes, real sockets and real client processes (no mocks).

What a user of ``AsyncClient`` relies on: streamed text and token ids equal the offline ``LLM``'s,
many streams of many processes never mix, leaving a stream early frees its KV blocks at once, a dead
client's requests are aborted, a dead engine surfaces as ``EngineDeadError`` in every open stream,
and a slow consumer never holds up the others.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import multiprocessing
import multiprocessing.forkserver
import os
import random
import signal
import socket
import time
from dataclasses import replace
from pathlib import Path

import anyio
import anyio.to_thread
import numpy as np
import pytest
from helpers import engine_processes, wait_idle

from nanostream import LLM, AsyncClient, ClientClosedError, EngineDeadError, InvalidRequestError, SamplingParams

pytestmark = pytest.mark.slow  # engine processes, servers or browsers: not in the fast lane

# The streaming layer is the subject here: CPU engines, several at once, also on a GPU machine
# (where each would otherwise claim gpu_memory_utilization of the one device).
ENGINE_OPTIONS = dict(kvcache_block_size=16, device="cpu")
CLIENT_TIMEOUT = 1.5  # the tuned engine's: a client silent this long is dropped
TUNED_OPTIONS = dict(stream_interval=4, heartbeat_interval=0.2, client_timeout=CLIENT_TIMEOUT, **ENGINE_OPTIONS)
# A request that runs for seconds (2000 decode steps) unless it is aborted.
LONG = dict(temperature=0, max_tokens=2000, ignore_eos=True)
ABORT_WITHIN = 1.5  # seconds for an abort to free the blocks; LONG would need longer to end on its own

# Client processes come from a fork server that imported nanostream once: each is a fresh process
# with its own AsyncClient, without paying the ~5 s torch import that a spawned child pays.
CLIENTS = multiprocessing.get_context("forkserver")


def run(main, *args, limit: float = 60.0, loop: str = "asyncio"):
    """Run ``main(*args)`` under an event loop, failing (not hanging) after ``limit`` seconds."""

    async def bounded():
        with anyio.fail_after(limit):
            return await main(*args)

    return anyio.run(bounded, backend="asyncio", backend_options={"use_uvloop": loop == "uvloop"})


def joined(chunks) -> tuple[str, list[int]]:
    return "".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids]


def assert_matches(chunks, ref) -> None:
    """The streamed chunks add up to the offline output, and only the last one carries a finish reason."""
    text, ids = joined(chunks)
    assert ids == ref.token_ids
    assert text == ref.text
    assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].finish_reason == ref.finish_reason


async def collect(stream) -> list:
    return [chunk async for chunk in stream]


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, **kwargs)


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(str(qwen3_dir), **ENGINE_OPTIONS)


@pytest.fixture(scope="module")
def engines(qwen3_dir):
    """Every engine this module needs, started at once (a start is mostly imports and loading).

    "main" is shared; "tuned" has non-default server options (tokens sent 4 at a time, quick
    liveness checks); "to_kill" and "to_stop" are each ended by one test.
    """
    CLIENTS.set_forkserver_preload(["nanostream"])
    multiprocessing.forkserver.ensure_running()  # imports nanostream while the engines start
    options = {"main": ENGINE_OPTIONS, "tuned": TUNED_OPTIONS, "to_kill": ENGINE_OPTIONS, "to_stop": ENGINE_OPTIONS}
    with engine_processes(str(qwen3_dir), options) as started:
        yield started


@pytest.fixture(scope="module")
def engine(engines):
    return engines["main"]


@pytest.fixture(scope="module")
def tuned_engine(engines):
    return engines["tuned"]


# ---- 1. streamed output == offline output ---------------------------------------------------------


def test_stream_generate_and_chat_match_offline(engine, llm):
    requests = [
        ("Once upon a time", greedy(max_tokens=48, ignore_eos=True)),
        ([11, 12, 13, 14], greedy(max_tokens=40, ignore_eos=True)),
        ("Seven small boats 🚀 東京 waited", greedy(max_tokens=40)),  # prompt emoji/CJK span several tokens
        (list(range(3, 40)), greedy(max_tokens=33, ignore_eos=True)),  # prompt over two KV blocks
    ]
    refs = llm.generate([r[0] for r in requests], [r[1] for r in requests], use_tqdm=False)
    conversation = [
        {"role": "system", "content": "You keep a lighthouse."},
        {"role": "user", "content": "Write to the sea 🌊"},
    ]
    chat_ref = llm.chat(conversation, greedy(max_tokens=24, ignore_eos=True), use_tqdm=False)[0]

    async def main():
        async with AsyncClient(engine.address) as client:
            streamed = [None] * len(requests)

            async def one(i, prompt, params):
                streamed[i] = await collect(client.stream(prompt, params))

            async with anyio.create_task_group() as tg:  # concurrently, in one client
                for i, (prompt, params) in enumerate(requests):
                    tg.start_soon(one, i, prompt, params)
            completion = await client.generate("Once upon a time", max_tokens=48, temperature=0, ignore_eos=True)
            chat = await collect(client.chat(conversation, max_tokens=24, temperature=0, ignore_eos=True))
        return streamed, completion, chat

    streamed, completion, chat = run(main)
    for chunks, ref in zip(streamed, refs):
        assert_matches(chunks, ref)
        assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)
        assert chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert (completion.text, completion.token_ids, completion.finish_reason) == (
        refs[0].text,
        refs[0].token_ids,
        refs[0].finish_reason,
    )
    assert completion.usage.completion_tokens == len(refs[0].token_ids)
    assert_matches(chat, chat_ref)


def test_n_samples_merge_into_the_same_outputs_through_llm_and_async_client(engine, llm):
    """One sample group serves both: seeded samples, some ended by a stop string, merge into equal outputs."""
    prompts = ["The keeper wrote", [11, 12, 13]]
    base = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=24, ignore_eos=True)
    probe = llm.generate(prompts[0], base, use_tqdm=False)[0].outputs[1].text
    assert len(probe) >= 8, probe
    params = replace(base, stop=[probe[5:8]])  # sample 1 of the first prompt ends by it
    refs = llm.generate(prompts, params, use_tqdm=False)

    async def main():
        async with AsyncClient(engine.address) as client:
            return [await client.generate(prompt, params) for prompt in prompts]

    for completion, ref in zip(run(main), refs):
        assert completion.outputs == ref.outputs and len(ref.outputs) == 3
        assert (completion.text, completion.token_ids, completion.finish_reason) == (
            ref.text,
            ref.token_ids,
            ref.finish_reason,
        )
        assert completion.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert completion.usage.completion_tokens == sum(len(o.token_ids) for o in ref.outputs)
    assert refs[0].outputs[1].stop_reason == probe[5:8] and refs[0].outputs[1].finish_reason == "stop"


@pytest.mark.parametrize(
    "prompt", [123, None, {"text": "hi"}, [1.5, 2.5], b"abc"], ids=["int", "none", "dict", "floats", "bytes"]
)
def test_a_prompt_of_another_type_raises_the_same_error_offline_and_streamed(engine, llm, prompt):
    with pytest.raises(InvalidRequestError, match="a prompt must be a string or a list of token ids") as offline:
        llm.generate(prompt, use_tqdm=False)

    async def main():
        async with AsyncClient(engine.address) as client:
            with pytest.raises(InvalidRequestError) as streamed:
                client.stream(prompt, max_tokens=4)
            return streamed.value

    assert str(run(main)) == str(offline.value)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([1, "a"], "prompt token id 'a' is outside the model's vocabulary"),
        ([True, 3], "prompt token id True is outside the model's vocabulary"),
        ([-1, 2], "prompt token id -1 is outside the model's vocabulary"),
        ([1, 2**70], f"prompt token id {2**70} is outside the model's vocabulary"),
    ],
    ids=["str", "bool", "negative", "huge"],
)
def test_a_bad_token_id_raises_the_same_error_offline_and_streamed_and_the_engine_serves_on(
    engine, llm, prompt, message
):
    with pytest.raises(InvalidRequestError, match=message) as offline:
        llm.generate(prompt, use_tqdm=False)

    async def main():
        async with AsyncClient(engine.address) as client:
            with pytest.raises(InvalidRequestError) as streamed:
                client.stream(prompt, max_tokens=4)
            served = await client.generate([5, 6, 7], max_tokens=3, ignore_eos=True)
            return streamed.value, served

    streamed, served = run(main)
    assert str(streamed) == str(offline.value)
    assert len(served.outputs[0].token_ids) == 3


def test_numpy_token_ids_are_token_ids(engine, llm):
    ids = np.array([5, 6, 7], dtype=np.int64)
    want = llm.generate([5, 6, 7], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0].token_ids
    assert llm.generate(list(ids), SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0].token_ids == want

    async def main():
        async with AsyncClient(engine.address) as client:
            return (await client.generate(list(ids), max_tokens=4, temperature=0)).outputs[0].token_ids

    assert run(main) == want


def test_tokens_arrive_as_they_are_generated(engine):
    """The first chunk of a 2000-step request comes long before the last step (a short request may
    legitimately arrive in one merged chunk when the consumer is slower than the engine)."""

    async def main():
        async with AsyncClient(engine.address) as client:
            async for chunk in client.stream("The keeper wrote", **LONG):
                return len(chunk.token_ids), chunk.finish_reason

    n, finish_reason = run(main)
    assert finish_reason is None and 1 <= n < LONG["max_tokens"] // 2


# ---- 2. many client processes, many streams each ---------------------------------------------------


def client_process(address: str, requests: list[dict], ready, go, results) -> None:
    """One client process: its own AsyncClient, all its streams at once; chunks go to ``results``."""

    async def main():
        async with AsyncClient(address, timeout=30) as client:
            ready.set()
            assert await anyio.to_thread.run_sync(go.wait, 60), "never told to start"
            streamed = [None] * len(requests)

            async def one(i, req):
                streamed[i] = [(c.text, c.token_ids, c.finish_reason) async for c in client.stream(**req)]

            async with anyio.create_task_group() as tg:
                for i, req in enumerate(requests):
                    tg.start_soon(one, i, req)
        return streamed

    try:
        results.put((os.getpid(), anyio.run(main)))
    except BaseException as exc:
        results.put((os.getpid(), repr(exc)))
        raise


def mixed_requests(n: int) -> list[dict]:
    """Distinct prompts (text, ids, some sharing a two-block prefix), varied lengths, EOS or not."""
    rng = random.Random(1)
    shared = [rng.randrange(3, 400) for _ in range(32)]
    words = ["river", "mill", "keeper", "lamp", "boats", "tide", "sea", "letters", "sand", "grain"]
    requests = []
    for i in range(n):
        if i % 3 == 0:
            prompt = " ".join(rng.choice(words) for _ in range(rng.randrange(2, 12)))
        elif i % 3 == 1:
            prompt = [rng.randrange(3, 400) for _ in range(rng.randrange(1, 40))]
        else:
            prompt = [*shared, i, rng.randrange(3, 400)]
        params = dict(temperature=0, max_tokens=rng.randrange(4, 48), ignore_eos=i % 2 == 0)
        requests.append(dict(prompt=prompt, **params))
    return requests


def test_four_client_processes_of_sixteen_streams(engine, llm):
    requests = mixed_requests(64)
    refs = llm.generate(
        [r["prompt"] for r in requests],
        [SamplingParams(**{k: v for k, v in r.items() if k != "prompt"}) for r in requests],
        use_tqdm=False,
    )
    ready, go, results = [CLIENTS.Event() for _ in range(4)], CLIENTS.Event(), CLIENTS.Queue()
    procs = [
        CLIENTS.Process(target=client_process, args=(engine.address, requests[i::4], ready[i], go, results))
        for i in range(4)
    ]
    for proc in procs:
        proc.start()
    try:
        assert all(event.wait(60) for event in ready), "every client process connected"

        async def connected():
            async with AsyncClient(engine.address) as client:
                return (await client.stats()).clients

        assert run(connected) >= 5, "the four client processes are connected at the same time"
        go.set()
        streamed = dict(results.get(timeout=60) for _ in procs)
        for proc in procs:
            proc.join(10)
    finally:
        for proc in procs:
            proc.kill()
    for i, proc in enumerate(procs):
        assert proc.exitcode == 0, streamed.get(proc.pid)
        assert len(streamed[proc.pid]) == 16
        for chunks, ref in zip(streamed[proc.pid], refs[i::4]):
            assert ([t for c in chunks for t in c[1]], "".join(c[0] for c in chunks)) == (ref.token_ids, ref.text)
            assert [c[2] for c in chunks] == [None] * (len(chunks) - 1) + [ref.finish_reason]


# ---- 3. leaving a stream early frees its blocks -------------------------------------------------

K = 5  # tokens read before leaving


async def leave_by_break(client, held):
    n = 0
    async for chunk in client.stream("The keeper wrote", **LONG):
        n += len(chunk.token_ids)
        if n >= K:
            held.append(await client.stats())
            break
    return await wait_idle(client, ABORT_WITHIN)


async def leave_by_break_keeping_the_stream(client, held):
    stream = client.stream("The keeper wrote", **LONG)
    n = 0
    async for chunk in stream:
        n += len(chunk.token_ids)
        if n >= K:
            held.append(await client.stats())
            break
    return await wait_idle(client, ABORT_WITHIN)  # `stream` is still referenced


async def leave_by_aclose(client, held):
    stream = client.stream("The keeper wrote", **LONG)
    n = 0
    async for chunk in stream:
        n += len(chunk.token_ids)
        if n >= K:
            held.append(await client.stats())
            await stream.aclose()
            break
    assert [c async for c in stream] == [], "a closed stream yields nothing more"
    return await wait_idle(client, ABORT_WITHIN)  # `stream` is still referenced: aclose() alone ended it


async def leave_async_with(client, held):
    async with client.stream("The keeper wrote", **LONG) as stream:
        n = 0
        async for chunk in stream:
            n += len(chunk.token_ids)
            if n >= K:
                held.append(await client.stats())
                break
    return await wait_idle(client, ABORT_WITHIN)  # `stream` is still referenced: leaving the block ended it


async def leave_by_cancel_scope(client, held):
    with anyio.CancelScope() as scope:
        n = 0
        async for chunk in client.stream("The keeper wrote", **LONG):
            n += len(chunk.token_ids)
            if n >= K and not scope.cancel_called:
                held.append(await client.stats())
                scope.cancel()
    assert scope.cancelled_caught
    return await wait_idle(client, ABORT_WITHIN)


async def cancel_consumer_task(client, held, in_body: bool):
    """Cancel the task that reads the stream, while it waits for tokens or while it is busy in its loop body."""
    got_k = anyio.Event()

    async def consumer():
        n = 0
        async for chunk in client.stream("The keeper wrote", **LONG):
            n += len(chunk.token_ids)
            if n >= K and not got_k.is_set():
                held.append(await client.stats())
                got_k.set()
                if in_body:
                    await anyio.sleep_forever()  # e.g. a send to a web client that went away

    async with anyio.create_task_group() as tg:
        tg.start_soon(consumer)
        await got_k.wait()
        await anyio.sleep(0.05)
        tg.cancel_scope.cancel()
    return await wait_idle(client, ABORT_WITHIN)


LEAVE = {
    "break": leave_by_break,
    "break_keeping_the_stream": leave_by_break_keeping_the_stream,
    "aclose": leave_by_aclose,
    "async_with": leave_async_with,
    "cancel_scope": leave_by_cancel_scope,
    "cancel_task_waiting": lambda client, held: cancel_consumer_task(client, held, in_body=False),
    "cancel_task_in_body": lambda client, held: cancel_consumer_task(client, held, in_body=True),
}


@pytest.mark.parametrize(
    "leave",
    [
        "break",
        "aclose",
        "async_with",
        "cancel_scope",
        "cancel_task_waiting",
        "cancel_task_in_body",
        "break_keeping_the_stream",
    ],
)
def test_leaving_a_stream_aborts_it(engine, leave):
    async def main():
        async with AsyncClient(engine.address) as client:
            await wait_idle(client, ABORT_WITHIN)
            held = []
            elapsed = await LEAVE[leave](client, held)
            again = await client.generate([5, 6, 7], max_tokens=3, temperature=0, ignore_eos=True)
            return held[0], elapsed, again

    held, elapsed, again = run(main)
    assert held.running == 1 and held.free_kv_blocks < held.total_kv_blocks, "the request was running"
    assert elapsed < ABORT_WITHIN
    assert len(again.token_ids) == 3, "the client still works after leaving a stream"


def test_a_client_connected_by_one_task_is_closed_by_another(engine):
    """No task owns a client: one that connected and ended, another that streams, a third that closes."""

    async def main():
        client = AsyncClient(engine.address)
        await asyncio.create_task(client.connect())  # that task has ended; the client goes on
        stream = client.stream("The keeper wrote", **LONG)
        first = await stream.__anext__()
        async with AsyncClient(engine.address) as watcher:
            held = await watcher.stats()
            await asyncio.create_task(client.close())
            with pytest.raises(ClientClosedError):
                await stream.__anext__()
            await client.close()  # again: nothing to do
            with pytest.raises(ClientClosedError):
                client.stream("The keeper wrote", **LONG)
            return first, held, await wait_idle(watcher, ABORT_WITHIN)

    first, held, elapsed = run(main)
    assert first.token_ids and held.running == 1, "the request was running"
    assert elapsed < ABORT_WITHIN, "closing the client aborted its request"


# ---- 4. a client killed mid-stream --------------------------------------------------------------


def doomed_client_process(address: str, running) -> None:
    """A client process with four long streams, killed by the test once they are running."""

    async def drain(stream):
        async for _ in stream:
            pass

    async def main():
        async with AsyncClient(address) as client:
            streams = [client.stream([7 + i, 8, 9], **LONG) for i in range(4)]
            for stream in streams:
                await stream.__anext__()
            running.put(True)  # ready to be killed
            async with anyio.create_task_group() as tg:
                for stream in streams:
                    tg.start_soon(drain, stream)

    anyio.run(main)


def test_killed_client_requests_are_aborted(tuned_engine):
    address, running = tuned_engine.address, CLIENTS.Queue()
    child = CLIENTS.Process(target=doomed_client_process, args=(address, running))
    child.start()
    try:
        assert running.get(timeout=30), "the doomed client's streams are running"

        async def main():
            async with AsyncClient(address) as observer:
                before = await observer.stats()
                os.kill(child.pid, signal.SIGKILL)
                killed = time.monotonic()
                await wait_idle(observer, CLIENT_TIMEOUT + 2.0)
                return before, time.monotonic() - killed, await observer.stats()

        before, elapsed, after = run(main)
    finally:
        child.kill()
        child.join()
    assert before.running == 4
    (doomed,) = (name for name, n in before.requests_by_client.items() if n == 4)  # the engine's name for it
    # Its connection closed with the process: the engine aborts at once, not after client_timeout.
    assert elapsed < CLIENT_TIMEOUT, elapsed
    assert set(before.requests_by_client) - set(after.requests_by_client) == {doomed}, "the dead client is gone"
    assert f"client {doomed} disconnected" in tuned_engine.output(), "its requests were aborted, not run to the end"


# ---- 5. the engine killed: every open stream fails --------------------------------------------------


def test_killed_engine_fails_every_stream(engines):
    timeout, eng = 2.0, engines["to_kill"]

    async def main():
        async with AsyncClient(eng.address, timeout=timeout) as client:
            errors, started = {}, [anyio.Event() for _ in range(3)]

            async def one(i):
                try:
                    async for _ in client.stream([20 + i, 21, 22], **LONG):
                        started[i].set()
                except EngineDeadError as exc:
                    errors[i] = (exc, time.monotonic())

            async with anyio.create_task_group() as tg:
                for i in range(3):
                    tg.start_soon(one, i)
                for event in started:
                    await event.wait()
                os.kill(eng.pid, signal.SIGKILL)
                killed = time.monotonic()
            with pytest.raises(EngineDeadError):  # and the client says so at once from now on
                client.stream("more", max_tokens=4)
        # A new client finds only the socket file the killed engine left behind.
        assert Path(eng.address.removeprefix("ipc://")).exists()
        start = time.monotonic()
        with pytest.raises(EngineDeadError) as info:
            await AsyncClient(eng.address, timeout=timeout).connect()
        return errors, killed, info.value, time.monotonic() - start

    errors, killed, connect_error, connect_time = run(main, limit=20)
    assert sorted(errors) == [0, 1, 2]
    for exc, when in errors.values():
        assert when - killed < timeout + 1.0
        assert eng.address in str(exc)
    assert connect_time < timeout + 1.0
    assert eng.address in str(connect_error) and "nanostream serve" in str(connect_error)
    Path(eng.address.removeprefix("ipc://")).unlink()


@pytest.mark.parametrize("where", ["ipc", "tcp"])
def test_connect_to_nothing_fails_within_timeout(where, tmp_path):
    timeout = 0.5
    if where == "ipc":
        address = f"ipc://{tmp_path}/nothing-here.sock"
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            address = f"tcp://127.0.0.1:{s.getsockname()[1]}"  # a port nobody listens on

    async def main():
        start = time.monotonic()
        with pytest.raises(EngineDeadError) as info:
            async with AsyncClient(address, timeout=timeout):
                pass
        return info.value, time.monotonic() - start

    exc, elapsed = run(main)
    assert elapsed < timeout + 1.0
    assert address in str(exc) and "nanostream serve" in str(exc)


# ---- 6. the engine stopped with SIGTERM ----------------------------------------------------------


def test_sigterm_ends_streams_with_shutdown_message(engines):
    eng = engines["to_stop"]
    socket_file = Path(eng.address.removeprefix("ipc://"))
    assert socket_file.exists()

    async def main():
        async with AsyncClient(eng.address, timeout=2) as client:
            errors, started = {}, [anyio.Event() for _ in range(3)]

            async def one(i):
                try:
                    async for _ in client.stream([30 + i, 31], **LONG):
                        started[i].set()
                except EngineDeadError as exc:
                    errors[i] = (str(exc), time.monotonic())

            async with anyio.create_task_group() as tg:
                for i in range(3):
                    tg.start_soon(one, i)
                for event in started:
                    await event.wait()
                eng.proc.send_signal(signal.SIGTERM)
                stopped = time.monotonic()
            # A request sent after the shutdown also fails, within the client's timeout.
            with pytest.raises(EngineDeadError):
                await client.generate("late", max_tokens=4)
        return errors, stopped

    errors, stopped = run(main, limit=20)
    assert eng.proc.wait(timeout=20) == 0
    assert sorted(errors) == [0, 1, 2]
    for message, when in errors.values():
        assert "shutting down" in message
        assert when - stopped < 1.5, "the engine told the streams; they did not wait for the 2 s timeout"
    assert not socket_file.exists()


# ---- 7. other event loops ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "loop",
    [
        "asyncio",
        pytest.param(
            "uvloop",
            marks=pytest.mark.skipif(importlib.util.find_spec("uvloop") is None, reason="uvloop is not installed"),
        ),
    ],
)
def test_event_loop(engine, llm, loop):
    prompts = [[40 + i, 41, 42] for i in range(4)]
    refs = llm.generate(prompts, greedy(max_tokens=24, ignore_eos=True), use_tqdm=False)

    async def main():
        async with AsyncClient(engine.address) as client:
            streamed = [None] * len(prompts)

            async def one(i):
                streamed[i] = await collect(client.stream(prompts[i], max_tokens=24, temperature=0, ignore_eos=True))

            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
            with anyio.move_on_after(0.2):
                async for _ in client.stream("cancelled", **LONG):
                    pass
            await wait_idle(client, ABORT_WITHIN)
        return streamed, type(asyncio.get_running_loop()).__module__

    streamed, loop_module = run(main, loop=loop)
    assert loop_module.split(".")[0] == loop
    for chunks, ref in zip(streamed, refs):
        assert_matches(chunks, ref)


# ---- 8. a slow consumer ----------------------------------------------------------------------------


def test_slow_consumer_does_not_hold_up_other_streams(engine, llm):
    n, n_slow = 64, 200  # the slow stream is long enough that its first chunk comes before its end
    prompts = [[50 + i, 51, 52, 53] for i in range(4)]  # prompts[0] is read slowly
    lengths = [n_slow] + [n] * 3
    refs = llm.generate(prompts, [greedy(max_tokens=k, ignore_eos=True) for k in lengths], use_tqdm=False)

    async def main():
        async with AsyncClient(engine.address) as client:
            fast_done, slow, fast = anyio.Event(), [], {}

            async def read_slowly():
                async for chunk in client.stream(prompts[0], max_tokens=n_slow, temperature=0, ignore_eos=True):
                    slow.append(chunk)
                    if len(slow) == 1:  # stop reading until every other stream has ended
                        await fast_done.wait()
                    await anyio.sleep(0.05)

            async def read_fast(i):
                fast[i] = await collect(client.stream(prompts[i], max_tokens=n, temperature=0, ignore_eos=True))

            async with anyio.create_task_group() as tg:
                tg.start_soon(read_slowly)
                # Were the streams coupled (a shared queue, a reader waiting on the slow one), the
                # fast streams would never end while the slow one stands still.
                with anyio.fail_after(20):
                    async with anyio.create_task_group() as fast_tg:
                        for i in range(1, len(prompts)):
                            fast_tg.start_soon(read_fast, i)
                fast_done.set()
        return slow, fast

    slow, fast = run(main)
    for i in fast:
        assert_matches(fast[i], refs[i])
    assert_matches(slow, refs[0])  # every token, in order
    sizes = [len(c.token_ids) for c in slow]
    assert sizes[0] < n_slow and sizes[1] > n // 2, f"the tokens that waited came merged into one chunk: {sizes}"


# ---- 9. stream_interval ----------------------------------------------------------------------------


def test_stream_interval_batches_tokens(tuned_engine, llm):
    n, interval = 45, 4
    ref = llm.generate("Once upon a time", greedy(max_tokens=n, ignore_eos=True), use_tqdm=False)[0]

    async def main():
        async with AsyncClient(tuned_engine.address) as client:
            return await collect(client.stream("Once upon a time", max_tokens=n, temperature=0, ignore_eos=True))

    chunks = run(main)
    assert_matches(chunks, ref)
    # The engine sends the first token at once, then every 4th, then the rest at the end; a client
    # that falls behind merges messages, so a chunk ends only where a message ends.
    sizes = [len(c.token_ids) for c in chunks]
    ends = set(itertools.accumulate(sizes))
    assert ends <= {1, *range(1 + interval, n, interval), n}, f"chunk sizes {sizes}"
    assert len(chunks) < n / 2, f"chunk sizes {sizes}"


# A stop string that completes inside a chunk of several tokens (here: stream_interval=4) must end
# the stream exactly where the offline LLM ends it, however many tokens the engine sent past it.
@pytest.mark.parametrize("max_tokens", [40, 7], ids=["tokens_past_stop", "length_in_same_chunk"])
def test_stop_string_inside_a_chunk(tuned_engine, llm, max_tokens):
    prompt = [11, 12, 13, 14]
    full = llm.generate([prompt], greedy(max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
    stop = full.text[12:15]
    params = greedy(max_tokens=max_tokens, ignore_eos=True, stop=[stop])
    ref = llm.generate([prompt], params, use_tqdm=False)[0]
    assert ref.finish_reason == "stop" and ref.text == full.text[: full.text.index(stop)]
    assert len(ref.token_ids) % 4 != 1, "the token that completes the stop string is not the last of a message"

    async def main():
        async with AsyncClient(tuned_engine.address) as client:
            chunks = await collect(client.stream(prompt, params))
            await wait_idle(client, ABORT_WITHIN)  # the request was ended in the engine too
            return chunks

    chunks = run(main)
    assert_matches(chunks, ref)
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)
