"""One request's output stream: the async iterator that drains the request's mailbox (which the
connection's reader fills) through its ``OutputProcessor``."""

from __future__ import annotations

import contextlib
import uuid

from nanostream.client.connection import Connection, _Mailbox
from nanostream.client.output_processor import OutputProcessor
from nanostream.outputs import Completion, StreamChunk
from nanostream.sampling_params import SamplingParams

__all__ = ["Completion", "Stream", "StreamChunk"]


class Stream:
    """One request's output as an async iterator of ``StreamChunk``; also an async context manager.

    The request is sent on the first ``__anext__`` (or on entering ``async with``). Leaving early
    (break, cancellation, ``aclose()``) aborts it in the engine.
    """

    def __init__(
        self, client: Connection, prompt_token_ids: list[int], params: SamplingParams, timeout: float | None = None
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
        # When the engine produced the newest token of the last chunk: its time.monotonic(), which on the
        # engine's host is this process's too (time.monotonic() - stream.produced: the delivery latency).
        self.produced: float | None = None
        self._processor = OutputProcessor(client.tokenizer, prompt_token_ids, params)

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
                self._mailbox = _Mailbox(self._processor)
                await self.client._submit(
                    self._mailbox, self.request_id, self.prompt_token_ids, self.params, self.timeout
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
                await self._mailbox.wait()
                chunk = self._processor.take()
                self.produced = self._mailbox.produced
                if self._processor.abort:  # a stop string: tell the engine to stop now
                    self._processor.abort = False
                    self.client._abort(self.request_id)
                if chunk is None:
                    continue
                if chunk.finish_reason is not None:
                    self._done = True
                    self.client._forget(self.request_id)
                return chunk
        except BaseException:
            self._close_now()
            raise

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
