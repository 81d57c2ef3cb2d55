"""The wire protocol between clients and an engine process: typed msgpack messages over ZeroMQ.

    client (DEALER)                               engine (ROUTER)
    Hello(version, auth_token)          ──▶
                                        ◀──       Welcome(model, max_model_len, tokenizer files, ...)
                                                  (or a fatal Error: wrong version or token)
    Add(request_id, prompt ids, params) ──▶
                                        ◀──       Outputs([RequestDelta, ...])   one per engine step
    Abort([request_id, ...])            ──▶                                      (per client)
    GetStats()                          ──▶
                                        ◀──       Stats(running, waiting, free blocks, ...)
    Heartbeat()                         ◀─▶       Heartbeat()          both ways, every interval
                                        ◀──       Error(message, code) malformed, too large, unregistered, dropped
                                        ◀──       Shutdown(reason)     the engine is stopping
    Bye()                               ──▶

Each message is one ZeroMQ frame: a msgpack map whose "type" field names the struct. Decoding is
into these structs only (never pickle); anything else is a ``ProtocolError``. Every request gets
exactly one ``RequestDelta`` with a ``finish_reason``: "stop", "length", "abort" or "error"; an
"error" carries a ``code`` ("invalid", "busy", "timeout", "internal") that the client turns into
its exception (``errors.REQUEST_ERRORS``). An ``Error`` with code "unregistered" or "dropped" tells
a client that the engine does not know it (any more): it ends its open streams and says hello again.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from nanostream.errors import ProtocolError
from nanostream.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from nanostream.structured_outputs import MAX_GRAMMAR_CHARS

PROTOCOL_VERSION = 6  # 3: structured outputs, logit bias, n, prompt logprobs; 4: reasoning; 5: embeddings; 6: images
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a hello reply carries the tokenizer files (Qwen's: ~11 MB)
MAX_HELLO_BYTES = 8192  # what a peer that has not said hello may send: a hello, no more
MAX_REQUEST_ID_CHARS = 256
MAX_ABORT_IDS = 4096

RequestId = Annotated[str, msgspec.Meta(max_length=MAX_REQUEST_ID_CHARS)]


MAX_IMAGE_BYTES = 256 * 1024 * 1024
"""The most a request's images' pixel rows may take on the wire (float32: about 50 images of 448x448)."""


def max_request_bytes(max_model_len: int, image_bytes_per_token: int = 0) -> int:
    """The largest frame a client may send an engine of this context length: an Add of a full-length
    prompt (msgpack spends at most 9 bytes on an id) with every stop string, logit bias and grammar at
    its longest, and room. ``image_bytes_per_token``: a model that takes images, the pixel rows behind one
    placeholder token (a full-length prompt of image tokens, up to ``MAX_IMAGE_BYTES``)."""
    images = min(MAX_IMAGE_BYTES, image_bytes_per_token * max_model_len)
    return 9 * max_model_len + 4 * 64 * 1024 + 4 * MAX_GRAMMAR_CHARS + 32 * MAX_LOGIT_BIAS + 64 * 1024 + images


class _Message(msgspec.Struct, tag_field="type", forbid_unknown_fields=False, omit_defaults=True):
    pass


# ---- client -> engine ----------------------------------------------------------------------------


class Hello(_Message, tag="hello"):
    protocol_version: int
    auth_token: Annotated[str, msgspec.Meta(max_length=1024)] | None = None
    pid: int = 0
    tokenizer_digest: str | None = None  # the client has these tokenizer files already: leave them out


class ImageInput(msgspec.Struct, frozen=True, array_like=True):
    """One image of a prompt as the model's image processor prepared it (on the client's side): its placeholder
    tokens start at index ``offset`` of the prompt; ``grid``: its (t, h, w) patches; ``pixels``: the processor's
    ``pixel_values`` rows of it, float32 little-endian, [t*h*w, the encoder's values per patch]."""

    offset: int
    grid: tuple[int, int, int]
    pixels: bytes


class Add(_Message, tag="add"):
    request_id: RequestId
    prompt_token_ids: list[int]
    params: SamplingParams
    timeout: Annotated[float, msgspec.Meta(gt=0, le=10**9)] | None = None  # seconds; then the engine aborts it
    images: list[ImageInput] = []  # in prompt order (a model that takes images)


class Abort(_Message, tag="abort"):
    request_ids: Annotated[list[RequestId], msgspec.Meta(max_length=MAX_ABORT_IDS)]


class GetStats(_Message, tag="get_stats"):
    pass


class Heartbeat(_Message, tag="heartbeat"):
    pass


class Bye(_Message, tag="bye"):
    pass


# ---- engine -> client ----------------------------------------------------------------------------


class PoolingConfig(msgspec.Struct, frozen=True):
    """An embedding engine's pooling (models/pooling.py reads it from the checkpoint), as its Welcome says."""

    mode: str = "last"  # the last prompt token's final (normed) hidden state
    normalize: bool = True  # to unit length (clients do it: the engine sends the pooled state)
    matryoshka: list[int] | bool | None = None  # dimensions a vector may be cut to (True: any), None: none


class Welcome(_Message, tag="welcome"):
    protocol_version: int
    engine_id: str
    model: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    tokenizer_digest: str  # names the tokenizer files (a hash of them)
    tokenizer_files: dict[str, bytes]  # empty when the hello named the same digest
    chat_template: str | None
    heartbeat_interval: float  # seconds between heartbeats, each way
    client_timeout: float  # a client silent this long has its requests aborted
    max_request_bytes: int  # the largest frame this engine accepts from a client
    pooling: PoolingConfig | None = None  # an embedding engine's (SamplingParams.embed), else None


class Usage(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class RequestDelta(msgspec.Struct, omit_defaults=True):
    """New tokens of one request since its last delta; ``finish_reason`` set on its last one.

    The one type for a request's progress: ``LLMEngine.step()`` returns them, the engine process
    sends them (merged, with ``stream_interval``), and the client's output processor reads them.
    ``usage`` comes on a request's first delta (prompt and cached tokens) and on its last.
    """

    request_id: str
    token_ids: list[int] = []
    logprobs: list[dict[int, float]] = []
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # why, for "error" (and for an abort the engine decided)
    code: str | None = None  # for "error": "invalid" | "busy" | "timeout" | "internal"; "shutdown" for an abort
    usage: Usage | None = None
    # Per prompt token (the first has none), when the request asked: on the request's first delta.
    prompt_logprobs: list[dict[int, float] | None] = []
    embedding: bytes = b""  # SamplingParams.embed: the prompt's pooled hidden state, float32 (on the first delta)

    def merge(self, later: RequestDelta) -> None:
        """Take ``later`` (of the same request) into this one: what a reader that falls behind sees."""
        self.token_ids += later.token_ids
        self.logprobs += later.logprobs
        self.prompt_logprobs += later.prompt_logprobs
        self.usage = later.usage or self.usage
        self.embedding = self.embedding or later.embedding
        if later.finish_reason is not None:
            self.finish_reason, self.error, self.code = later.finish_reason, later.error, later.code


class Outputs(_Message, tag="outputs"):
    outputs: list[RequestDelta]
    # The engine's time.monotonic() when the step that produced these ended (None: no step, e.g. a
    # refusal): on one host, a client's own clock minus this is the delivery latency.
    produced: float | None = None


STEP_MS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
"""Upper bounds (ms) of ``EngineStats.step_ms_buckets``; a last bucket counts the steps above them all."""


def step_ms_quantile(buckets: list[int], q: float) -> float:
    """The upper bound (ms) of the ``STEP_MS_BUCKETS`` bucket that holds quantile ``q`` of ``buckets``
    (``EngineStats.step_ms_buckets``, or the difference of two readings); inf past the last bound,
    nan with no steps."""
    total, seen = sum(buckets), 0
    for bound, count in zip((*STEP_MS_BUCKETS, float("inf")), buckets):
        seen += count
        if total and seen >= q * total:
            return float(bound)
    return float("nan")


class EngineStats(msgspec.Struct):
    """An engine's counters since it started: the figures of a window are the differences of two readings."""

    steps: dict[str, int]  # by kind: "prefill" (prompt chunks only), "decode" (decodes only), "mixed"
    step_seconds: float  # wall time spent in LLMEngine.step, summed
    step_ms_buckets: list[int]  # steps by wall time, one count per STEP_MS_BUCKETS bound and one beyond
    scheduled_requests: int  # requests in each step, summed (/ steps: the mean batch)
    prompt_tokens: int  # prompt tokens computed (a preempted request's again)
    generation_tokens: int  # tokens sampled
    preemptions: int
    prefix_cache_queries: int  # prompt tokens of the requests admitted so far
    prefix_cache_hits: int  # of them, found in the prefix cache
    finished: dict[str, int]  # requests by finish reason
    # Of step_seconds, the host's wait for the device's results. Near 0: the host is the bottleneck
    # (the device waits for it); the rest of a step is the host's own work (scheduling, launching).
    device_wait_seconds: float = 0.0
    # The engine's part of the time to first token, summed over the requests that got their first token:
    # arrival → first scheduled (queue_seconds; a grammar's compile included), first scheduled → that
    # token read back (prefill_seconds: the prompt's steps, and the steps of others it shared).
    first_tokens: int = 0
    queue_seconds: float = 0.0
    prefill_seconds: float = 0.0


class Stats(_Message, tag="stats"):
    running: int
    waiting: int
    free_kv_blocks: int
    total_kv_blocks: int
    clients: int
    requests_by_client: dict[str, int]  # open requests of each connected client (by client id)
    waiting_tokens: int = 0  # prompt tokens of the waiting requests
    dropped_clients: int = 0  # clients dropped so far: silent too long, or disconnected with requests open
    engine: EngineStats | None = None


class Error(_Message, tag="error"):
    message: str
    fatal: bool = False  # the engine will not serve this connection further (e.g. bad version or token)
    code: str | None = None  # "malformed" | "too_large" | "unregistered" | "dropped" | "version" | "auth"


class Shutdown(_Message, tag="shutdown"):
    """The engine is going away; sent after the terminal outputs of the client's open requests."""

    reason: str


ClientMessage = Hello | Add | Abort | GetStats | Heartbeat | Bye
EngineMessage = Welcome | Outputs | Stats | Heartbeat | Error | Shutdown

_encoder = msgspec.msgpack.Encoder()
_client_decoder = msgspec.msgpack.Decoder(ClientMessage)
_hello_decoder = msgspec.msgpack.Decoder(Hello)
_engine_decoder = msgspec.msgpack.Decoder(EngineMessage)


class _AddHead(msgspec.Struct, forbid_unknown_fields=False):
    """An Add's request id, read from a frame that failed to decode as a whole."""

    type: str
    request_id: RequestId


_add_head_decoder = msgspec.msgpack.Decoder(_AddHead)


def encode(message: _Message) -> bytes:
    return _encoder.encode(message)


def _decode(decoder: msgspec.msgpack.Decoder, frame: bytes | memoryview, limit: int = MAX_MESSAGE_BYTES):
    if len(frame) > limit:
        raise ProtocolError(f"message of {len(frame)} bytes exceeds the limit of {limit}")
    try:
        return decoder.decode(frame)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"invalid message: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed message (not a nanostream msgpack frame): {exc}") from None
    except Exception as exc:  # RecursionError (nested too deep), MemoryError, ...: any frame is refused, never fatal
        raise ProtocolError(f"malformed message ({type(exc).__name__}: {exc})") from None


def decode_client_message(frame: bytes | memoryview, limit: int = MAX_MESSAGE_BYTES) -> ClientMessage:
    return _decode(_client_decoder, frame, limit)


def decode_hello(frame: bytes | memoryview) -> Hello:
    """What a peer that has not said hello sends: a small Hello, or it is refused."""
    return _decode(_hello_decoder, frame, MAX_HELLO_BYTES)


def decode_engine_message(frame: bytes | memoryview) -> EngineMessage:
    return _decode(_engine_decoder, frame)


def refusal(frame: bytes | memoryview, error: ProtocolError) -> Error | Outputs:
    """The reply to a frame that failed to decode: the request's terminal error output when the frame
    is an ``add`` whose request_id can still be read (so the client's stream ends), else an Error."""
    try:
        head = _add_head_decoder.decode(frame)
    except Exception:  # any failure at all: the plain Error below
        head = None
    if head is not None and head.type == "add":
        return Outputs([RequestDelta(head.request_id, finish_reason="error", error=str(error), code="invalid")])
    return Error(str(error), code="malformed")
