"""The client process's side of the wire: the hello and registration, the reader that leaves each
request's deltas in its mailbox, heartbeats both ways, and what happens when the engine goes away.
``AsyncClient`` (async_client.py) holds one; the socket itself is a ``Dealer`` (dealer.py).

The client stays registered on its own: heartbeats flow from the hello on (the tokenizer loads
meanwhile). If the connection breaks, the engine drops the client or restarts at the same
address, the open streams end with ``ConnectionLostError`` and the client says hello again as soon
as an engine answers there; new requests then run. ``EngineDeadError`` comes ``timeout`` seconds
after the engine's last message (a few milliseconds later at most) when it hangs, and at once when
its connection closes.

Heartbeats and deferred work run in the connection's own task (``_serve``), from ``connect()`` to
``close()``: any task may close a connection, not only the one that connected it.
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

from nanostream import protocol as p
from nanostream.client.dealer import Dealer
from nanostream.client.liveness import Liveness
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
    """A client's connection to one engine process (see the module's docstring): ``connect()``, then
    ``submit``, ``abort`` and ``forget`` requests and ask for ``stats()``; ``close()`` from any task."""

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
        self._later: asyncio.Queue = asyncio.Queue()  # (coroutine function, its argument) for _run_later
        self._link = Liveness(address, timeout, self._hello, self._fail_all, self._later)
        self._settled = asyncio.Event()  # connect() has ended, connected or not
        self._stop = asyncio.Event()  # set: the serving task ends and tears the connection down
        self._serving: asyncio.Task | None = None
        self._welcome: p.Welcome | None = None
        self.tokenizer: Any = None

    async def connect(self) -> None:
        """Say hello to the engine and start the background work. Raises EngineDeadError if nobody answers."""
        if self._state != "new":
            raise ClientClosedError(f"this AsyncClient is already {self._state}; create a new one")
        self._state = "connecting"
        try:
            await self._connect()
        finally:
            self._settled.set()

    async def _connect(self) -> None:
        self._reply: asyncio.Future[p.EngineMessage] = asyncio.get_running_loop().create_future()  # the hello's
        self._dealer = self._link.dealer = Dealer(self.address, self.client_id.encode(), self._on_frame)
        try:
            with anyio.fail_after(self.timeout):
                self._dealer.send(self._hello())
                reply = await self._reply
            if not isinstance(reply, p.Welcome):
                raise ProtocolError(getattr(reply, "message", f"unexpected reply {type(reply).__name__} to hello"))
        except BaseException as exc:
            self._teardown()
            if isinstance(exc, TimeoutError):
                raise EngineDeadError(
                    f"no engine answered at {self.address} within {self.timeout:g} s; is `nanostream serve` "
                    "running there?"
                ) from None
            raise
        self._welcome, self._link.connected, self._link.last_heard = reply, True, time.monotonic()
        # Heartbeats flow from here on, so however long the tokenizer takes to load, the engine
        # never takes this client for a silent one.
        self._serving = asyncio.get_running_loop().create_task(self._serve())
        self._dealer.watch(self._link.on_event)
        try:
            self.tokenizer = await anyio.to_thread.run_sync(
                _load_tokenizer, reply.tokenizer_digest, reply.tokenizer_files
            )
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._stop_serving()
            raise
        reply.tokenizer_files = {}  # loaded: keep no second copy
        self._link.welcomed()
        self._state = "open"

    async def close(self) -> None:
        """Abort this client's open requests and disconnect, from any task (once connected). Safe to call twice."""
        if self._state == "connecting":
            await self._settled.wait()
        if self._state == "open":
            self._state = "closing"
            self._dealer.send(p.encode(p.Bye()))
            self._fail_all(ClientClosedError("the AsyncClient was closed"))
        if self._serving is not None:
            await self._stop_serving()
        self._state = "closed"

    async def _stop_serving(self) -> None:
        self._stop.set()
        await asyncio.shield(self._serving)  # (a closer cancelled meanwhile: the teardown goes on)

    async def _serve(self) -> None:
        """The connection's background work, until ``close()``: heartbeats, and what the socket's
        callbacks left to a task. Then the socket closes."""
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._link.heartbeat_loop, self._welcome.heartbeat_interval)
                tg.start_soon(self._run_later)
                await self._stop.wait()
                tg.cancel_scope.cancel()
        except Exception as exc:  # a bug here must not go unseen: every stream hears of it
            log.exception("the client's background work failed")
            self._link.die(EngineDeadError(f"the client failed: {exc!r}"))
        finally:
            self._teardown()

    def _teardown(self) -> None:
        self._state = "closed"
        self._dealer.close()

    @property
    def welcome(self) -> p.Welcome:
        """What the engine said of itself when this client registered (model, limits, template)."""
        self.check_open()
        return self._welcome

    def check_open(self) -> None:
        if self._link.dead is not None:
            raise EngineDeadError(str(self._link.dead))
        if self._state != "open":
            raise ClientClosedError("the AsyncClient is not connected: use `async with AsyncClient(...) as client`")

    def check_reachable(self) -> None:
        """Raise at once, rather than when a request is sent, if no engine is even connected."""
        self.check_open()
        if self._link.lost is not None and not self._link.connected:
            raise EngineDeadError(f"not connected to an engine at {self.address} ({self._link.lost}); retry later")

    async def submit(
        self, mailbox: Mailbox, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        timeout: float | None, images: list[p.ImageInput] = (),
    ) -> None:  # fmt: skip
        """Send one request (and its prompt's ``images``); the reader fills ``mailbox`` with its deltas from now on."""
        frame = p.encode(p.Add(request_id, prompt_token_ids, params, timeout, list(images)))
        limit = self._welcome.max_request_bytes
        if len(frame) > limit:
            raise InvalidRequestError(
                f"the request is {len(frame)} bytes, over the engine's limit of {limit}; shorten the prompt"
                + (" or send fewer or smaller images" if images else "")
            )
        await self._ready()
        if not self._dealer.send(frame):
            raise ConnectionLostError(f"lost the connection to the engine at {self.address}; nothing was sent")
        self._mailboxes[request_id] = mailbox

    def forget(self, request_id: str) -> None:
        """Stop delivering the request's deltas (it has finished)."""
        self._mailboxes.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Stop delivering the request's deltas and tell the engine to stop it. Idempotent."""
        self._mailboxes.pop(request_id, None)
        if self._state == "open":
            self._dealer.send(p.encode(p.Abort([request_id])))

    async def stats(self) -> p.Stats:
        """The engine's counters: running and waiting requests, free KV blocks, clients."""
        await self._ready()
        event, slot = anyio.Event(), []
        self._stats_waiters.append((event, slot))
        if not self._dealer.send(p.encode(p.GetStats())):
            self._stats_waiters.remove((event, slot))
            raise ConnectionLostError(f"lost the connection to the engine at {self.address}; nothing was sent")
        with anyio.fail_after(self.timeout):
            await event.wait()
        if not slot:
            raise EngineDeadError(str(self._link.dead or self._link.lost or "the client was closed"))
        return slot[0]

    def _hello(self) -> bytes:
        digest = self._welcome.tokenizer_digest if self._welcome is not None else None
        return p.encode(p.Hello(p.PROTOCOL_VERSION, self.auth_token, os.getpid(), digest))

    async def _ready(self) -> None:
        """Once registered with the engine; EngineDeadError if not within ``timeout`` (at once: no connection)."""
        self.check_open()
        if not self._link.registered.is_set():
            registered = await self._link.registered_within()
            self.check_open()
            if not registered:
                raise EngineDeadError(f"not connected to an engine at {self.address} ({self._link.lost}); retry later")

    def _on_frame(self, frame: bytes, received: float) -> None:
        """Each frame from the engine, as the socket's reader callback takes it."""
        self._link.last_heard = received
        try:
            message = p.decode_engine_message(frame)
        except ProtocolError as exc:
            if not self._reply.done():  # the answer to the hello: connect() raises it
                self._reply.set_exception(exc)
            else:
                log.warning("ignoring a message from the engine: %s", exc)
            return
        if not self._reply.done():
            if not isinstance(message, p.Heartbeat):
                self._reply.set_result(message)
            return
        try:
            if isinstance(message, p.Welcome):  # rare: a new registration may bring a new tokenizer
                self._later.put_nowait((self._welcomed_again, message))
            else:
                self._dispatch(message, received)
        except Exception as exc:  # a bug here must not go unseen: every stream hears of it
            log.exception("handling a %s from the engine failed", type(message).__name__)
            self._link.die(EngineDeadError(f"the client failed on a message from the engine: {exc!r}"))

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
            self._link.lose(EngineDeadError(f"the engine at {self.address} shut down: {message.reason}"))
        elif isinstance(message, p.Error):
            if message.fatal:
                self._link.die(ProtocolError(message.message))
            elif message.code in ("unregistered", "dropped"):
                self._link.lose(ConnectionLostError(f"{message.message}; this client registers again"))
            else:
                log.warning("engine error: %s", message.message)

    async def _run_later(self) -> None:
        """Work the socket callbacks left to a task (a tokenizer to load, a lost link), in order."""
        while True:
            work, arg = await self._later.get()
            try:
                await work(arg)
            except Exception as exc:
                log.exception("handling an event of the connection failed")
                self._link.die(EngineDeadError(f"the client failed on an event of its connection: {exc!r}"))

    async def _welcomed_again(self, message: p.Welcome) -> None:
        if self._link.registered.is_set():  # an answer to a hello said twice
            return
        if message.tokenizer_digest != self._welcome.tokenizer_digest:  # the engine restarted on another model
            self.tokenizer = await anyio.to_thread.run_sync(
                _load_tokenizer, message.tokenizer_digest, message.tokenizer_files
            )
            message.tokenizer_files = {}
        log.info("registered with the engine at %s again", self.address)
        self._welcome = message
        self._link.welcomed()

    def _fail_all(self, exc: BaseException) -> None:
        for mailbox in self._mailboxes.values():
            mailbox.fail(exc)
        self._mailboxes.clear()
        for event, _ in self._stats_waiters:
            event.set()
        self._stats_waiters.clear()
