"""The client process's side of the wire: one DEALER socket, the hello and registration, the reader
that leaves each request's deltas in its mailbox, heartbeats both ways, and what happens when the
engine goes away. ``AsyncClient`` (async_client.py) is the API on top.

The client stays registered on its own: heartbeats flow from the hello on (the tokenizer loads
meanwhile). If the connection breaks, the engine drops the client or restarts at the same
address, the open streams end with ``ConnectionLostError`` and the client says hello again as soon
as an engine answers there; new requests then run. ``EngineDeadError`` comes ``timeout`` seconds
after the engine's last message (a few milliseconds later at most) when it hangs, and at once when
its connection closes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from typing import Any

import anyio
import anyio.to_thread
import zmq
from zmq.utils.monitor import parse_monitor_message

from nanostream import protocol as p
from nanostream.client.mailbox import Mailbox
from nanostream.client.tokenizer_cache import load_tokenizer as _load_tokenizer
from nanostream.discovery import discover
from nanostream.errors import (
    ClientClosedError,
    ConnectionLostError,
    EngineDeadError,
    InvalidRequestError,
    ProtocolError,
)
from nanostream.sampling_params import SamplingParams

log = logging.getLogger(__name__)

ADDRESS_ENV = "NANOSTREAM_ADDRESS"
AUTH_TOKEN_ENV = "NANOSTREAM_AUTH_TOKEN"


class Connection:
    """A client's connection to one engine process (see the module's docstring); ``AsyncClient`` is
    the API on top of it."""

    def __init__(self, address: str | None = None, *, timeout: float = 10.0, auth_token: str | None = None) -> None:
        address = address or os.environ.get(ADDRESS_ENV) or discover()  # the one local `nanostream serve`
        if not address.startswith(("ipc://", "tcp://")):
            raise ValueError(f"engine address must be ipc://PATH or tcp://HOST:PORT, got {address!r}")
        if not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.address = address
        self.timeout = timeout
        self.auth_token = auth_token if auth_token is not None else os.environ.get(AUTH_TOKEN_ENV)
        self.client_id = uuid.uuid4().hex[:16]
        self._state = "new"  # new -> connecting -> open -> closing -> closed
        self._mailboxes: dict[str, Mailbox] = {}
        self._stats_waiters: list[tuple[anyio.Event, list]] = []
        self._dead: BaseException | None = None  # fatal: the engine refused this client for good
        self._lost: BaseException | None = None  # why the client is not registered now (None: it is)
        self._registered = asyncio.Event()  # (not anyio's: the socket callbacks, outside any task, make new ones)
        self._connected = False  # a connection to the engine's address is up
        self._welcome: p.Welcome | None = None
        self._last_hello = 0.0
        self.tokenizer: Any = None

    async def connect(self) -> None:
        """Say hello to the engine and start the reader. Raises EngineDeadError if nobody answers."""
        if self._state != "new":
            raise ClientClosedError(f"this AsyncClient is already {self._state}; create a new one")
        self._state = "connecting"
        self._loop = asyncio.get_running_loop()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.ROUTING_ID, self.client_id.encode())
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        # Not IMMEDIATE: with it, ZeroMQ drops what the engine sent last (a shutdown's terminal outputs,
        # a request's final tokens) when the connection closes, before the reader has taken it.
        self._sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_MESSAGE_BYTES)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self._sock.connect(self.address)
        self._reply: asyncio.Future[p.EngineMessage] = self._loop.create_future()  # the hello's answer
        self._later: asyncio.Queue = asyncio.Queue()  # (coroutine function, its argument) for _run_later
        self._fd = self._sock.getsockopt(zmq.FD)
        self._loop.add_reader(self._fd, self._on_readable)
        try:
            with anyio.fail_after(self.timeout):
                self._send_now(self._hello())
                reply = await self._reply
        except TimeoutError:
            self._teardown()
            raise EngineDeadError(
                f"no engine answered at {self.address} within {self.timeout:g} s; is `nanostream serve` running there?"
            ) from None
        except BaseException:
            self._teardown()
            raise
        if not isinstance(reply, p.Welcome):
            self._teardown()
            raise ProtocolError(getattr(reply, "message", f"unexpected reply {type(reply).__name__} to hello"))
        self._welcome, self._connected, self._last_heard = reply, True, time.monotonic()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        # Heartbeats flow from here on, so however long the tokenizer takes to load, the engine
        # never takes this client for a silent one.
        self._tg.start_soon(self._heartbeat_loop)
        self._tg.start_soon(self._run_later)
        self._loop.add_reader(self._monitor.getsockopt(zmq.FD), self._on_monitor)
        self._on_monitor()  # the events of the connection so far
        try:
            self.tokenizer = await anyio.to_thread.run_sync(
                _load_tokenizer, reply.tokenizer_digest, reply.tokenizer_files
            )
        except BaseException:
            self._state = "closing"
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)
            self._teardown()
            raise
        reply.tokenizer_files = {}  # loaded: keep no second copy
        self._registered.set()
        self._state = "open"

    async def close(self) -> None:
        """Abort this client's open requests and disconnect. Safe to call twice."""
        if self._state != "open":
            self._state = "closed"
            return
        self._state = "closing"
        self._send_now(p.encode(p.Bye()))
        self._fail_all(ClientClosedError("the AsyncClient was closed"))
        self._tg.cancel_scope.cancel()
        await self._tg.__aexit__(None, None, None)
        self._teardown()

    def _teardown(self) -> None:
        self._state = "closed"
        self._loop.remove_reader(self._fd)
        self._loop.remove_reader(self._monitor.getsockopt(zmq.FD))
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=200)  # (ms) time for the Bye to go out; nothing else waits to be sent
        self._ctx.term()

    def _check_open(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        if self._state != "open":
            raise ClientClosedError("the AsyncClient is not connected: use `async with AsyncClient(...) as client`")

    def _send_now(self, frame: bytes) -> bool:
        """Send without waiting; False if ZeroMQ refused the frame."""
        try:
            self._sock.send(frame, flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        self._recheck()  # a send can take the descriptor's signal for a message that came meanwhile
        return True

    def _recheck(self) -> None:
        """Read what waits, soon: ZeroMQ's descriptor signals an edge, which any call on the socket
        (a send, a look at its events) may have taken without the reader seeing it."""
        self._loop.call_soon(self._on_readable)

    def _input_waits(self) -> bool:
        if self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._recheck()
            return True
        return False

    def _check_reachable(self) -> None:
        """Raise at once, rather than when the request is sent, if no engine is even connected."""
        self._check_open()
        if self._lost is not None and not self._connected:
            raise EngineDeadError(f"not connected to an engine at {self.address} ({self._lost}); retry later")

    def _send_hello(self) -> None:
        self._last_hello = time.monotonic()
        self._send_now(self._hello())

    def _hello(self) -> bytes:
        digest = self._welcome.tokenizer_digest if self._welcome is not None else None
        return p.encode(p.Hello(p.PROTOCOL_VERSION, self.auth_token, os.getpid(), digest))

    async def _ready(self) -> None:
        """Return once the client is registered with the engine; raise EngineDeadError if it is not
        within ``timeout`` (at once when no engine is even connected)."""
        self._check_open()
        if self._registered.is_set():
            return
        if self._connected:
            with anyio.move_on_after(self.timeout):
                await self._registered.wait()
        self._check_open()
        if not self._registered.is_set():
            raise EngineDeadError(f"not connected to an engine at {self.address} ({self._lost}); retry later")

    def _on_readable(self) -> None:
        """The event loop's callback on the socket's descriptor: every message waiting is handled here
        and now (a step's outputs reach their mailboxes without a reader task to wake first)."""
        while True:
            try:  # (a look at the events costs a fifth of a read that finds nothing)
                if not self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    return
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.ZMQError:  # the socket closed meanwhile
                return
            self._last_heard = received = time.monotonic()
            try:
                message = p.decode_engine_message(frame)
            except ProtocolError as exc:
                if not self._reply.done():  # the answer to the hello: connect() raises it
                    self._reply.set_exception(exc)
                else:
                    log.warning("ignoring a message from the engine: %s", exc)
                continue
            if not self._reply.done():
                if not isinstance(message, p.Heartbeat):
                    self._reply.set_result(message)
                continue
            try:
                if isinstance(message, p.Welcome):  # rare: a new registration may bring a new tokenizer
                    self._later.put_nowait((self._welcomed_again, message))
                else:
                    self._dispatch(message, received)
            except Exception as exc:  # a bug here must not go unseen: every stream hears of it
                log.exception("handling a %s from the engine failed", type(message).__name__)
                self._die(EngineDeadError(f"the client failed on a message from the engine: {exc!r}"))
                return

    def _dispatch(self, message: p.EngineMessage, received: float) -> None:
        if isinstance(message, p.Outputs):
            for out in message.outputs:
                mailbox = self._mailboxes.get(out.request_id)
                if mailbox is not None:
                    mailbox.put(out, message.produced, received)
        elif isinstance(message, p.Stats) and self._stats_waiters:
            event, slot = self._stats_waiters.pop(0)
            slot.append(message)
            event.set()
        elif isinstance(message, p.Shutdown):
            self._lose(EngineDeadError(f"the engine at {self.address} shut down: {message.reason}"))
        elif isinstance(message, p.Error):
            if message.fatal:
                self._die(ProtocolError(message.message))
            elif message.code in ("unregistered", "dropped"):
                self._lose(ConnectionLostError(f"{message.message}; this client registers again"))
            else:
                log.warning("engine error: %s", message.message)

    async def _run_later(self) -> None:
        """What the socket callbacks met that has to wait on something (a tokenizer to load, the last
        messages of a closed connection), one at a time and in order."""
        while True:
            work, arg = await self._later.get()
            try:
                await work(arg)
            except Exception as exc:
                log.exception("handling an event of the connection failed")
                self._die(EngineDeadError(f"the client failed on an event of its connection: {exc!r}"))

    async def _welcomed_again(self, message: p.Welcome) -> None:
        if self._registered.is_set():  # an answer to a hello said twice
            return
        if message.tokenizer_digest != self._welcome.tokenizer_digest:  # the engine restarted on another model
            self.tokenizer = await anyio.to_thread.run_sync(
                _load_tokenizer, message.tokenizer_digest, message.tokenizer_files
            )
            message.tokenizer_files = {}
        log.info("registered with the engine at %s again", self.address)
        self._welcome, self._lost = message, None
        self._registered.set()

    async def _heartbeat_loop(self) -> None:
        interval = min(self._welcome.heartbeat_interval, self.timeout / 4)
        beat = p.encode(p.Heartbeat())
        next_beat = time.monotonic()
        while True:
            # Wake for the next beat, or exactly when the engine's silence reaches the timeout.
            wake = min(next_beat, self._last_heard + self.timeout)
            await anyio.sleep(max(0.0, wake - time.monotonic()))
            now = time.monotonic()
            if now - wake > interval:
                # This process stalled (stopped, swapped, a blocked event loop), not necessarily the
                # engine: give what it sent meanwhile two beats to arrive (it may say we were dropped).
                self._last_heard = max(self._last_heard, now - self.timeout + 2 * interval)
            if self._lost is None and now - self._last_heard >= self.timeout:
                if self._input_waits():  # messages wait: read them first
                    await anyio.sleep(0.001)
                    continue
                self._lose(
                    EngineDeadError(f"the engine at {self.address} sent nothing for {now - self._last_heard:.1f} s")
                )
            if now >= next_beat:
                next_beat = now + interval
                if self._lost is None:
                    self._send_now(beat)
                elif self._connected and now - self._last_hello >= self.timeout:  # unanswered: say it again
                    self._send_hello()
            if self._lost is not None:
                self._last_heard = max(self._last_heard, now)  # a lost client times nothing out

    def _on_monitor(self) -> None:
        while True:
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))["event"]
            except zmq.ZMQError:  # nothing more (or closed)
                return
            if event == zmq.EVENT_DISCONNECTED:
                self._connected = False
                self._later.put_nowait((self._disconnected, None))
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._connected = True
                if self._lost is not None:
                    self._send_hello()

    async def _disconnected(self, _: None) -> None:
        # What the engine sent before it went (a shutdown's terminal outputs) is still queued here:
        # let the reader take it first, so that each stream ends with its own reason.
        with anyio.move_on_after(1.0):
            await anyio.sleep(0.01)  # (it may still be on its way from ZeroMQ's I/O thread)
            while self._input_waits():
                await anyio.sleep(0.001)
        self._lose(ConnectionLostError(f"lost the connection to the engine at {self.address}"))

    def _lose(self, exc: EngineDeadError) -> None:
        """The engine no longer knows this client: end every open stream with ``exc``; say hello again
        (now, on the next beat, and when a connection comes up) until an engine welcomes it."""
        if self._lost is not None or self._dead is not None:  # the reader, heartbeat and monitor can all notice
            return
        log.error("%s", exc)
        self._lost = exc
        self._registered = asyncio.Event()
        self._fail_all(exc)
        if self._connected:  # else on the next connection: what is sent now would wait for it in a queue
            self._send_hello()

    def _die(self, exc: BaseException) -> None:
        if self._dead is not None:
            return
        log.error("%s", exc)
        self._dead = exc
        self._fail_all(exc)
        self._registered.set()  # wake the waiters: _check_open raises for them

    def _fail_all(self, exc: BaseException) -> None:
        for mailbox in self._mailboxes.values():
            mailbox.fail(exc)
        self._mailboxes.clear()
        for event, _ in self._stats_waiters:
            event.set()
        self._stats_waiters.clear()

    async def _submit(
        self,
        mailbox: Mailbox,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        timeout: float | None,
    ) -> None:
        """Send one request; the reader fills ``mailbox`` with its deltas from now on."""
        frame = p.encode(p.Add(request_id, prompt_token_ids, params, timeout))
        limit = self._welcome.max_request_bytes
        if len(frame) > limit:
            raise InvalidRequestError(
                f"the request is {len(frame)} bytes, over the engine's limit of {limit}; shorten the prompt"
            )
        await self._ready()
        if not self._send_now(frame):
            raise ConnectionLostError(f"lost the connection to the engine at {self.address}; nothing was sent")
        self._mailboxes[request_id] = mailbox

    def _forget(self, request_id: str) -> None:
        self._mailboxes.pop(request_id, None)

    def _abort(self, request_id: str) -> None:
        self._mailboxes.pop(request_id, None)
        if self._state == "open":
            self._send_now(p.encode(p.Abort([request_id])))
