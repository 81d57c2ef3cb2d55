"""The engine process: an ``LLMEngine`` busy loop behind a ``Transport`` (engine/transport.py).

transport.inputs ──▶ busy loop (this thread):
                       1. handle messages (hello, add, abort, stats; disconnections)
                       2. engine.step()
                       3. heartbeats, silent clients dropped, requests past their timeout aborted
                       4. one Outputs per client for everything this iteration produced
                     ──▶ transport.send() ──▶ encoder and io threads ──▶ clients

What one client can make the engine hold is bounded: frames by size (transport), requests and
prompt tokens by ``ServerConfig``'s queue limits (a request past them is refused as "busy"), and a
client's liveness by its heartbeats, counted from its hello.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import logging
import queue
import secrets
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from nanostream import protocol as p
from nanostream.config import EngineConfig, ServerConfig
from nanostream.engine.llm_engine import LLMEngine
from nanostream.engine.transport import DISCONNECTED, NOT_READING, Transport, check_bind_address, default_address
from nanostream.errors import InvalidRequestError

log = logging.getLogger(__name__)

SHUTDOWN_MESSAGE = "engine shutting down"
_MESSAGES_PER_ITERATION = 1024  # a flood of messages still lets the engine step between batches of them


class EngineFailure(RuntimeError):
    """The engine cannot go on (a thread of its process died): every client is told, the process exits."""


def tokenizer_files(path: Path) -> tuple[dict[str, bytes], str | None]:
    """The tokenizer as files a client can load on its own, and its chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        files = {f.name: f.read_bytes() for f in Path(tmp).iterdir() if f.is_file()}
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
    return files, template


def files_digest(files: dict[str, bytes]) -> str:
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    return digest.hexdigest()[:32]


def _engine_id(identity: bytes, request_id: str) -> str:
    """The engine's key for a client's request: clients choose their own ids, so keys carry the client."""
    return f"{identity.hex()}/{request_id}"


@dataclass
class _Client:
    identity: bytes
    last_seen: float
    requests: set[str] = field(default_factory=set)  # the client's own request ids, open ones
    prompt_tokens: int = 0  # of its open requests

    @property
    def name(self) -> str:
        return self.identity.hex()  # unique per identity: it keys the client's requests in the engine


@dataclass
class _Pending:
    """What one request owes its client: the delta being gathered (stream_interval > 1 batches them)."""

    identity: bytes
    request_id: str  # the client's id for it
    num_prompt_tokens: int
    buffer: p.RequestDelta
    num_generated: int = 0
    sent_any: bool = False

    def take(self) -> p.RequestDelta:
        out, self.buffer, self.sent_any = self.buffer, p.RequestDelta(self.request_id), True
        return out


