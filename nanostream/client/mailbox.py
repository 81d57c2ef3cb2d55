"""Where the connection's reader leaves a stream's deltas for the stream to take."""

from __future__ import annotations

import asyncio

from nanostream import protocol as p
from nanostream.client.output_processor import OutputProcessor


class Mailbox:
    """Where the client's reader leaves a stream's deltas: each merged into its request's output
    processor at once (the reader never waits on the consumer), with one event that wakes the
    consumer. A stream of n samples has a request, and a processor, per sample."""

    def __init__(self, processors: dict[str, OutputProcessor]) -> None:
        self.processors = processors  # request id -> its processor
        self.failure: BaseException | None = None
        self.produced: float | None = None  # the engine's clock when the newest delta's step ended
        self.received: float | None = None  # this process's clock when the reader took that delta
        # A flag and the consumer's future while it waits: per token, cheaper than a new anyio.Event.
        self._ready = False
        self._waiter: asyncio.Future[None] | None = None

    def put(self, delta: p.RequestDelta, produced: float | None = None, received: float | None = None) -> None:
        self.processors[delta.request_id].put(delta)
        self.produced = produced if produced is not None else self.produced
        self.received = received
        self._wake()

    def fail(self, exc: BaseException) -> None:
        if not all(p.ends_pending for p in self.processors.values()):  # all last deltas here: nothing lost
            self.failure = exc
            self._wake()

    def _wake(self) -> None:
        self._ready = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self) -> None:
        """Until something was put or failed since the last wait (at once if it already was)."""
        if not self._ready:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        self._ready = False
        if self.failure is not None:
            raise self.failure
