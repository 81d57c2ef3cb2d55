"""The engine process: an ``LLMEngine`` busy loop behind a ``Transport`` (engine/transport.py).

transport.inputs ──▶ busy loop (this thread):
                       1. handle messages (hello, add, abort, stats)
                       2. engine.step()
                       3. route new tokens, one Outputs per client
                       4. heartbeats, drop silent clients
                     ──▶ transport.send() ──▶ encoder and io threads ──▶ clients
"""

from __future__ import annotations

import gc
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
from nanostream.engine.llm_engine import LLMEngine, RequestDelta
from nanostream.engine.transport import Transport, check_bind_address, default_address
from nanostream.errors import InvalidRequestError

log = logging.getLogger(__name__)

SHUTDOWN_MESSAGE = "engine shutting down"


def tokenizer_files(path: Path) -> tuple[dict[str, bytes], str | None]:
    """The tokenizer as files a client can load on its own, and its chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        files = {f.name: f.read_bytes() for f in Path(tmp).iterdir() if f.is_file()}
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
    return files, template


@dataclass
class _Client:
    identity: bytes
    last_seen: float
    requests: set[str] = field(default_factory=set)  # the client's own request ids, open ones

    @property
    def name(self) -> str:
        return self.identity.hex()  # unique per identity: it keys the client's requests in the engine


@dataclass
class _Pending:
    """Tokens of one request not yet sent (stream_interval > 1 batches them)."""

    identity: bytes
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    num_generated: int = 0
    sent_any: bool = False


class EngineServer:
    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig) -> None:
        self.config = server_config
        self.address = server_config.address or default_address()
        check_bind_address(self.address, server_config.auth_token)
        self.engine = LLMEngine(engine_config)
        files, template = tokenizer_files(Path(engine_config.tokenizer or self.engine.model_path))
        self.engine_id = secrets.token_hex(8)
        self._welcome = p.encode(
            p.Welcome(
                protocol_version=p.PROTOCOL_VERSION,
                engine_id=self.engine_id,
                model=engine_config.model,
                max_model_len=self.engine.max_model_len,
                vocab_size=self.engine.vocab_size,
                eos_token_ids=sorted(self.engine.eos_token_ids),
                tokenizer_files=files,
                chat_template=template,
                heartbeat_interval=server_config.heartbeat_interval,
                client_timeout=server_config.client_timeout,
            )
        )
        self.clients: dict[bytes, _Client] = {}
        self.pending: dict[str, _Pending] = {}  # engine request id -> what is owed to its client
        self._batch: dict[bytes, list[p.RequestOutput]] = {}  # this iteration's outputs, per client
        self._stop = threading.Event()
        self.transport = Transport(self.address)
        self.address = self.transport.address

    def _send(self, identity: bytes, message: bytes | p._Message) -> None:
        self.transport.send(identity, message)

    # ---- the busy loop ---------------------------------------------------------------------------

    def serve_forever(self, ready: callable | None = None) -> None:
        """Run until SIGINT/SIGTERM; then end every open request and close cleanly."""
        self.transport.start()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: self._stop.set())
        # Everything loaded so far (model, tokenizer: ~10^5 objects) lives for the whole run; keep
        # the collector from rescanning it, which otherwise pauses the loop for ~100 ms at a time.
        gc.collect()
        gc.freeze()
        if ready is not None:
            ready(self.address)
        next_beat = time.monotonic()
        try:
            while not self._stop.is_set():
                # 1. messages from clients; wait for one only while there is nothing to compute
                self._handle_inputs(block=not self.engine.has_unfinished())
                # 2. one engine step
                if self.engine.has_unfinished():
                    self._route(self.engine.step().deltas)
                # 3. heartbeats out, silent clients dropped
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + self.config.heartbeat_interval
                    self._liveness(now)
                # 4. one Outputs message per client for everything this iteration produced
                self._flush()
        finally:
            self._shutdown()

    def _handle_inputs(self, block: bool) -> None:
        try:
            inputs = self.transport.inputs
            item = inputs.get(timeout=self.config.heartbeat_interval / 2) if block else inputs.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self.transport.inputs.get_nowait()
            except queue.Empty:
                return

    def _handle(self, identity: bytes, message: p.ClientMessage) -> None:
        client = self.clients.get(identity)
        if isinstance(message, p.Hello):
            self._hello(identity, message)
            return
        if client is None:
            self._send(identity, p.Error("send a hello first: this connection is not registered", fatal=True))
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
            self._drop(client, "said goodbye")

    def _hello(self, identity: bytes, hello: p.Hello) -> None:
        if hello.protocol_version != p.PROTOCOL_VERSION:
            reason = (
                f"protocol version {hello.protocol_version} is not supported: this engine speaks version "
                f"{p.PROTOCOL_VERSION}; use a nanostream client of the engine's version"
            )
        elif self.config.auth_token and not hmac.compare_digest(
            (hello.auth_token or "").encode(), self.config.auth_token.encode()
        ):
            reason = "bad or missing auth token: pass the engine's --auth-token (or NANOSTREAM_AUTH_TOKEN)"
        else:
            self.clients.setdefault(identity, _Client(identity, time.monotonic())).last_seen = time.monotonic()
            log.info("client %s connected (pid %d)", identity.hex(), hello.pid)
            self._send(identity, self._welcome)
            return
        log.warning("client %s refused: %s", identity.hex(), reason)
        if identity in self.clients:
            self._drop(self.clients[identity], "was refused")
        self._send(identity, p.Error(reason, fatal=True))

    def _add(self, client: _Client, add: p.Add) -> None:
        rid = add.request_id
        if not rid or rid in client.requests:
            reason = "request_id is empty" if not rid else f"request id {rid!r} is already in use by this client"
            self._emit(client.identity, p.RequestOutput(rid, finish_reason="error", error=reason))
            return
        engine_id = f"{client.name}/{rid}"
        try:
            self.engine.add_request(engine_id, add.prompt_token_ids, add.params)
        except InvalidRequestError as exc:
            self._emit(client.identity, p.RequestOutput(rid, finish_reason="error", error=str(exc)))
            return
        except Exception as exc:  # a bug must not take the engine down with it
            log.exception("adding request %s failed", engine_id)
            self._emit(client.identity, p.RequestOutput(rid, finish_reason="error", error=f"internal error: {exc}"))
            return
        client.requests.add(rid)
        self.pending[engine_id] = _Pending(client.identity, rid)

    def _route(self, deltas: list[RequestDelta]) -> None:
        interval = self.config.stream_interval
        for delta in deltas:
            pend = self.pending.get(delta.request_id)
            if pend is None:
                continue
            pend.token_ids += delta.new_token_ids
            pend.logprobs += delta.new_logprobs
            pend.num_generated += len(delta.new_token_ids)
            if delta.finish_reason is not None:
                usage = p.Usage(delta.num_prompt_tokens, pend.num_generated, delta.num_cached_tokens)
                self._close(delta.request_id, pend, delta.finish_reason, None, usage)
            elif not pend.sent_any or len(pend.token_ids) >= interval:
                # The first output also carries usage so far (prompt and cached tokens), for a client
                # that ends the request itself (stop string) and so never sees the last one.
                usage = (
                    None
                    if pend.sent_any
                    else p.Usage(delta.num_prompt_tokens, pend.num_generated, delta.num_cached_tokens)
                )
                self._emit(pend.identity, p.RequestOutput(pend.request_id, pend.token_ids, pend.logprobs, usage=usage))
                pend.token_ids, pend.logprobs, pend.sent_any = [], [], True

    def _close(self, engine_id: str, pend: _Pending, reason: str, error: str | None, usage: p.Usage | None) -> None:
        del self.pending[engine_id]
        client = self.clients.get(pend.identity)
        if client is not None:
            client.requests.discard(pend.request_id)
        self._emit(pend.identity, p.RequestOutput(pend.request_id, pend.token_ids, pend.logprobs, reason, error, usage))

    def _finish(self, identity: bytes, rid: str, reason: str, error: str | None, notify: bool) -> None:
        """End one request now (abort), freeing its blocks; ``notify`` sends its terminal message."""
        engine_id = f"{identity.hex()}/{rid}"
        delta = self.engine.abort(engine_id)
        pend = self.pending.get(engine_id)
        if pend is None:
            return
        if notify:
            usage = p.Usage(delta.num_prompt_tokens, pend.num_generated, delta.num_cached_tokens) if delta else None
            self._close(engine_id, pend, reason, error, usage)
        else:
            del self.pending[engine_id]
            client = self.clients.get(identity)
            if client is not None:
                client.requests.discard(rid)

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
        )

    def _liveness(self, now: float) -> None:
        for client in list(self.clients.values()):
            if now - client.last_seen > self.config.client_timeout:
                self._drop(client, f"silent for {now - client.last_seen:.1f} s")
            else:
                self._send(client.identity, p.Heartbeat())

    def _drop(self, client: _Client, why: str) -> None:
        if client.requests:
            log.warning("client %s %s: aborting its %d request(s)", client.name, why, len(client.requests))
        for rid in list(client.requests):
            self._finish(client.identity, rid, "abort", None, notify=False)
        self._batch.pop(client.identity, None)
        del self.clients[client.identity]

    def _shutdown(self) -> None:
        log.info("shutting down: ending %d open request(s)", len(self.pending))
        for engine_id, pend in list(self.pending.items()):
            self.engine.abort(engine_id)
            self._close(engine_id, pend, "abort", SHUTDOWN_MESSAGE, None)
        self._flush()
        for identity in self.clients:
            self._send(identity, p.Shutdown(SHUTDOWN_MESSAGE))
        self.transport.close()
