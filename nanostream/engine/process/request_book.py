"""The engine process's open requests: whose each one is, what each still owes its client, the queue
limits a new one must fit, and the deadlines requests carry.

    Add ──▶ add(): limits ("busy"), LLMEngine.add_request ("invalid") ──▶ pending
    LLMEngine.step().deltas ──▶ route(): merged per stream_interval ──▶ emit() ──▶ flush(): one
    Outputs message per client per loop iteration
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from nanostream import protocol as p
from nanostream.config import ServerConfig
from nanostream.engine.llm_engine import LLMEngine
from nanostream.errors import InvalidRequestError

log = logging.getLogger(__name__)


def _engine_id(identity: bytes, request_id: str) -> str:
    """The engine's key for a client's request: clients choose their own ids, so keys carry the client."""
    return f"{identity.hex()}/{request_id}"


@dataclass
class Client:
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
    image_bytes: int = 0  # its images' pixel rows, held in the engine until it ends
    buffer: p.RequestDelta | None = None  # None: nothing gathered since the last take
    num_generated: int = 0
    sent_any: bool = False

    def gather(self, delta: p.RequestDelta) -> p.RequestDelta:
        """Take in one of the engine's deltas (the engine keeps none after its step): the first one since
        the last take becomes the buffer itself, renamed to the client's id, with nothing copied."""
        if self.buffer is None:
            delta.request_id, self.buffer = self.request_id, delta
        else:
            self.buffer.merge(delta)
        return self.buffer

    def take(self) -> p.RequestDelta:
        out, self.buffer, self.sent_any = self.buffer or p.RequestDelta(self.request_id), None, True
        return out


