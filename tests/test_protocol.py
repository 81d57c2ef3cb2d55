"""The wire protocol and the engine process under hostile and edge-case traffic.

Everything past the unit tests runs real ``nanostream serve`` processes and talks to them over real
ZeroMQ sockets: ``AsyncClient`` for the legitimate traffic, bare DEALER sockets (``Peer``) for the
frames no well-behaved client would send.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import get_args

import anyio
import msgspec
import pytest
import zmq
import zmq.asyncio
from safetensors.torch import load_file, save_file
from zmq.utils.monitor import parse_monitor_message

from nanostream import LLM, AsyncClient, InvalidRequestError, ProtocolError, SamplingParams
from nanostream import protocol as p
from nanostream.client.launch import EngineProcess
from nanostream.testing import build_tokenizer, make_tiny_model

pytestmark = pytest.mark.slow  # engine processes, servers or browsers: not in the fast lane

# Small, explicit KV pools: engines start fast, and a leaked block shows in the free-block count.
# CPU engines: the subject is the protocol, and several engines run at once (also on a GPU machine).
ENGINE_OPTIONS = dict(max_model_len=256, kvcache_block_size=16, num_kvcache_blocks=96, device="cpu")
PROMPT = "Once upon a time"  # the tiny model's greedy continuation of it has partial-UTF-8 byte tokens
GREEDY = dict(temperature=0.0, max_tokens=64, ignore_eos=True)
TOKEN = "s3cret-token-for-tests"
# A text whose byte-level tokens are all different (é, 世, 界 and 🚀 are 2-4 byte tokens each); the
# scripted model below repeats it forever.
SCRIPT = "é世界🚀 mill"


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


def start_engine(model: Path | None, env: dict[str, str | None] | None = None, **options) -> EngineProcess:
    """An engine process whose environment has no NANOSTREAM_* settings beyond ``env``."""
    overrides = {"NANOSTREAM_ADDRESS": None, "NANOSTREAM_AUTH_TOKEN": None, **(env or {})}
    with pytest.MonkeyPatch.context() as mp:
        for name, value in overrides.items():
            if value is None:
                mp.delenv(name, raising=False)
            else:
                mp.setenv(name, value)
        return EngineProcess(str(model) if model else None, startup_timeout=120, **options).start()


@pytest.fixture(scope="module")
def engine(qwen3_dir):
    proc = start_engine(qwen3_dir, **ENGINE_OPTIONS)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    """The offline engine: what every stream of the same request must reproduce token for token."""
    return LLM(str(qwen3_dir), **ENGINE_OPTIONS)


def offline(llm: LLM, prompt: str | list[int], **params):
    return llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]


@pytest.fixture(autouse=True)
def _no_env_engine(monkeypatch):
    monkeypatch.delenv("NANOSTREAM_ADDRESS", raising=False)
    monkeypatch.delenv("NANOSTREAM_AUTH_TOKEN", raising=False)


class Peer:
    """A bare DEALER socket that sends exactly the frames a test gives it."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, identity: bytes | None = None) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            self.sock.setsockopt(zmq.ROUTING_ID, identity)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.sock.connect(address)

    async def send(self, *frames: bytes) -> None:
        await self.sock.send_multipart(list(frames))

    async def recv(self, timeout: float = 5.0) -> p.EngineMessage | None:
        """The next message other than a heartbeat, or None if none came within ``timeout`` s."""
        with anyio.move_on_after(timeout):
            while True:
                message = p.decode_engine_message(await self.sock.recv())
                if not isinstance(message, p.Heartbeat):
                    return message
        return None

    async def request(self, *frames: bytes) -> p.EngineMessage | None:
        await self.send(*frames)
        return await self.recv()

    async def hello(self, **fields) -> p.EngineMessage | None:
        return await self.request(p.encode(p.Hello(**{"protocol_version": p.PROTOCOL_VERSION, **fields})))

    async def outputs(self, finished: int = 1, timeout: float = 20.0) -> list[p.RequestDelta]:
        """Every RequestOutput of the next Outputs messages, until ``finished`` of them carried a finish_reason."""
        got: list[p.RequestDelta] = []
        with anyio.fail_after(timeout):
            while sum(out.finish_reason is not None for out in got) < finished:
                message = await self.recv(timeout)
                assert isinstance(message, p.Outputs), message
                got += message.outputs
        return got

    async def disconnected(self, timeout: float) -> bool:
        with anyio.move_on_after(timeout):
            event = parse_monitor_message(await self.monitor.recv_multipart())
            return event["event"] == zmq.EVENT_DISCONNECTED
        return False

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)


