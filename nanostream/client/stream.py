"""One request's output stream: the mailbox the client's reader fills and the async iterator that
drains it, decoding text incrementally."""

from __future__ import annotations

import contextlib
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio

from nanostream import protocol as p
from nanostream.client.detokenizer import IncrementalDetokenizer
from nanostream.errors import REQUEST_ERRORS, EngineDeadError, InvalidRequestError
from nanostream.protocol import Usage
from nanostream.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanostream.client.async_client import AsyncClient


@dataclass
class StreamChunk:
    """New output of one stream: ``text`` and ``token_ids`` since the previous chunk."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last chunk, else None
    usage: Usage | None = None  # on the last chunk
    logprobs: list[dict[int, float]] | None = None  # one dict per new token, when asked for


@dataclass
class Completion:
    """A whole output, as ``AsyncClient.generate`` returns it."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: Usage | None
    logprobs: list[dict[int, float]] | None = None


class _Mailbox:
    """What the engine sent for one request and the consumer has not taken yet, merged."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.code: str | None = None
        self.usage: Usage | None = None
        self.failure: BaseException | None = None
        self._event = anyio.Event()

    def put(self, out: p.RequestOutput) -> None:
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs
        self.usage = out.usage or self.usage
        if out.finish_reason is not None:
            self.finish_reason, self.error, self.code = out.finish_reason, out.error, out.code
        self._event.set()

    def fail(self, exc: BaseException) -> None:
        if self.finish_reason is None:  # a request that has its terminal output lost nothing
            self.failure = exc
            self._event.set()

    async def take(self) -> tuple[list[int], list[dict[int, float]], str | None]:
        await self._event.wait()
        self._event = anyio.Event()
        if self.failure is not None:
            raise self.failure
        ids, lps, self.token_ids, self.logprobs = self.token_ids, self.logprobs, [], []
        return ids, lps, self.finish_reason


class Stream:
    """One request's output as an async iterator of ``StreamChunk``; also an async context manager.

    The request is sent on the first ``__anext__`` (or on entering ``async with``). Leaving early
    (break, cancellation, ``aclose()``) aborts it in the engine.
    """

    def __init__(
        self, client: AsyncClient, prompt_token_ids: list[int], params: SamplingParams, timeout: float | None = None
    ) -> None:
        if timeout is not None and (not isinstance(timeout, (int, float)) or not 0 < timeout <= 10**9):
            raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
        self.client = client
        self.request_id = uuid.uuid4().hex
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.timeout = timeout
        self._mailbox: _Mailbox | None = None
        self._done = False
        self._usage: Usage | None = None
        self._generated = 0
        self._detok = IncrementalDetokenizer(
            client.tokenizer,
            prompt_token_ids,
            stop=params.stop,
            skip_special_tokens=params.skip_special_tokens,
            min_tokens=params.min_tokens,
        )

    async def __aenter__(self) -> Stream:
        await self._start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __aiter__(self) -> _StreamIterator:
        # A fresh iterator that only the `async for` holds: `break` drops it, which aborts the request
        # even while the caller still holds the Stream.
        return _StreamIterator(self)

    async def _start(self) -> None:
        if self._mailbox is None:
            try:
                self._mailbox = await self.client._submit(
                    self.request_id, self.prompt_token_ids, self.params, self.timeout
                )
            except BaseException:
                self._done = True
                raise

    async def __anext__(self) -> StreamChunk:
        if self._done:
            raise StopAsyncIteration
        await self._start()
        try:
            while True:
                token_ids, logprobs, finish = await self._mailbox.take()
                self._usage = self._mailbox.usage or self._usage
                if finish == "error" or (finish == "abort" and self._mailbox.error):
                    # The request ended in the engine for a reason of the engine's: raise it as its type.
                    default = InvalidRequestError if finish == "error" else EngineDeadError
                    error = REQUEST_ERRORS.get(self._mailbox.code or "", default)
                    raise error(self._mailbox.error or "the engine rejected the request")
                seen = self._detok.num_output_tokens
                text = self._detok.add(token_ids)
                if self._detok.stopped_by is not None:
                    # A stop string: the output ends with the token that completed it, whatever else
                    # the engine had sent meanwhile; tell the engine to stop now if it has not.
                    used = self._detok.num_output_tokens - seen
                    token_ids, logprobs = token_ids[:used], logprobs[:used]
                    if finish is None:
                        self.client._abort(self.request_id)
                    finish = "stop"
                self._generated += len(token_ids)
                if finish is not None:
                    self._done = True
                    self.client._forget(self.request_id)
                    usage = self._usage or Usage(len(self.prompt_token_ids), 0)
                    usage = Usage(usage.prompt_tokens, self._generated, usage.cached_tokens)
                    return StreamChunk(text + self._detok.finish(), token_ids, finish, usage, self._lp(logprobs))
                if token_ids:
                    return StreamChunk(text, token_ids, None, None, self._lp(logprobs))
        except BaseException:
            self._close_now()
            raise

    def _lp(self, logprobs: list[dict[int, float]]) -> list[dict[int, float]] | None:
        return logprobs if self.params.logprobs is not None else None

    def _close_now(self) -> None:
        if not self._done:
            self._done = True
            if self._mailbox is not None:
                self.client._abort(self.request_id)

    async def aclose(self) -> None:
        """Stop the stream; the engine aborts the request (nothing happens if it already finished)."""
        self._close_now()

    def __del__(self) -> None:
        # `async for ... : break` drops the last reference: abort at once rather than decode on.
        with contextlib.suppress(Exception):
            self._close_now()


class _StreamIterator:
    def __init__(self, stream: Stream) -> None:
        self.stream = stream

    def __aiter__(self) -> _StreamIterator:
        return self

    async def __anext__(self) -> StreamChunk:
        return await self.stream.__anext__()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.stream._close_now()
