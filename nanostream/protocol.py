"""The wire protocol between clients and an engine process: typed msgpack messages over ZeroMQ.

    client (DEALER)                               engine (ROUTER)
    Hello(version, auth_token)          ──▶
                                        ◀──       Welcome(model, max_model_len, tokenizer files, ...)
    Add(request_id, prompt ids, params) ──▶
                                        ◀──       Outputs([RequestOutput, ...])  one per engine step
    Abort([request_id, ...])            ──▶                                      (per client)
    GetStats()                          ──▶
                                        ◀──       Stats(running, waiting, free blocks, ...)
    Heartbeat()                         ◀─▶       Heartbeat()          both ways, every interval
                                        ◀──       Error(message)       malformed, unknown, unauthorised
                                        ◀──       Shutdown(reason)     the engine is stopping
    Bye()                               ──▶

Each message is one ZeroMQ frame: a msgpack map whose "type" field names the struct. Decoding is
into these structs only (never pickle); anything else is a ``ProtocolError``. Every request gets
exactly one ``RequestOutput`` with a ``finish_reason``: "stop", "length", "abort" or "error".
"""

from __future__ import annotations

import msgspec

from nanostream.errors import ProtocolError
from nanostream.sampling_params import SamplingParams

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a hello reply carries the tokenizer files (Qwen's: ~11 MB)


class _Message(msgspec.Struct, tag_field="type", forbid_unknown_fields=False, omit_defaults=True):
    pass


# ---- client -> engine ----------------------------------------------------------------------------


class Hello(_Message, tag="hello"):
    protocol_version: int
    auth_token: str | None = None
    pid: int = 0


class Add(_Message, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class Abort(_Message, tag="abort"):
    request_ids: list[str]


class GetStats(_Message, tag="get_stats"):
    pass


class Heartbeat(_Message, tag="heartbeat"):
    pass


class Bye(_Message, tag="bye"):
    pass


# ---- engine -> client ----------------------------------------------------------------------------


class Welcome(_Message, tag="welcome"):
    protocol_version: int
    engine_id: str
    model: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    tokenizer_files: dict[str, bytes]
    chat_template: str | None
    heartbeat_interval: float  # seconds between heartbeats, each way
    client_timeout: float  # a client silent this long has its requests aborted


class Usage(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class RequestOutput(msgspec.Struct, omit_defaults=True):
    """New tokens of one request since the last message; ``finish_reason`` set on the last one."""

    request_id: str
    token_ids: list[int] = []
    logprobs: list[dict[int, float]] = []
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # why, for "error" (and for an abort the engine decided)
    usage: Usage | None = None  # on the last message


class Outputs(_Message, tag="outputs"):
    outputs: list[RequestOutput]


class Stats(_Message, tag="stats"):
    running: int
    waiting: int
    free_kv_blocks: int
    total_kv_blocks: int
    clients: int
    requests_by_client: dict[str, int]  # open requests of each connected client (by client id)


class Error(_Message, tag="error"):
    message: str
    fatal: bool = False  # the engine will not serve this connection further (e.g. bad version or token)


class Shutdown(_Message, tag="shutdown"):
    """The engine is going away; sent after the terminal outputs of the client's open requests."""

    reason: str


ClientMessage = Hello | Add | Abort | GetStats | Heartbeat | Bye
EngineMessage = Welcome | Outputs | Stats | Heartbeat | Error | Shutdown

_encoder = msgspec.msgpack.Encoder()
_client_decoder = msgspec.msgpack.Decoder(ClientMessage)
_engine_decoder = msgspec.msgpack.Decoder(EngineMessage)


def encode(message: _Message) -> bytes:
    return _encoder.encode(message)


def _decode(decoder: msgspec.msgpack.Decoder, frame: bytes | memoryview):
    if len(frame) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(frame)} bytes exceeds the limit of {MAX_MESSAGE_BYTES}")
    try:
        return decoder.decode(frame)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"invalid message: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed message (not a nanostream msgpack frame): {exc}") from None


def decode_client_message(frame: bytes | memoryview) -> ClientMessage:
    return _decode(_client_decoder, frame)


def decode_engine_message(frame: bytes | memoryview) -> EngineMessage:
    return _decode(_engine_decoder, frame)


def refusal(frame: bytes, error: ProtocolError) -> Error | Outputs:
    """The reply to a frame that failed to decode: the request's terminal error output when the frame
    is an ``add`` whose request_id can still be read (so the client's stream ends), else an Error."""
    if len(frame) <= MAX_MESSAGE_BYTES:
        try:
            raw = msgspec.msgpack.decode(frame)  # plain maps and lists: nothing is executed
        except msgspec.DecodeError:
            raw = None
        if isinstance(raw, dict) and raw.get("type") == "add" and isinstance(raw.get("request_id"), str):
            return Outputs([RequestOutput(raw["request_id"], finish_reason="error", error=str(error))])
    return Error(str(error))