@pytest.fixture
async def peers():
    """``peers(address, identity=None)`` opens a Peer; all of them are closed after the test."""
    ctx = zmq.asyncio.Context()
    opened: list[Peer] = []

    def open_peer(address: str, identity: bytes | None = None) -> Peer:
        opened.append(Peer(ctx, address, identity))
        return opened[-1]

    yield open_peer
    for peer in opened:
        peer.close()
    ctx.term()


async def collect(stream) -> list:
    return [chunk async for chunk in stream]


def joined(chunks) -> tuple[str, list[int], str | None]:
    return "".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids], chunks[-1].finish_reason


async def assert_idle(client: AsyncClient, free_blocks: int | None = None) -> None:
    """Nothing runs or waits in the engine, and (when given) every KV block is free again."""
    stats = await client.stats()
    assert (stats.running, stats.waiting) == (0, 0), stats
    assert stats.requests_by_client.get(client.client_id, 0) == 0, stats
    if free_blocks is not None:
        assert stats.free_kv_blocks == free_blocks, stats


# ---- 1. the protocol module on its own ----------------------------------------------------------

ROUND_TRIP = [
    p.Hello(p.PROTOCOL_VERSION, "tok", 42),
    p.Hello(p.PROTOCOL_VERSION),
    p.Add("r1", [1, 2, 3], SamplingParams(temperature=0.5, top_k=3, stop=["\n", "世界"], seed=7, logprobs=2)),
    p.Abort(["a", "b"]),
    p.GetStats(),
    p.Heartbeat(),
    p.Bye(),
    p.Welcome(1, "e", "m", 256, 512, [0], "0a1b", {"tokenizer.json": b"\x00\xff{}"}, None, 1.0, 10.0, 4096),
    p.Outputs(
        [
            p.RequestDelta("r1", [5, 6], [{5: -0.1}, {6: -0.2, 7: -3.0}]),
            p.RequestDelta("r2", [], finish_reason="error", error="bad", code="busy", usage=p.Usage(3, 0, 1)),
        ]
    ),
    p.Stats(1, 2, 3, 4, 5, {"c": 1}),
    p.Error("nope", fatal=True, code="auth"),
    p.Shutdown("engine shutting down"),
]


def test_round_trip_cases_cover_every_message_type():
    assert {type(m) for m in ROUND_TRIP} == set(get_args(p.ClientMessage)) | set(get_args(p.EngineMessage))


@pytest.mark.parametrize("message", ROUND_TRIP, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message):
    decode = p.decode_engine_message if isinstance(message, p.EngineMessage) else p.decode_client_message
    assert decode(p.encode(message)) == message
    if isinstance(message, p.Heartbeat):  # the one message both sides send
        assert p.decode_client_message(p.encode(message)) == message


BAD_FRAMES = {
    "garbage": (p.decode_client_message, b"\xc1\x00 not msgpack at all"),
    "truncated": (p.decode_client_message, p.encode(p.Hello(p.PROTOCOL_VERSION))[:-3]),
    "array, not a map": (p.decode_client_message, msgspec.msgpack.encode([1, 2, 3])),
    "no type field": (p.decode_client_message, msgspec.msgpack.encode({"protocol_version": 1})),
    "unknown type": (p.decode_client_message, msgspec.msgpack.encode({"type": "launch_missiles"})),
    "field of the wrong type": (p.decode_client_message, msgspec.msgpack.encode({"type": "abort", "request_ids": 7})),
    "missing field": (p.decode_client_message, msgspec.msgpack.encode({"type": "add", "request_id": "r"})),
    "client message to a client": (p.decode_engine_message, p.encode(p.Add("r", [1], SamplingParams()))),
    "engine message to an engine": (p.decode_client_message, p.encode(p.Error("x"))),
}


@pytest.mark.parametrize("decode, frame", BAD_FRAMES.values(), ids=BAD_FRAMES.keys())
def test_malformed_frames_raise_protocol_error(decode, frame):
    with pytest.raises(ProtocolError):
        decode(frame)