class RequestBook:
    def __init__(self, engine: LLMEngine, config: ServerConfig, clients: dict[bytes, Client]) -> None:
        self.engine, self.config, self.clients = engine, config, clients
        self.pending: dict[str, _Pending] = {}  # engine request id -> what is owed to its client
        self.image_bytes = 0  # the pending requests' images' pixel rows (ServerConfig.max_image_bytes)
        self._deadlines: list[tuple[float, str]] = []  # (monotonic deadline, engine request id), a heap
        self._batch: dict[bytes, list[p.RequestDelta]] = {}  # this iteration's outputs, per client
        self._produced: float | None = None  # when the step that produced them ended

    def add(self, client: Client, add: p.Add) -> None:
        rid, n, nbytes = add.request_id, len(add.prompt_token_ids), sum(len(i.pixels) for i in add.images)
        if not rid or rid in client.requests:
            reason = "request_id is empty" if not rid else f"request id {rid!r} is already in use by this client"
            self.emit(client.identity, p.RequestDelta(rid, finish_reason="error", error=reason, code="invalid"))
            return
        busy = self._busy(client, n, nbytes)
        if busy is not None:
            self.emit(client.identity, p.RequestDelta(rid, finish_reason="error", error=busy, code="busy"))
            return
        engine_id = _engine_id(client.identity, rid)
        try:
            self.engine.add_request(engine_id, add.prompt_token_ids, add.params, add.images)
        except InvalidRequestError as exc:
            self.emit(client.identity, p.RequestDelta(rid, finish_reason="error", error=str(exc), code="invalid"))
            return
        except Exception as exc:  # a bug must not take the engine down with it
            log.exception("adding request %s failed", engine_id)
            error = f"internal error: {exc}"
            self.emit(client.identity, p.RequestDelta(rid, finish_reason="error", error=error, code="internal"))
            return
        client.requests.add(rid)
        client.prompt_tokens += n
        self.pending[engine_id] = _Pending(client.identity, rid, n, nbytes)
        self.image_bytes += nbytes
        if add.timeout is not None:
            heapq.heappush(self._deadlines, (time.monotonic() + add.timeout, engine_id))

    def _busy(self, client: Client, num_tokens: int, image_bytes: int = 0) -> str | None:
        """Why a request of ``num_tokens`` prompt tokens (and ``image_bytes`` of images) cannot be queued now, or
        None if it can."""
        c, waiting, waiting_tokens = self.config, self.engine.num_waiting, self.engine.num_waiting_tokens
        if image_bytes and self.image_bytes and self.image_bytes + image_bytes > c.max_image_bytes:
            return (
                f"the engine is busy: open requests hold {self.image_bytes} bytes of images and this one adds "
                f"{image_bytes} (--max-image-bytes {c.max_image_bytes}); retry later"
            )
        if waiting >= c.max_num_queued_reqs:
            return f"the engine is busy: {waiting} requests wait to run (--max-num-queued-reqs); retry later"
        if waiting and waiting_tokens + num_tokens > c.max_num_queued_tokens:
            return (
                f"the engine is busy: {waiting_tokens} prompt tokens wait to run and this request "
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

    def route(self, deltas: list[p.RequestDelta], produced: float | None = None) -> None:
        """Take a step's deltas; ``produced`` (time.monotonic()) stamps this iteration's Outputs."""
        if produced is not None:
            self._produced = produced
        interval, pending, batch = self.config.stream_interval, self.pending, self._batch
        for delta in deltas:
            pend = pending.get(delta.request_id)
            if pend is None:
                continue
            pend.num_generated += len(delta.token_ids)
            if interval == 1 and pend.buffer is None and delta.finish_reason is None and delta.token_ids:
                # Most of a step's deltas: a token of a running request, sent as it is under the client's id.
                delta.request_id, pend.sent_any = pend.request_id, True
                outputs = batch.get(pend.identity)
                if outputs is None:
                    outputs = batch[pend.identity] = []
                outputs.append(delta)
                continue
            engine_id = delta.request_id
            gathered = pend.gather(delta)
            # The first delta also carries usage so far (prompt and cached tokens), for a client that
            # ends the request itself (a stop string) and so never sees the last one.
            if delta.finish_reason is not None:
                self.close(engine_id, pend)
            elif not pend.sent_any or len(gathered.token_ids) >= interval:
                self.emit(pend.identity, pend.take())

    def close(self, engine_id: str, pend: _Pending, reason: str | None = None, **why: str | None) -> None:
        """Send a request's last delta (``reason`` and ``why``: it ends now, as the engine did not decide)."""
        self._release(engine_id, pend)
        last = pend.take()
        if reason is not None:
            last.finish_reason, last.error, last.code = reason, why.get("error"), why.get("code")
        if last.usage is not None:  # what was sent, not what a step in flight may still sample
            last.usage = p.Usage(last.usage.prompt_tokens, pend.num_generated, last.usage.cached_tokens)
        self.emit(pend.identity, last)

    def finish(
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
                pend.gather(p.RequestDelta(pend.request_id, usage=delta.usage))
            self.close(engine_id, pend, reason, error=error, code=code)
        else:
            self._release(engine_id, pend)

    def _release(self, engine_id: str, pend: _Pending) -> None:
        """The request is no longer open: off the book and off its client's share of the limits."""
        del self.pending[engine_id]
        self.image_bytes -= pend.image_bytes
        client = self.clients.get(pend.identity)
        if client is not None:
            client.requests.discard(pend.request_id)
            client.prompt_tokens -= pend.num_prompt_tokens

    def expire(self, now: float) -> None:
        """Abort the requests whose own timeout has passed."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, engine_id = heapq.heappop(self._deadlines)
            pend = self.pending.get(engine_id)
            if pend is not None:  # else it finished in time
                error = "the request's timeout passed before it finished; the engine aborted it"
                self.finish(pend.identity, pend.request_id, "error", error, notify=True, code="timeout")

    def emit(self, identity: bytes, output: p.RequestDelta) -> None:
        self._batch.setdefault(identity, []).append(output)

    def flush(self, send) -> None:
        """One Outputs message per client for everything emitted since the last flush."""
        for identity, outputs in self._batch.items():
            send(identity, p.Outputs(outputs, self._produced))
        self._batch.clear()
        self._produced = None

    def forget_client(self, client: Client) -> None:
        """Abort a dropped client's requests; nothing more is sent to it."""
        for rid in list(client.requests):
            self.finish(client.identity, rid, "abort", None, notify=False)
        self._batch.pop(client.identity, None)

    def shutdown(self, reason: str, send: Callable) -> None:
        """End every open request with an "abort" that says why, and send it all."""
        log.info("shutting down: ending %d open request(s)", len(self.pending))
        for engine_id, pend in list(self.pending.items()):
            self.engine.abort(engine_id)
            self.close(engine_id, pend, "abort", error=reason, code="shutdown")
        self.flush(send)
