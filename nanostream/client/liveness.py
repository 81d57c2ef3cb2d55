"""Whether the engine knows this client: heartbeats both ways, the connection's ups and downs, and
saying hello again until an engine welcomes the client back.

``lost`` says why the client is not registered now (None: it is), ``dead`` why it never will be
again; either ends every open stream at once (through the connection's ``fail_all``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import anyio
import zmq

from nanostream import protocol as p
from nanostream.client.dealer import Dealer
from nanostream.errors import ConnectionLostError, EngineDeadError

log = logging.getLogger(__name__)


class Liveness:
    """The link to the engine at ``address`` over ``dealer`` (set once connecting); ``hello()`` is the
    frame that registers, ``later`` the connection's queue of work for its serving task."""

    def __init__(
        self,
        address: str,
        timeout: float,
        hello: Callable[[], bytes],
        fail_all: Callable[[BaseException], None],
        later: asyncio.Queue,
    ) -> None:
        self.address, self.timeout = address, timeout
        self._hello, self._fail_all, self._later = hello, fail_all, later
        self.dealer: Dealer | None = None
        self.dead: BaseException | None = None  # fatal: the engine refused this client for good
        self.lost: BaseException | None = None
        self.registered = asyncio.Event()  # (asyncio's: the socket callbacks, outside any task, make new ones)
        self.connected = False  # a connection to the engine's address is up
        self.last_heard = time.monotonic()
        self._last_hello = 0.0

    def welcomed(self) -> None:
        self.lost = None
        self.registered.set()

    async def registered_within(self) -> bool:
        """Whether the client is registered, waiting ``timeout`` for it if the engine is connected."""
        if not self.registered.is_set() and self.connected:
            with anyio.move_on_after(self.timeout):
                await self.registered.wait()
        return self.registered.is_set()

    def say_hello(self) -> None:
        self._last_hello = time.monotonic()
        self.dealer.send(self._hello())

    async def heartbeat_loop(self, interval: float) -> None:
        beat = p.encode(p.Heartbeat())
        interval = min(interval, self.timeout / 4)
        next_beat = time.monotonic()
        while True:
            # Wake for the next beat, or exactly when the engine's silence reaches the timeout.
            wake = min(next_beat, self.last_heard + self.timeout)
            await anyio.sleep(max(0.0, wake - time.monotonic()))
            now = time.monotonic()
            if now - wake > interval:
                # This process stalled (stopped, swapped, a blocked event loop), not necessarily the
                # engine: give what it sent meanwhile two beats to arrive (it may say we were dropped).
                self.last_heard = max(self.last_heard, now - self.timeout + 2 * interval)
            if self.lost is None and now - self.last_heard >= self.timeout:
                if self.dealer.input_waits():  # messages wait: read them first
                    await anyio.sleep(0.001)
                    continue
                self.lose(
                    EngineDeadError(f"the engine at {self.address} sent nothing for {now - self.last_heard:.1f} s")
                )
            if now >= next_beat:
                next_beat = now + interval
                if self.lost is None:
                    self.dealer.send(beat)
                elif self.connected and now - self._last_hello >= self.timeout:  # unanswered: say it again
                    self.say_hello()
            if self.lost is not None:
                self.last_heard = max(self.last_heard, now)  # a lost client times nothing out

    def on_event(self, event: int) -> None:
        """A connection event from the socket's monitor."""
        if event == zmq.EVENT_DISCONNECTED:
            self.connected = False
            self._later.put_nowait((self._disconnected, None))
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.connected = True
            if self.lost is not None:
                self.say_hello()

    async def _disconnected(self, _: None) -> None:
        # What the engine sent before it went (a shutdown's terminal outputs) is still queued here:
        # let the reader take it first, so that each stream ends with its own reason.
        with anyio.move_on_after(1.0):
            await anyio.sleep(0.01)  # (it may still be on its way from ZeroMQ's I/O thread)
            while self.dealer.input_waits():
                await anyio.sleep(0.001)
        self.lose(ConnectionLostError(f"lost the connection to the engine at {self.address}"))

    def lose(self, exc: EngineDeadError) -> None:
        """The engine no longer knows this client: end every open stream with ``exc``; say hello again
        (now, on the next beat, and when a connection comes up) until an engine welcomes it."""
        if self.lost is not None or self.dead is not None:  # the reader, heartbeat and monitor can all notice
            return
        log.error("%s", exc)
        self.lost = exc
        self.registered = asyncio.Event()
        self._fail_all(exc)
        if self.connected:  # else on the next connection: what is sent now would wait for it in a queue
            self.say_hello()

    def die(self, exc: BaseException) -> None:
        if self.dead is not None:
            return
        log.error("%s", exc)
        self.dead = exc
        self._fail_all(exc)
        self.registered.set()  # wake the waiters: check_open raises for them