def test_oversize_frame_is_refused_before_decoding():
    frame = p.encode(p.Abort(["x" * (p.MAX_MESSAGE_BYTES + 1)]))  # valid msgpack, just too big
    with pytest.raises(ProtocolError, match=rf"exceeds the limit of {p.MAX_MESSAGE_BYTES}"):
        p.decode_client_message(frame)
    assert p.decode_client_message(p.encode(p.Abort(["x" * 256]))) == p.Abort(["x" * 256])


@pytest.mark.parametrize(
    "params, what",
    [
        ({"temperature": -1}, "temperature must be >= 0"),
        ({"top_p": 0}, "top_p must be in"),
        ({"max_tokens": 0}, "max_tokens must be a positive integer"),
        ({"stop": [""]}, "stop must be"),
        ({"temperature": "hot"}, "Expected `float"),
    ],
)
def test_invalid_sampling_params_in_add_say_what_is_wrong(params, what):
    frame = msgspec.msgpack.encode({"type": "add", "request_id": "r", "prompt_token_ids": [1], "params": params})
    with pytest.raises(ProtocolError, match=re.escape(what)):
        p.decode_client_message(frame)


# ---- 2. hostile peers next to a legitimate stream ------------------------------------------------


@pytest.mark.anyio
async def test_hostile_peers_get_errors_and_do_not_disturb_a_concurrent_stream(engine, llm, peers):
    long = dict(GREEDY, max_tokens=240)  # still decoding after the frames went out, on a loaded 2-core machine too
    expected = offline(llm, PROMPT, **long)
    bad_add = {"type": "add", "request_id": "r", "prompt_token_ids": [1, 2], "params": {"temperature": -1}}
    hostile = {  # name -> frames, each sent by a peer of its own; only "invalid params" said hello first
        "garbage": [b"\xc1\x00garbage"],
        "multi-frame": [p.encode(p.GetStats()), b"extra"],
        "unknown type": [msgspec.msgpack.encode({"type": "rm -rf"})],
        "before hello": [p.encode(p.GetStats())],
        "nested 1,000 deep": [b"\x91" * 1000 + b"\x00"],
        "nested add": [b"\x82\xa4type\xa3add\xa6params" + b"\x91" * 5000 + b"\x00"],
        "big before hello": [p.encode(p.Add("r", list(range(3000)), SamplingParams()))],
        "bad version": [p.encode(p.Hello(p.PROTOCOL_VERSION + 41))],
        "invalid params": [msgspec.msgpack.encode(bad_add)],
        "oversize": [b"\x00" * (p.MAX_MESSAGE_BYTES + 1)],
    }
    sockets = {name: peers(engine.address) for name in hostile}
    assert isinstance(await sockets["invalid params"].hello(), p.Welcome)
    chunks = []
    async with AsyncClient(engine.address) as client:
        first = anyio.Event()

        async def legitimate() -> None:
            async for chunk in client.stream(PROMPT, **long):
                chunks.append(chunk)
                first.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(legitimate)
            await first.wait()
            for name, frames in hostile.items():  # all at once, while the stream decodes
                await sockets[name].send(*frames)
            assert not chunks[-1].finish_reason, "the stream ended before the hostile frames went out"
            replies = {name: await peer.recv(0.5 if name == "oversize" else 5) for name, peer in sockets.items()}
            replies["oversize"] = replies["oversize"] or await sockets["oversize"].disconnected(timeout=5)
            replies["still registered"] = await sockets["invalid params"].request(p.encode(p.GetStats()))

        def error(name: str, fatal: bool = False) -> str:
            reply = replies[name]
            assert isinstance(reply, p.Error), f"{name}: {reply!r}"
            assert reply.fatal == fatal, f"{name}: {reply!r}"
            return reply.message

        assert "malformed" in error("garbage")
        assert "one frame per message" in error("multi-frame")
        assert "rm -rf" in error("unknown type")
        # Not fatal: a client the engine dropped is told to say hello again.
        assert "say hello first" in error("before hello") and replies["before hello"].code == "unregistered"
        assert "malformed" in error("nested 1,000 deep") or "invalid" in error("nested 1,000 deep")
        assert replies["nested add"] is not None
        assert "refused unread" in error("big before hello")
        version_error = error("bad version", fatal=True)
        assert str(p.PROTOCOL_VERSION + 41) in version_error and f"version {p.PROTOCOL_VERSION}" in version_error
        # An add that cannot be decoded still ends its own request, with a terminal error output.
        refused = replies["invalid params"]
        assert isinstance(refused, p.Outputs), refused
        (out,) = refused.outputs
        assert out.finish_reason == "error" and "temperature must be >= 0" in out.error
        assert isinstance(replies["still registered"], p.Stats)
        oversize = replies["oversize"]  # an Error, or the engine dropped the connection
        assert oversize is True or (isinstance(oversize, p.Error) and "exceeds" in oversize.message), oversize

        assert joined(chunks) == (expected.text, expected.token_ids, "length")
        await assert_idle(client)

    # A new client is served, and gets the offline result.
    async with AsyncClient(engine.address) as client:
        again = await client.generate("The river", temperature=0, max_tokens=16)
        ref = offline(llm, "The river", temperature=0, max_tokens=16)
        assert (again.text, again.token_ids) == (ref.text, ref.token_ids)
    assert engine.proc.poll() is None


