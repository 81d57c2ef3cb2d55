"""Where the connection's reader leaves a stream's deltas for the stream to take."""

from __future__ import annotations

import anyio

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
        self._event = anyio.Event()

    def put(self, delta: p.RequestDelta, produced: float | None = None) -> None:
        self.processors[delta.request_id].put(delta)
        self.produced = produced if produced is not None else self.produced
        self._event.set()

    def fail(self, exc: BaseException) -> None:
        if not all(p.ends_pending for p in self.processors.values()):  # all last deltas here: nothing lost
            self.failure = exc
            self._event.set()

    async def wait(self) -> None:
        await self._event.wait()
        self._event = anyio.Event()
        if self.failure is not None:
            raise self.failure
