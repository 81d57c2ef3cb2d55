"""Fuzzing a live engine process from rogue sockets while a good client streams beside them.

Hypothesis draws frames of every kind a hostile or broken peer could send: random bytes, valid
messages truncated or mutated, msgpack nested thousands deep, known message types with fields of
the wrong types, multi-frame messages, and well-formed adds whose parameters sit at or past every
limit. Half go out from a peer that said hello, half from one that did not. Meanwhile a good client
streams greedy requests. What must hold: every reply is a well-formed engine message, the engine
never stops answering, the good client's outputs equal the offline ones token for token, and once
the rogues are gone the engine is idle with every KV block free and its memory no larger.

About 600 examples (~30 s on two cores); ``NANOSTREAM_FUZZ_EXAMPLES=5000`` runs longer.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path

import anyio
import msgspec
import pytest
import zmq
from helpers import wait_idle
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanostream import LLM, AsyncClient, SamplingParams
from nanostream import protocol as p
from nanostream.client.launch import EngineProcess

pytestmark = pytest.mark.slow  # engine processes, servers or browsers: not in the fast lane

EXAMPLES = int(os.environ.get("NANOSTREAM_FUZZ_EXAMPLES", "600"))
ENGINE_OPTIONS = dict(max_model_len=256, kvcache_block_size=16, num_kvcache_blocks=96, device="cpu")
SERVER_OPTIONS = dict(heartbeat_interval=0.5, client_timeout=5.0)
GOOD_PROMPTS = [[11, 12, 13], [40, 41], [7, 8, 9, 10, 11], [300, 2, 5]]
GOOD = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
VOCAB = 512  # the tiny model's


# ---- what a rogue sends ---------------------------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.binary(max_size=12)
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
TYPES = ["hello", "add", "abort", "get_stats", "heartbeat", "bye", "welcome", "outputs", "error", "", "🚀"]
FIELDS = ["protocol_version", "auth_token", "pid", "tokenizer_digest", "request_id", "prompt_token_ids", "params",
          "timeout", "request_ids", "type"]  # fmt: skip
PARAMS = [f.name for f in dataclasses.fields(SamplingParams)]
EXTREMES = st.sampled_from([0, -1, 1, 2**31, 2**63 - 1, 2**64 - 1, -(2**63), 1e-30, 3.4e38, 1e300, float("nan"),
                            float("inf"), -0.0, 0.5, 2.0, "", "x", None, True, []])  # fmt: skip

wrong_typed = st.builds(
    lambda kind, fields: {"type": kind, **fields},
    st.sampled_from(TYPES),
    st.dictionaries(st.sampled_from(FIELDS), values, max_size=5),
)
extreme_params = st.dictionaries(st.sampled_from(PARAMS), EXTREMES | values, max_size=6)
well_formed_add = st.builds(
    lambda rid, ids, params, max_tokens, timeout: {
        "type": "add",
        "request_id": rid,
        "prompt_token_ids": ids,
        "params": {"max_tokens": max_tokens, **params},
        **({"timeout": timeout} if timeout is not None else {}),
    },
    st.text(max_size=300),
    st.lists(st.integers(-2, VOCAB + 2) | st.sampled_from([2**63 - 1, 2**64 - 1, -(2**63)]), max_size=24),
    extreme_params,
    st.integers(1, 6),
    st.none() | st.floats(allow_nan=True, allow_infinity=True),
)
VALID = [
    p.encode(p.Hello(p.PROTOCOL_VERSION, None, 1)),
    p.encode(p.Add("v", [1, 2, 3], SamplingParams(max_tokens=3, stop=["a"], logprobs=2))),
    p.encode(p.Abort(["v", "w"])),
    p.encode(p.GetStats()),
    p.encode(p.Heartbeat()),
]


@st.composite
def mutated(draw) -> bytes:
    frame = bytearray(draw(st.sampled_from(VALID)))
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(frame) - 1))
        how = draw(st.sampled_from(["flip", "cut", "insert"]))
        if how == "flip":
            frame[i] ^= draw(st.integers(1, 255))
        elif how == "cut":
            del frame[i:]
            if not frame:
                break
        else:
            frame[i:i] = draw(st.binary(min_size=1, max_size=8))
    return bytes(frame)


nested = st.builds(
    lambda opener, depth, end: opener * depth + end,
    st.sampled_from([b"\x91", b"\x81\xa1a", b"\xdc\x00\x01", b"\x82\xa4type\xa3add\xa6params"]),
    st.integers(1, 60_000),
    st.sampled_from([b"\x00", b"", b"\xc0"]),
)
encoded = st.one_of(
    wrong_typed,
    well_formed_add,
    st.builds(
        lambda params: {"type": "add", "request_id": "e", "prompt_token_ids": [1], "params": params}, extreme_params
    ),
).map(msgspec.msgpack.encode)
frames = st.lists(st.binary(max_size=200) | encoded | mutated() | nested, min_size=1, max_size=3)
sends = st.lists(st.tuples(st.booleans(), frames), min_size=1, max_size=6)


# ---- the engine, the good client, the rogues ------------------------------------------------------


@pytest.fixture(scope="module")
def engine(qwen3_dir):
    with EngineProcess(str(qwen3_dir), startup_timeout=120, **ENGINE_OPTIONS, **SERVER_OPTIONS) as proc:
        yield proc


@pytest.fixture(scope="module")
def references(qwen3_dir) -> list[list[int]]:
    llm = LLM(str(qwen3_dir), **ENGINE_OPTIONS)
    return [out.token_ids for out in llm.generate(GOOD_PROMPTS, GOOD, use_tqdm=False)]


class GoodClient(threading.Thread):
    """Streams the good prompts in a loop, two at a time, until ``stop`` is set."""

    def __init__(self, address: str) -> None:
        super().__init__(daemon=True)
        self.address, self.stop = address, threading.Event()
        self.results: list[tuple[int, list[int], str | None]] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            anyio.run(self._main)
        except BaseException as exc:
            self.error = exc

    async def _main(self) -> None:
        async with AsyncClient(self.address) as client:

            async def one(i: int) -> None:
                ids, finish = [], None
                async for chunk in client.stream(GOOD_PROMPTS[i], GOOD):
                    ids += chunk.token_ids
                    finish = chunk.finish_reason
                self.results.append((i, ids, finish))

            n = 0
            while not self.stop.is_set():
                async with anyio.create_task_group() as tg:
                    for k in range(2):
                        tg.start_soon(one, (n + k) % len(GOOD_PROMPTS))
                n += 2


class Rogue:
    """Two raw DEALERs: one that said hello (and says it again before each example), one that never did."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.welcomed, self.stranger = self._socket(address), self._socket(address)
        self.replies = 0

    def _socket(self, address: str) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        return sock

    def send(self, welcomed: bool, frames: list[bytes]) -> None:
        (self.welcomed if welcomed else self.stranger).send_multipart(frames)

    def hello(self) -> None:
        self.welcomed.send(VALID[0])

    def drain(self, quiet: float = 0.02, limit: float = 1.0) -> None:
        """Read replies until none came for ``quiet`` s; each must be a well-formed engine message."""
        poller = zmq.Poller()
        for sock in (self.welcomed, self.stranger):
            poller.register(sock, zmq.POLLIN)
        end = time.monotonic() + limit
        while time.monotonic() < end and (ready := dict(poller.poll(quiet * 1000))):
            for sock in ready:
                message = p.decode_engine_message(sock.recv())  # raises if the engine sent garbage
                assert not isinstance(message, p.Welcome) or sock is self.welcomed or message.protocol_version
                self.replies += 1

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_fuzzed_frames_cost_the_good_client_nothing(engine, references):
    good = GoodClient(engine.address)
    good.start()
    rogue = Rogue(engine.address)
    rogue.hello()
    rogue.drain()
    before = rss_mib(engine.pid)
    sent = 0

    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(sends)
    def fuzz(batch) -> None:
        nonlocal sent
        rogue.hello()
        for welcomed, parts in batch:
            rogue.send(welcomed, parts)
            sent += 1
        rogue.drain()
        assert engine.proc.poll() is None, "the engine process exited:\n" + engine.output()

    try:
        fuzz()
        rogue.drain(quiet=0.2, limit=5)
    finally:
        rogue.close()
        good.stop.set()
        good.join(60)
    logged = engine.output()
    logged = logged[max(0, logged.find("Traceback")) :][:6000]  # from the step that failed, if one did
    assert good.error is None, f"{good.error!r}\nthe engine logged:\n{logged}"
    assert len(good.results) >= 8, "the good client kept streaming"
    for i, ids, finish in good.results:
        assert (ids, finish) == (references[i], "length"), f"prompt {i}"
    grown = rss_mib(engine.pid) - before
    assert grown < 64, f"the engine's RSS grew by {grown:.0f} MiB over {sent} frames"

    async def idle() -> None:
        async with AsyncClient(engine.address) as client:
            await wait_idle(client, 10)  # the rogues' requests were aborted when they disconnected
            with anyio.fail_after(SERVER_OPTIONS["client_timeout"] + 2):
                while (await client.stats()).clients != 1:  # the rogues are gone from the engine too
                    await anyio.sleep(0.05)

    anyio.run(idle)
    print(f"{sent} rogue sends, {rogue.replies} replies, {len(good.results)} good streams, RSS {grown:+.1f} MiB")