@pytest.mark.anyio
async def test_refused_hello_does_not_register_the_connection(engine, peers):
    peer = peers(engine.address)
    refused = await peer.hello(protocol_version=0)
    assert isinstance(refused, p.Error) and refused.fatal
    reply = await peer.request(p.encode(p.Add("r", [1, 2, 3], SamplingParams(max_tokens=4))))
    assert isinstance(reply, p.Error) and "hello" in reply.message


@pytest.mark.anyio
async def test_lookalike_identity_cannot_abort_another_clients_request(engine, llm, peers):
    """The engine keys requests by client: a peer whose identity *prints* like another client's id
    must still not reach that client's requests (and the victim's stream must get its ending)."""
    expected = offline(llm, PROMPT, **GREEDY)
    victim = AsyncClient(engine.address)
    victim.connection.client_id = "ab" * 8  # its routing id is the ASCII text "abab..."
    async with victim:
        stream = victim.stream(PROMPT, **GREEDY)
        first = await stream.__anext__()
        attacker = peers(engine.address, identity=bytes.fromhex(victim.client_id))  # bytes 0xab 0xab ...
        assert isinstance(await attacker.hello(), p.Welcome)
        await attacker.send(p.encode(p.Abort([stream.request_id])))
        assert isinstance(await attacker.request(p.encode(p.GetStats())), p.Stats)  # the abort was handled
        with anyio.move_on_after(10) as scope:
            rest = await collect(stream)
        assert not scope.cancel_called, "the victim's stream never ended: its request vanished without a message"
        assert joined([first, *rest]) == (expected.text, expected.token_ids, "length"), "another peer ended it"


# ---- 3. auth tokens --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tcp_engine(qwen3_dir):
    proc = start_engine(qwen3_dir, address="tcp://127.0.0.1:0", auth_token=TOKEN, **ENGINE_OPTIONS)
    yield proc
    proc.stop()


@pytest.mark.anyio
@pytest.mark.parametrize("token", [None, "", "wrong-token", TOKEN + "x"])
async def test_auth_token_required(tcp_engine, token):
    with pytest.raises(ProtocolError, match="auth token"):
        async with AsyncClient(tcp_engine.address, auth_token=token, timeout=5):
            pass


@pytest.mark.anyio
async def test_auth_token_accepted_and_env_token_used(tcp_engine, llm, monkeypatch):
    ref = offline(llm, PROMPT, temperature=0, max_tokens=8)
    async with AsyncClient(tcp_engine.address, auth_token=TOKEN) as client:
        out = await client.generate(PROMPT, temperature=0, max_tokens=8)
        assert (out.text, out.token_ids, out.finish_reason) == (ref.text, ref.token_ids, "length")
    monkeypatch.setenv("NANOSTREAM_AUTH_TOKEN", TOKEN)
    async with AsyncClient(tcp_engine.address) as client:
        assert (await client.generate(PROMPT, temperature=0, max_tokens=8)).token_ids == ref.token_ids


def test_serving_beyond_loopback_without_token_exits_at_once(qwen3_dir):
    env = {k: v for k, v in os.environ.items() if not k.startswith("NANOSTREAM_")}
    cmd = [shutil.which("nanostream") or sys.executable, "serve", str(qwen3_dir), "--address", "tcp://0.0.0.0:0"]
    if cmd[0] == sys.executable:
        cmd[1:1] = ["-m", "nanostream"]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("`nanostream serve --address tcp://0.0.0.0:0` without a token kept running")
    assert done.returncode != 0
    assert "--auth-token" in done.stderr and "0.0.0.0" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr  # a one-line message saying what to change
    assert "engine ready" not in done.stdout + done.stderr