class EngineServer:
    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig) -> None:
        self.config = server_config
        self.address = server_config.address or default_address()
        check_bind_address(self.address, server_config.auth_token)  # before the slow part: loading
        self.engine = LLMEngine(engine_config)
        files, template = tokenizer_files(Path(engine_config.tokenizer or self.engine.model_path))
        self.engine_id = secrets.token_hex(8)
        max_request_bytes = p.max_request_bytes(self.engine.max_model_len)
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
        )
        self._digest = welcome.tokenizer_digest
        self._welcome = p.encode(welcome)
        welcome.tokenizer_files = {}
        self._welcome_back = p.encode(welcome)  # for a client that has the files already
        self.clients: dict[bytes, _Client] = {}
        self.pending: dict[str, _Pending] = {}  # engine request id -> what is owed to its client
        self.dropped_clients = 0
        self._deadlines: list[tuple[float, str]] = []  # (monotonic deadline, engine request id), a heap
        self._batch: dict[bytes, list[p.RequestOutput]] = {}  # this iteration's outputs, per client
        self._stop = threading.Event()
        self.transport = Transport(self.address, max_request_bytes)
        self.address = self.transport.address

    def _send(self, identity: bytes, message: bytes | p._Message) -> None:
        self.transport.send(identity, message)

    # ---- the busy loop ---------------------------------------------------------------------------

    def serve_forever(self, ready: callable | None = None) -> None:
        """Run until SIGINT/SIGTERM; then end every open request and close cleanly. Raises
        ``EngineFailure`` if the engine cannot go on (after telling every client)."""
        self.transport.start()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: self._stop.set())
        if ready is not None:
            ready(self.address)
        next_beat = time.monotonic()
        reason = SHUTDOWN_MESSAGE
        try:
            while not self._stop.is_set():
                # 1. messages from clients; wait for one only while there is nothing to compute
                self._handle_inputs(block=not self.engine.has_unfinished())
                if self.transport.failure is not None:
                    reason = f"the engine failed: its socket thread died ({self.transport.failure!r})"
                    raise EngineFailure(reason) from self.transport.failure
                # 2. one engine step
                if self.engine.has_unfinished():
                    self._route(self.engine.step().deltas)
                # 3. heartbeats out, silent clients dropped, requests past their timeout aborted
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + self.config.heartbeat_interval
                    self._liveness(now)
                self._expire(now)
                # 4. one Outputs message per client for everything this iteration produced
                self._flush()
        except Exception as exc:
            if not isinstance(exc, EngineFailure):
                log.exception("the engine loop failed")
                reason = f"the engine failed: {type(exc).__name__}: {exc}"
            raise
        finally:
            self._shutdown(reason)

    def _handle_inputs(self, block: bool) -> None:
        inputs = self.transport.inputs
        try:
            item = inputs.get(timeout=self.config.heartbeat_interval / 2) if block else inputs.get_nowait()
        except queue.Empty:
            return
        for _ in range(_MESSAGES_PER_ITERATION):
            try:
                self._handle(*item)
            except Exception:  # a bug in handling one message must not cost every client the engine
                log.exception("handling a %s from client %s failed", type(item[1]).__name__, item[0].hex())
            try:
                item = inputs.get_nowait()
            except queue.Empty:
                return

    def _handle(self, identity: bytes, message: p.ClientMessage | object) -> None:
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
            self._add(client, message)
        elif isinstance(message, p.Abort):
            for rid in message.request_ids:  # acknowledged with the request's terminal "abort" output
                self._finish(client.identity, rid, "abort", None, notify=True)
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
            self.clients.setdefault(identity, _Client(identity, time.monotonic())).last_seen = time.monotonic()
            self.transport.register(identity)
            log.info("client %s connected (pid %d)", identity.hex(), hello.pid)
            self._send(identity, self._welcome_back if hello.tokenizer_digest == self._digest else self._welcome)
            return
        log.warning("client %s refused: %s", identity.hex(), reason)
        if identity in self.clients:
            self._drop(self.clients[identity], "was refused", notify=False)
        self._send(identity, p.Error(reason, fatal=True, code=code))

    def _add(self, client: _Client, add: p.Add) -> None:
        rid, n = add.request_id, len(add.prompt_token_ids)
        if not rid or rid in client.requests:
            reason = "request_id is empty" if not rid else f"request id {rid!r} is already in use by this client"
            self._emit(client.identity, p.RequestDelta(rid, finish_reason="error", error=reason, code="invalid"))
            return
        busy = self._busy(client, n)
        if busy is not None:
            self._emit(client.identity, p.RequestDelta(rid, finish_reason="error", error=busy, code="busy"))
            return
        engine_id = _engine_id(client.identity, rid)
        try:
            self.engine.add_request(engine_id, add.prompt_token_ids, add.params)
        except InvalidRequestError as exc:
            self._emit(client.identity, p.RequestDelta(rid, finish_reason="error", error=str(exc), code="invalid"))
            return
        except Exception as exc:  # a bug must not take the engine down with it
            log.exception("adding request %s failed", engine_id)
            error = f"internal error: {exc}"
            self._emit(client.identity, p.RequestDelta(rid, finish_reason="error", error=error, code="internal"))
            return
        client.requests.add(rid)
        client.prompt_tokens += n
        self.pending[engine_id] = _Pending(client.identity, rid, n, p.RequestDelta(rid))
        if add.timeout is not None:
            heapq.heappush(self._deadlines, (time.monotonic() + add.timeout, engine_id))

    def _busy(self, client: _Client, num_tokens: int) -> str | None:
        """Why a request of ``num_tokens`` prompt tokens cannot be queued now, or None if it can."""
        c, sched = self.config, self.engine.scheduler
        if len(sched.waiting) >= c.max_num_queued_reqs:
            return f"the engine is busy: {len(sched.waiting)} requests wait to run (--max-num-queued-reqs); retry later"
        if sched.waiting and sched.num_waiting_tokens + num_tokens > c.max_num_queued_tokens:
            return (
                f"the engine is busy: {sched.num_waiting_tokens} prompt tokens wait to run and this request "
                f"adds {num_tokens} (--max-num-queued-tokens {c.max_num_queued_tokens}); retry later"
            )
        if len(client.requests) >= c.max_client_reqs:
            return f"this client has {len(client.requests)} open requests, the most one client may (--max-client-reqs)"
        if client.requests and client.prompt_tokens + num_tokens > c.max_client_tokens:
            return (
                f"this client's open requests hold {client.prompt_tokens} prompt tokens and this one adds "
                f"{num_tokens}, more than one client may (--max-client-tokens "
                f"{c.max_client_tokens}); retry when some finish"
            )
        return None

    def _route(self, deltas: list[p.RequestDelta]) -> None:
        interval = self.config.stream_interval
        for delta in deltas:
            pend = self.pending.get(delta.request_id)
            if pend is None:
                continue
            pend.buffer.merge(delta)
            pend.num_generated += len(delta.token_ids)
            # The first delta also carries usage so far (prompt and cached tokens), for a client that
            # ends the request itself (a stop string) and so never sees the last one.
            if delta.finish_reason is not None:
                self._close(delta.request_id, pend)
            elif not pend.sent_any or len(pend.buffer.token_ids) >= interval:
                self._emit(pend.identity, pend.take())

    def _close(self, engine_id: str, pend: _Pending, reason: str | None = None, **why: str | None) -> None:
        """Send a request's last delta (``reason`` and ``why``: it ends now, as the engine did not decide)."""
        del self.pending[engine_id]
        client = self.clients.get(pend.identity)
        if client is not None:
            client.requests.discard(pend.request_id)
            client.prompt_tokens -= pend.num_prompt_tokens
        last = pend.take()
        if reason is not None:
            last.finish_reason, last.error, last.code = reason, why.get("error"), why.get("code")
        if last.usage is not None:  # what was sent, not what a step in flight may still sample
            last.usage = p.Usage(last.usage.prompt_tokens, pend.num_generated, last.usage.cached_tokens)
        self._emit(pend.identity, last)

    def _finish(
        self, identity: bytes, rid: str, reason: str, error: str | None, notify: bool, code: str | None = None
    ) -> None:
        """End one request now (abort), freeing its blocks; ``notify`` sends its terminal message."""
        engine_id = _engine_id(identity, rid)
        delta = self.engine.abort(engine_id)
        pend = self.pending.get(engine_id)
        if pend is None:
            return
        if notify:
            if delta is not None:
                pend.buffer.usage = delta.usage
            self._close(engine_id, pend, reason, error=error, code=code)
        else:
            del self.pending[engine_id]
            client = self.clients.get(identity)
            if client is not None:
                client.requests.discard(rid)
                client.prompt_tokens -= pend.num_prompt_tokens

    def _expire(self, now: float) -> None:
        """Abort the requests whose own timeout has passed."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, engine_id = heapq.heappop(self._deadlines)
            pend = self.pending.get(engine_id)
            if pend is not None:  # else it finished in time
                error = "the request's timeout passed before it finished; the engine aborted it"
                self._finish(pend.identity, pend.request_id, "error", error, notify=True, code="timeout")

    def _emit(self, identity: bytes, output: p.RequestOutput) -> None:
        self._batch.setdefault(identity, []).append(output)

    def _flush(self) -> None:
        for identity, outputs in self._batch.items():
            self._send(identity, p.Outputs(outputs))
        self._batch.clear()

    def _stats(self) -> p.Stats:
        sched = self.engine.scheduler
        return p.Stats(
            running=len(sched.running),
            waiting=len(sched.waiting),
            free_kv_blocks=self.engine.block_manager.num_free_blocks,
            total_kv_blocks=self.engine.block_manager.num_blocks,
            clients=len(self.clients),
            requests_by_client={c.name: len(c.requests) for c in self.clients.values()},
            waiting_tokens=sched.num_waiting_tokens,
            dropped_clients=self.dropped_clients,
            engine=self.engine.stats(),
        )

    def _liveness(self, now: float) -> None:
        for client in list(self.clients.values()):
            silent = now - client.last_seen
            if silent > self.config.client_timeout:
                self._drop(client, f"was silent for {silent:.1f} s (client_timeout {self.config.client_timeout:g} s)")
            else:
                self._send(client.identity, p.Heartbeat())

    def _drop(self, client: _Client, why: str, notify: bool = True) -> None:
        """Forget a client and abort its requests; ``notify`` tells it (it may still be listening)."""
        level = logging.WARNING if client.requests else logging.INFO
        log.log(level, "client %s %s: dropped, aborting its %d request(s)", client.name, why, len(client.requests))
        self.dropped_clients += why not in ("said goodbye", "was refused")
        for rid in list(client.requests):
            self._finish(client.identity, rid, "abort", None, notify=False)
        self._batch.pop(client.identity, None)
        del self.clients[client.identity]
        self.transport.unregister(client.identity)
        if notify:
            self._send(client.identity, p.Error(f"the engine dropped this client: it {why}", code="dropped"))

    def _shutdown(self, reason: str) -> None:
        log.info("shutting down: ending %d open request(s)", len(self.pending))
        for engine_id, pend in list(self.pending.items()):
            self.engine.abort(engine_id)
            self._close(engine_id, pend, "abort", error=reason, code="shutdown")
        self._flush()
        for identity in self.clients:
            self._send(identity, p.Shutdown(reason))
        self.transport.close()


_UNREGISTERED = "this connection is not registered with the engine (the engine dropped it): say hello again"
