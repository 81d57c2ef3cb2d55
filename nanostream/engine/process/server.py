"""The engine process: an ``LLMEngine`` busy loop behind a ``Transport`` (engine/process/transport.py).

One thread does it all, each iteration:
  1. transport.receive(): what clients sent (hello, stats, disconnections; add and abort go to the
     RequestBook of engine/process/request_book.py: limits, routing, deadlines), waiting only when idle
  2. engine.step(): launch a step, read back the previous one's tokens
  3. heartbeats, silent clients dropped, requests past their timeout aborted
  4. one Outputs per client for everything this iteration produced, encoded and sent
     (transport.flush()) while the launched step runs on the device

What one client can make the engine hold is bounded: frames by size (transport), requests and
prompt tokens by ``ServerConfig``'s queue limits (a request past them is refused as "busy"), and a
client's liveness by its heartbeats, counted from its hello.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from nanostream import protocol as p
from nanostream.config import EngineConfig, ServerConfig
from nanostream.distributed.rendezvous import Rendezvous
from nanostream.engine.llm_engine import LLMEngine
from nanostream.engine.process.address import SelfProbe, check_bind_address, default_address
from nanostream.engine.process.request_book import Client, RequestBook
from nanostream.engine.process.transport import DISCONNECTED, NOT_READING, Transport
from nanostream.engine.process.welcome_files import files_digest, tokenizer_files
from nanostream.errors import EngineDeadError

log = logging.getLogger(__name__)

SHUTDOWN_MESSAGE = "engine shutting down"
_MESSAGES_PER_ITERATION = 1024  # a flood of messages still lets the engine step between batches of them
_PROBE_WARNING_S = 10.0  # the engine's own hello not heard after this long: something is wrong at the address
_ADD_STEPS_PER_ITERATION = 2  # Adds read per iteration: up to this many steps' prompt tokens (max_num_batched_tokens)


class EngineFailure(RuntimeError):
    """The engine cannot go on (a tensor-parallel worker died or hung): every client is told, the process exits."""


class EngineServer:
    """``rendezvous``: torchrun's variables, when this process is rank 0 of tensor-parallel ranks torchrun launched."""

    def __init__(
        self, engine_config: EngineConfig, server_config: ServerConfig, rendezvous: Rendezvous | None = None
    ) -> None:
        self.config = server_config
        self.address = server_config.address or default_address()
        check_bind_address(self.address, server_config.auth_token)  # before the slow part: loading
        self.engine = LLMEngine(engine_config, rendezvous)
        vision = self.engine.vision  # a vision-language model: clients get its image processor, send pixel rows
        images = self.engine.model_path if vision is not None else None
        files, template = tokenizer_files(Path(engine_config.tokenizer or self.engine.model_path), images)
        self.engine_id = secrets.token_hex(8)
        per_token = 0 if vision is None else vision.merge**2 * vision.spec.patch_pixels * 4  # float32 rows a token
        max_request_bytes = p.max_request_bytes(self.engine.max_model_len, per_token)
        welcome = p.Welcome(
            protocol_version=p.PROTOCOL_VERSION,
            engine_id=self.engine_id,
            model=engine_config.model,
            max_model_len=self.engine.max_model_len,
            vocab_size=self.engine.vocab_size,
            eos_token_ids=sorted(self.engine.eos_token_ids),
            tokenizer_digest=files_digest(files),
            tokenizer_files=files,
            chat_template=template,
            heartbeat_interval=server_config.heartbeat_interval,
            client_timeout=server_config.client_timeout,
            max_request_bytes=max_request_bytes,
            pooling=self.engine.pooling,
        )
        self._digest = welcome.tokenizer_digest
        self._welcome = p.encode(welcome)
        welcome.tokenizer_files = {}
        self._welcome_back = p.encode(welcome)  # for a client that has the files already
        self._parent = os.getppid() if server_config.exit_with_parent else None
        self.clients: dict[bytes, Client] = {}
        self.dropped_clients = 0
        self.requests = RequestBook(self.engine, server_config, self.clients)
        self._stop = threading.Event()
        self._probe: SelfProbe | None = None  # serve_forever's hello to itself, until the busy loop hears it
        self._ready: Callable[[str], None] | None = None
        self._probe_warned = False
        self.stopped_by: int | None = None  # the signal that stopped serve_forever, if one did
        self.transport = Transport(self.address, max_request_bytes)
        self.address = self.transport.address

    def _send(self, identity: bytes, message: bytes | p._Message) -> None:
        self.transport.send(identity, message)

    # ---- the busy loop ---------------------------------------------------------------------------

    def serve_forever(self, ready: Callable[[str], None] | None = None) -> None:
        """Run until SIGINT/SIGTERM; then end every open request and close cleanly. Raises
        ``EngineFailure`` if the engine cannot go on (after telling every client). ``ready(address)`` is
        called from the busy loop once a client can connect there and be heard: when the loop has read
        a hello this process sent itself through the address."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self._on_signal)
        # "Ready" waits for a hello of this process's own through the address (address.SelfProbe).
        self._probe = SelfProbe(self.address) if ready is not None else None
        self._ready = ready
        next_beat = time.monotonic()
        reason = SHUTDOWN_MESSAGE
        try:
            while not self._stop.is_set():
                # 1. messages from clients; wait for one only while there is nothing to compute
                self._handle_inputs(block=not self.engine.has_unfinished())
                if self.engine.failure is not None:  # a tensor-parallel worker died or hung, seen while idle
                    reason = f"the engine failed: {self.engine.failure}"
                    raise EngineFailure(reason)
                # 2. one engine step: the next is launched before this one's outputs are routed
                if self.engine.has_unfinished():
                    deltas = self.engine.step().deltas
                    self.requests.route(deltas, time.monotonic())
                # 3. heartbeats out, silent clients dropped, requests past their timeout aborted
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + self.config.heartbeat_interval
                    self._liveness(now)
                self.requests.expire(now)
                # 4. one Outputs message per client for everything this iteration produced, sent now
                self.requests.flush(self._send)
                self.transport.flush()
        except BaseException as exc:
            if isinstance(exc, EngineDeadError):  # a tensor-parallel rank is gone: no traceback of ours helps
                reason = f"the engine failed: {exc}"
                log.error(reason)
            elif not isinstance(exc, (EngineFailure, KeyboardInterrupt)):
                log.exception("the engine loop failed")
                reason = f"the engine failed: {type(exc).__name__}: {exc}"
            raise
        finally:
            if self._probe is not None:  # stopped before it was heard
                self._probe.close()
            self._shutdown(reason)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stopped_by = signum
        self._stop.set()

    def _handle_inputs(self, block: bool) -> None:
        timeout = self.config.heartbeat_interval / 2 if block else 0.0
        # A burst of Adds is taken a step's worth or two at a time (adding one costs the host ~50-250 us):
        # the step launched in between keeps the device busy while the next ones are read, instead of
        # waiting for the whole burst to be added.
        tokens = _ADD_STEPS_PER_ITERATION * self.engine.config.max_num_batched_tokens
        for identity, message in self.transport.receive(timeout, _MESSAGES_PER_ITERATION, tokens):
            try:
                self._handle(identity, message)
            except Exception:  # a bug in handling one message must not cost every client the engine
                log.exception("handling a %s from client %s failed", type(message).__name__, identity.hex())

    def _handle(self, identity: bytes, message: p.ClientMessage | object) -> None:
        if self._probe is not None and identity == self._probe.identity:
            if isinstance(message, p.Hello):  # heard through the address: clients can connect
                self._probe.close()
                self._probe = None
                self._ready(self.address)
            return
        client = self.clients.get(identity)
        if isinstance(message, p.Hello):
            self._hello(identity, message)
            return
        if client is None:  # dropped while this was on its way; a Bye or a disconnection needs no answer
            if message not in (DISCONNECTED, NOT_READING) and not isinstance(message, p.Bye):
                self._send(identity, p.Error(_UNREGISTERED, code="unregistered"))
            return
        if message is DISCONNECTED:
            self._drop(client, "disconnected", notify=False)
            return
        if message is NOT_READING:
            self._drop(client, "left its last messages unread", notify=False)
            return
        client.last_seen = time.monotonic()
        if isinstance(message, p.Add):
            self.requests.add(client, message)
        elif isinstance(message, p.Abort):
            for rid in message.request_ids:  # acknowledged with the request's terminal "abort" output
                self.requests.finish(client.identity, rid, "abort", None, notify=True)
        elif isinstance(message, p.GetStats):
            self._send(identity, self._stats())
        elif isinstance(message, p.Bye):
            self._drop(client, "said goodbye", notify=False)

    def _hello(self, identity: bytes, hello: p.Hello) -> None:
        if hello.protocol_version != p.PROTOCOL_VERSION:
            reason, code = (
                (
                    f"protocol version {hello.protocol_version} is not supported: this engine speaks version "
                    f"{p.PROTOCOL_VERSION}; use a nanostream client of the engine's version"
                ),
                "version",
            )
        elif self.config.auth_token and not hmac.compare_digest(
            (hello.auth_token or "").encode(), self.config.auth_token.encode()
        ):
            reason, code = (
                "bad or missing auth token: pass the engine's --auth-token (or NANOSTREAM_AUTH_TOKEN)",
                "auth",
            )
        else:
            # A client is alive from its hello on: its tokenizer loads while its heartbeats already flow.
            self.clients.setdefault(identity, Client(identity, time.monotonic())).last_seen = time.monotonic()
            self.transport.register(identity)
            log.info("client %s connected (pid %d)", identity.hex(), hello.pid)
            self._send(identity, self._welcome_back if hello.tokenizer_digest == self._digest else self._welcome)
            return
        log.warning("client %s refused: %s", identity.hex(), reason)
        if identity in self.clients:
            self._drop(self.clients[identity], "was refused", notify=False)
        self._send(identity, p.Error(reason, fatal=True, code=code))

    def _stats(self) -> p.Stats:
        sched = self.engine.scheduler
        return p.Stats(
            running=len(sched.running),
            waiting=self.engine.num_waiting,
            free_kv_blocks=self.engine.block_manager.num_free_blocks,
            total_kv_blocks=self.engine.block_manager.num_blocks,
            clients=len(self.clients),
            requests_by_client={c.name: len(c.requests) for c in self.clients.values()},
            waiting_tokens=self.engine.num_waiting_tokens,
            dropped_clients=self.dropped_clients,
            engine=self.engine.stats(),
        )

    def _liveness(self, now: float) -> None:
        if self._probe is not None and not self._probe_warned and now - self._probe.sent > _PROBE_WARNING_S:
            self._probe_warned = True
            log.warning(
                "this engine's own hello through %s has not arrived in %g s: clients cannot connect there yet",
                self.address,
                _PROBE_WARNING_S,
            )
        if self._parent is not None and os.getppid() != self._parent:  # orphaned: re-parented
            log.warning("the process that started this engine (pid %d) has exited: stopping", self._parent)
            self._stop.set()
        for client in list(self.clients.values()):
            silent = now - client.last_seen
            if silent > self.config.client_timeout:
                self._drop(client, f"was silent for {silent:.1f} s (client_timeout {self.config.client_timeout:g} s)")
            else:
                self._send(client.identity, p.Heartbeat())

    def _drop(self, client: Client, why: str, notify: bool = True) -> None:
        """Forget a client and abort its requests; ``notify`` tells it (it may still be listening)."""
        level = logging.WARNING if client.requests else logging.INFO
        log.log(level, "client %s %s: dropped, aborting its %d request(s)", client.name, why, len(client.requests))
        # Counted: the drops that cost a client something. A goodbye, or a closed connection with nothing
        # open, is how a client leaves.
        leaving = why in ("said goodbye", "was refused") or (why == "disconnected" and not client.requests)
        self.dropped_clients += not leaving
        self.requests.forget_client(client)
        del self.clients[client.identity]
        self.transport.unregister(client.identity)
        if notify:
            self._send(client.identity, p.Error(f"the engine dropped this client: it {why}", code="dropped"))

    def _shutdown(self, reason: str) -> None:
        self.requests.shutdown(reason, self._send)
        for identity in self.clients:
            self._send(identity, p.Shutdown(reason))
        self.transport.close()
        self.engine.close()


_UNREGISTERED = "this connection is not registered with the engine (the engine dropped it): say hello again"