@pytest.mark.anyio
async def test_serving_beyond_loopback_with_env_token(qwen3_dir):
    proc = start_engine(qwen3_dir, env={"NANOSTREAM_AUTH_TOKEN": TOKEN}, address="tcp://0.0.0.0:0", **ENGINE_OPTIONS)
    try:
        port = re.fullmatch(r"tcp://0\.0\.0\.0:(\d+)", proc.address).group(1)
        loopback = f"tcp://127.0.0.1:{port}"  # bound on every interface; reached only through loopback here
        with pytest.raises(ProtocolError, match="auth token"):
            async with AsyncClient(loopback, auth_token="", timeout=5):
                pass
        async with AsyncClient(loopback, auth_token=TOKEN) as client:
            out = await client.generate([1, 2, 3], temperature=0, max_tokens=4)
            assert len(out.token_ids) == 4 and out.finish_reason == "length"
    finally:
        proc.stop()


# ---- 4. requests the engine refuses ----------------------------------------------------------------


@pytest.mark.anyio
async def test_admission_errors_reach_the_stream_and_nothing_breaks(engine, llm):
    too_long = [5] * (ENGINE_OPTIONS["max_model_len"] + 10)
    cases = {
        "empty": ([], {}),
        "out of vocabulary": ([1, 2, 10**6], {}),
        "longer than max_model_len": (too_long, {}),
        "no room for max_tokens": ([5] * 250, {"max_tokens": 50}),
    }
    async with AsyncClient(engine.address) as client:
        baseline = (await client.stats()).free_kv_blocks
        for name, (prompt, params) in cases.items():
            with pytest.raises(InvalidRequestError) as offline_error:
                offline(llm, prompt, **params)
            with pytest.raises(InvalidRequestError) as streamed:
                await collect(client.stream(prompt, **params))
            assert str(streamed.value) == str(offline_error.value), name  # the engine's own message
        # The same client keeps streaming, exactly as offline, and the engine holds nothing.
        out = await client.generate(PROMPT, **GREEDY)
        ref = offline(llm, PROMPT, **GREEDY)
        assert (out.text, out.token_ids, out.finish_reason) == (ref.text, ref.token_ids, "length")
        await assert_idle(client, baseline)


@pytest.mark.anyio
async def test_duplicate_request_id_gets_an_error_and_the_first_request_runs_on(engine, llm, peers):
    # Long enough to be still running when the second Add arrives, however busy the CPU: a finished
    # request's id is free again (the end of this test checks that).
    n = 200
    ref = offline(llm, [1, 2, 3], temperature=0, max_tokens=n, ignore_eos=True)
    peer = peers(engine.address)
    assert isinstance(await peer.hello(), p.Welcome)
    add = p.encode(p.Add("dup", [1, 2, 3], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)))
    await peer.send(add)
    await peer.send(add)
    outs = await peer.outputs(finished=2)
    errors = [o for o in outs if o.finish_reason == "error"]
    assert len(errors) == 1 and "already in use" in errors[0].error
    first = [o for o in outs if o.finish_reason != "error"]
    assert [t for o in first for t in o.token_ids] == ref.token_ids
    assert first[-1].finish_reason == "length" and first[-1].usage.completion_tokens == n
    # Once finished, the id is free again.
    await peer.send(p.encode(p.Add("dup", [1, 2, 3], SamplingParams(temperature=0, max_tokens=2))))
    again = await peer.outputs()
    assert [t for o in again for t in o.token_ids] == ref.token_ids[:2] and again[-1].finish_reason == "length"


# ---- 5. UTF-8 through the streaming client ----------------------------------------------------------


