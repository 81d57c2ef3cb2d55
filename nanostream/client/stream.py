"""One request's output stream: the async iterator that drains the request's mailbox (which the
connection's reader fills) through its sample group's output processors.

With ``n`` > 1 (or several prompts) one stream carries several engine requests, one per sample
(client/samples.py): their chunks interleave, each with its ``index``. A prompt's first sample is
sent at once and its other samples after its first chunk.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Coroutine, Sequence
from typing import Any

from nanostream.client.connection import Connection
from nanostream.client.mailbox import Mailbox
from nanostream.client.samples import Sample, SampleGroup
from nanostream.outputs import Completion, StreamChunk
from nanostream.protocol import ImageInput
from nanostream.sampling_params import SamplingParams

__all__ = ["Completion", "Stream", "StreamChunk"]


class Stream:
    """One request's output as an async iterator of ``StreamChunk``; also an async context manager.

    The request is sent on the first ``__anext__`` (or on entering ``async with``). Leaving early
    (break, cancellation, ``aclose()``) aborts it in the engine. ``extra_prompts`` are completed with
    the same parameters in the same stream: sample j of prompt p has index ``p * n + j``. ``collect``
    keeps every chunk, for ``completion()``. ``images``: the first prompt's, as ``prompt_images`` made them.
    """

    def __init__(
        self,
        connection: Connection,
        prompt_token_ids: list[int],
        params: SamplingParams,
        timeout: float | None = None,
        *,
        reasoning_parser: str | None = None,
        extra_prompts: Sequence[list[int]] = (),
        collect: bool = False,
        images: Sequence[ImageInput] = (),
    ) -> None:
        if timeout is not None and (not isinstance(timeout, (int, float)) or not 0 < timeout <= 10**9):
            raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
        self.connection = connection
        self.request_id = uuid.uuid4().hex
        self.prompt_token_ids = prompt_token_ids
        self.prompts = [prompt_token_ids, *extra_prompts]
        self.params = params
        self.timeout = timeout
        self.images = list(images)  # the first prompt's (multimodal/request.py), sent with each of its samples
        self.group = SampleGroup(
            self.request_id,
            connection.tokenizer,
            self.prompts,
            params,
            reasoning_parser=reasoning_parser,
            collect=collect,
        )
        self._mailbox: Mailbox | None = None
        self._done = False
        # When the engine produced the newest token of the last chunk: its time.monotonic(), which on the
        # engine's host is this process's too (time.monotonic() - stream.produced: the delivery latency).
        self.produced: float | None = None
        # When this process's reader took that token off the socket (time.monotonic()): received -
        # produced is the wire's part of the delivery latency, the rest this process's event loop.
        self.received: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        """The prompt tokens of the request (each prompt counted once, whatever n is)."""
        return sum(map(len, self.prompts))

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
                self._mailbox = Mailbox(self.group.processors)
                for sample in self.group.leaders:
                    await self._send(sample)
            except BaseException:
                self._close_now()
                raise

    async def _send(self, sample: Sample) -> None:
        images = self.images if sample.index < self.params.n else ()  # (samples of the first prompt)
        await self.connection.submit(
            self._mailbox, sample.request_id, sample.prompt, sample.params, self.timeout, images
        )
        sample.sent = True

    async def __anext__(self) -> StreamChunk:
        if self._done:
            raise StopAsyncIteration
        if self._mailbox is None:
            await self._start()
        mailbox, group = self._mailbox, self.group
        single = len(group.samples) == 1  # one request: wait, then take, as ever
        try:
            while True:
                if single:
                    await mailbox.wait()
                sample, chunk, stop_now = group.take_any()
                if chunk is None:
                    if not single:  # several: every sample's pending output is taken before waiting
                        await mailbox.wait()
                    continue
                if chunk.finish_reason is not None:
                    # a stop string ended it: the engine stops it now; else it has finished there
                    (self.connection.abort if stop_now else self.connection.forget)(sample.request_id)
                    self._done = not group.open
                if sample.followers:  # the prompt's blocks are cached now: its other samples go
                    for follower in group.followers_of(sample):
                        await self._send(follower)
                self.produced, self.received = mailbox.produced, mailbox.received
                return chunk
        except BaseException:
            self._close_now()
            raise

    def completion(self) -> Completion:
        """Every chunk of the finished stream merged (a stream made with ``collect=True``)."""
        return self.group.completion()

    def _close_now(self) -> None:
        if not self._done:
            self._done = True
            for sample in self.group.open:
                if sample.sent:
                    self.connection.abort(sample.request_id)

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

    def __anext__(self) -> Coroutine[Any, Any, StreamChunk]:
        return self.stream.__anext__()  # the stream's own coroutine: no second one around it, per chunk

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.stream._close_now()