def make_scripted_model(path: Path, text: str) -> list[int]:
    """Turn a tiny model into one whose greedy output repeats ``text`` forever; return its token ids.

    The blocks' output projections are zeroed, so the last hidden state is RMSNorm(embedding of the
    last token); each token of ``text`` gets its own one-hot embedding, and an untied LM head maps
    it to the next token of ``text`` with a logit of ~800 against 0 for every other token.
    """
    tokenizer = build_tokenizer()
    ids = tokenizer(text).input_ids
    assert len(set(ids)) == len(ids), "the script needs distinct tokens: each one decides the next"
    make_tiny_model(path, tie_word_embeddings=False, seed=3)
    weights = load_file(path / "model.safetensors")
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    weights["model.norm.weight"].fill_(1.0)
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    assert len(ids) <= embed.shape[1]
    head.zero_()
    for i, token in enumerate(ids):
        embed[token] = 0.0
        embed[token, i] = 1.0
        head[ids[(i + 1) % len(ids)], i] = 100.0
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return ids


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    path = tmp_path_factory.mktemp("scripted")
    ids = make_scripted_model(path, SCRIPT)
    proc = start_engine(path, **ENGINE_OPTIONS)
    yield proc, ids
    proc.stop()


@pytest.mark.anyio
async def test_emoji_and_cjk_stream_whole_characters(scripted):
    engine, ids = scripted
    tokenizer = build_tokenizer()
    assert sum("\ufffd" in tokenizer.decode([t]) for t in ids) >= 8  # é, 世, 界, 🚀 span 2-4 tokens each
    n = 5 * len(ids)
    async with AsyncClient(engine.address) as client:
        fast, slow = [], []

        async def read_slowly() -> None:
            async with client.stream(ids, temperature=0, max_tokens=n) as stream:
                async for chunk in stream:
                    slow.append(chunk)
                    await anyio.sleep(0.05)  # the mailbox merges what arrives meanwhile

        async with anyio.create_task_group() as tg:
            tg.start_soon(read_slowly)
            fast = await collect(client.stream(ids, temperature=0, max_tokens=n))
    for chunks in (fast, slow):
        assert joined(chunks) == (SCRIPT * 5, ids * 5, "length")
        assert not any("\ufffd" in c.text for c in chunks)
        # At every chunk boundary that falls inside a character, the text so far stops before it.
        text, seen = "", []
        for c in chunks:
            text, seen = text + c.text, seen + c.token_ids
            decoded = tokenizer.decode(seen)
            if decoded.endswith("\ufffd"):  # this chunk ended inside a character: it was held back
                assert text == decoded.rstrip("\ufffd")
            else:
                assert text == decoded
    assert any(len(c.token_ids) > 1 for c in slow)


@pytest.mark.anyio
async def test_multibyte_stop_string_streamed(scripted):
    engine, ids = scripted
    async with AsyncClient(engine.address) as client:
        baseline = (await client.stats()).free_kv_blocks
        chunks = await collect(client.stream(ids, temperature=0, max_tokens=100, stop=["界🚀 m"]))
        text, _, finish = joined(chunks)
        assert (text, finish) == ("é世", "stop")
        await assert_idle(client, baseline)


@pytest.mark.anyio
async def test_random_model_partial_bytes_stream_as_offline(engine, llm):
    """The random model emits lone UTF-8 bytes: the stream's text must equal decoding all of its ids."""
    params = dict(temperature=0.0, max_tokens=200, ignore_eos=True)
    ref = offline(llm, PROMPT, **params)
    tokenizer = llm.tokenizer

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    # A client that decoded token by token would get a different text: this prompt tests something.
    assert "".join(decode([t]) for t in ref.token_ids) != decode(ref.token_ids)
    async with AsyncClient(engine.address) as client:
        chunks = await collect(client.stream(PROMPT, **params))
    text, token_ids, finish = joined(chunks)
    assert (token_ids, finish) == (ref.token_ids, "length")
    assert text == decode(token_ids) == ref.text
    emitted = ""
    for chunk in chunks:  # no chunk emits a character that a later token would have changed
        emitted += chunk.text
        assert text.startswith(emitted)


# ---- 6. stop strings through the client ---------------------------------------------------------------


def stop_string_across_tokens(tokenizer, ids: list[int], text: str) -> tuple[str, int]:
    """A stop string from the middle of ``text`` that starts inside one token and ends in another."""
    for k in range(len(ids) // 3, len(ids) - 3):
        before, window = tokenizer.decode(ids[:k]), tokenizer.decode(ids[k : k + 3])
        pieces = [tokenizer.decode([t]) for t in ids[k : k + 3]]
        if (
            text.startswith(before + window)
            and "\ufffd" not in window
            and len(pieces[0]) >= 2
            and all(pieces)
            and text.index(window[1:]) == len(before) + 1
        ):
            return window[1:], len(before) + 1
    raise AssertionError("no clean stop string in the output")


@pytest.mark.anyio
async def test_stop_string_cuts_the_text_and_frees_the_request(engine, llm):
    ref = offline(llm, PROMPT, **GREEDY)
    stop, cut = stop_string_across_tokens(llm.tokenizer, ref.token_ids, ref.text)
    assert not any(stop in llm.tokenizer.decode([t]) for t in ref.token_ids)  # it spans tokens
    ref_stop = offline(llm, PROMPT, **GREEDY, stop=[stop])
    assert ref_stop.text == ref.text[:cut] and ref_stop.finish_reason == "stop"
    async with AsyncClient(engine.address) as client:
        baseline = (await client.stats()).free_kv_blocks
        chunks = await collect(client.stream(PROMPT, **GREEDY, stop=[stop]))
        await assert_idle(client, baseline)
    text, token_ids, finish = joined(chunks)
    assert (text, finish) == (ref.text[:cut], "stop")
    # Up to the token that completed the stop string (exactly so: see the slow-reader test below).
    assert token_ids[: len(ref_stop.token_ids)] == ref_stop.token_ids
    emitted = ""
    for chunk in chunks:
        emitted += chunk.text
        assert ref.text[:cut].startswith(emitted), "part of the stop string leaked"


@pytest.mark.anyio
async def test_stop_string_same_result_for_a_slow_reader(engine, llm):
    """A reader that looks only after the engine has finished gets the same text, ids and reason."""
    ref = offline(llm, PROMPT, **GREEDY)
    stop, cut = stop_string_across_tokens(llm.tokenizer, ref.token_ids, ref.text)
    ref_stop = offline(llm, PROMPT, **GREEDY, stop=[stop])
    async with AsyncClient(engine.address) as client:
        async with client.stream(PROMPT, **GREEDY, stop=[stop]) as stream:
            with anyio.fail_after(20):
                while (stats := await client.stats()).running or stats.waiting:  # it runs to max_tokens
                    await anyio.sleep(0.05)
            chunks = await collect(stream)
        await assert_idle(client)
    assert joined(chunks) == (ref.text[:cut], ref_stop.token_ids, "stop")


@pytest.mark.anyio
async def test_absent_stop_string_flushes_the_held_back_text(engine, llm):
    stop = "this stop string is nowhere in the output"
    ref = offline(llm, PROMPT, **GREEDY)
    assert stop not in ref.text and len(ref.text) > len(stop)
    async with AsyncClient(engine.address) as client:
        chunks = await collect(client.stream(PROMPT, **GREEDY, stop=[stop]))
    assert joined(chunks) == (ref.text, ref.token_ids, "length")
    before_last = "".join(c.text for c in chunks[:-1])
    assert len(before_last) <= len(ref.text) - (len(stop) - 1)  # held back until the end, then flushed


# ---- 7. starting engines ------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_tcp_port_zero_binds_a_real_port_and_prints_it(tcp_engine, peers):
    port = int(re.fullmatch(r"tcp://127\.0\.0\.1:(\d+)", tcp_engine.address).group(1))
    assert port > 0
    assert f"nanostream engine ready at {tcp_engine.address}" in tcp_engine.output().splitlines()
    peer = peers(f"tcp://127.0.0.1:{port}")
    welcome = await peer.hello(auth_token=TOKEN)
    assert isinstance(welcome, p.Welcome) and welcome.max_model_len == ENGINE_OPTIONS["max_model_len"]


@pytest.mark.anyio
async def test_two_engines_on_default_addresses(qwen3_dir, llm):
    started: list[EngineProcess] = []

    def start() -> None:
        started.append(start_engine(qwen3_dir, **ENGINE_OPTIONS))

    threads = [threading.Thread(target=start) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert len(started) == 2
        a, b = (e.address for e in started)
        assert a.startswith("ipc://") and b.startswith("ipc://") and a != b
        for e in started:
            assert f"nanostream engine ready at {e.address}" in e.output().splitlines()
        ref = offline(llm, PROMPT, temperature=0, max_tokens=8)
        for address in (a, b):
            async with AsyncClient(address) as client:
                assert (await client.generate(PROMPT, temperature=0, max_tokens=8)).token_ids == ref.token_ids
    finally:
        codes = [e.stop() for e in started]
    assert codes == [0, 0]
    assert not any(Path(address[len("ipc://") :]).exists() for address in (a, b))  # sockets cleaned up
