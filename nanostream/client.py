"""``AsyncClient``: stream tokens from an engine process (``nanostream serve``) into async code.

    async with AsyncClient("ipc:///run/user/1000/nanostream-….sock") as client:
        async for chunk in client.stream("Once upon a time", max_tokens=64, temperature=0.7):
            print(chunk.text, end="", flush=True)

One DEALER socket per client and one reader task multiplex every stream: the reader only merges each
request's new tokens into that request's mailbox, so a slow consumer never blocks the engine, the
reader or other streams, and holds at most its own request's tokens. Text is decoded here, in the
client, incrementally (see ``IncrementalDetokenizer``). Leaving a stream early (break, cancel,
``aclose()``) aborts its request in the engine at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import zmq
import zmq.asyncio

from nanostream import protocol as p
from nanostream.errors import ClientClosedError, EngineDeadError, InvalidRequestError, ProtocolError
from nanostream.sampling_params import SamplingParams
from nanostream.stream import Completion, Stream, _Mailbox

log = logging.getLogger(__name__)

ADDRESS_ENV = "NANOSTREAM_ADDRESS"
AUTH_TOKEN_ENV = "NANOSTREAM_AUTH_TOKEN"
_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "nanostream" / "tokenizers"


_IMPORT_LOCK = threading.Lock()


def _load_tokenizer(files: dict[str, bytes]) -> Any:
    """Load the engine's tokenizer from its files, kept in a cache directory keyed by their content."""
    with _IMPORT_LOCK:  # transformers' lazy first import is not thread-safe (clients in several threads)
        from transformers import AutoTokenizer

    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    path = _CACHE / digest.hexdigest()[:32]
    if not path.is_dir():
        _CACHE.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=_CACHE))
        for name, data in files.items():
            (tmp / Path(name).name).write_bytes(data)
        with contextlib.suppress(OSError):  # another process got there first
            tmp.rename(path)
    return AutoTokenizer.from_pretrained(path if path.is_dir() else tmp)


class AsyncClient:
    """A connection to one engine process.

    ``address`` defaults to the ``NANOSTREAM_ADDRESS`` environment variable, ``auth_token`` to
    ``NANOSTREAM_AUTH_TOKEN``. ``timeout`` bounds connecting and how long the engine may stay
    silent before every open stream raises ``EngineDeadError``.

    Example::

        async with AsyncClient() as client:
            out = await client.generate("The capital of France is", max_tokens=8, temperature=0)
            async for chunk in client.chat([{"role": "user", "content": "Hi!"}], max_tokens=64):
                print(chunk.text, end="")
    """

    def __init__(self, address: str | None = None, *, timeout: float = 10.0, auth_token: str | None = None) -> None:
        address = address or os.environ.get(ADDRESS_ENV)
        if not address:
            raise ValueError(f"no engine address: pass AsyncClient(address) or set {ADDRESS_ENV}")
        if not address.startswith(("ipc://", "tcp://")):
            raise ValueError(f"engine address must be ipc://PATH or tcp://HOST:PORT, got {address!r}")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.address = address
        self.timeout = timeout
        self.auth_token = auth_token if auth_token is not None else os.environ.get(AUTH_TOKEN_ENV)
        self.client_id = uuid.uuid4().hex[:16]
        self._state = "new"  # new -> open -> closed
        self._mailboxes: dict[str, _Mailbox] = {}
        self._stats_waiters: list[tuple[anyio.Event, list]] = []
        self._dead: BaseException | None = None
        self._welcome: p.Welcome | None = None
        self.tokenizer: Any = None

    # ---- lifecycle -------------------------------------------------------------------------------

    async def __aenter__(self) -> AsyncClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def connect(self) -> None:
        """Say hello to the engine and start the reader. Raises EngineDeadError if nobody answers."""
        if self._state != "new":
            raise ClientClosedError(f"this AsyncClient is already {self._state}; create a new one")
        self._state = "connecting"
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.ROUTING_ID, self.client_id.encode())
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.connect(self.address)
        try:
            await self._sock.send(p.encode(p.Hello(p.PROTOCOL_VERSION, self.auth_token, os.getpid())))
            with anyio.fail_after(self.timeout):
                reply = p.decode_engine_message(await self._sock.recv())
        except TimeoutError:
            self._teardown()
            raise EngineDeadError(
                f"no engine answered at {self.address} within {self.timeout:g} s; is `nanostream serve` running there?"
            ) from None
        except BaseException:
            self._teardown()
            raise
        if isinstance(reply, p.Error) or not isinstance(reply, p.Welcome):
            self._teardown()
            raise ProtocolError(getattr(reply, "message", f"unexpected reply {type(reply).__name__} to hello"))
        self._welcome = reply
        self.tokenizer = await anyio.to_thread.run_sync(_load_tokenizer, reply.tokenizer_files)
        self._last_heard = time.monotonic()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._read_loop)
        self._tg.start_soon(self._heartbeat_loop)
        self._state = "open"

    async def close(self) -> None:
        """Abort this client's open requests and disconnect. Safe to call twice."""
        if self._state != "open":
            self._state = "closed"
            return
        self._state = "closing"
        with anyio.move_on_after(1):
            await self._sock.send(p.encode(p.Bye()))
        self._fail_all(ClientClosedError("the AsyncClient was closed"))
        self._tg.cancel_scope.cancel()
        await self._tg.__aexit__(None, None, None)
        self._teardown()

    def _teardown(self) -> None:
        self._state = "closed"
        self._sock.close(linger=0)
        self._ctx.term()

    def _check_open(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        if self._state != "open":
            raise ClientClosedError("the AsyncClient is not connected: use `async with AsyncClient(...) as client`")

    # ---- what the engine told us -----------------------------------------------------------------

    @property
    def model(self) -> str:
        self._check_open()
        return self._welcome.model

    @property
    def max_model_len(self) -> int:
        self._check_open()
        return self._welcome.max_model_len

    @property
    def chat_template(self) -> str | None:
        self._check_open()
        return self._welcome.chat_template

    @property
    def eos_token_ids(self) -> list[int]:
        self._check_open()
        return self._welcome.eos_token_ids

    # ---- background tasks ------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        try:
            while True:
                frame = await self._sock.recv()
                self._last_heard = time.monotonic()
                try:
                    message = p.decode_engine_message(frame)
                except ProtocolError as exc:
                    log.warning("ignoring a message from the engine: %s", exc)
                    continue
                if isinstance(message, p.Outputs):
                    for out in message.outputs:
                        mailbox = self._mailboxes.get(out.request_id)
                        if mailbox is not None:
                            mailbox.put(out)
                elif isinstance(message, p.Stats) and self._stats_waiters:
                    event, slot = self._stats_waiters.pop(0)
                    slot.append(message)
                    event.set()
                elif isinstance(message, p.Shutdown):
                    self._die(EngineDeadError(f"the engine at {self.address} shut down: {message.reason}"))
                    return
                elif isinstance(message, p.Error):
                    log.warning("engine error: %s", message.message)
                    if message.fatal:
                        self._die(ProtocolError(message.message))
                        return
        except Exception as exc:  # the reader must not take the caller's task group down
            if self._state == "open":
                self._die(EngineDeadError(f"lost the engine at {self.address}: {exc!r}"))

    async def _heartbeat_loop(self) -> None:
        interval = self._welcome.heartbeat_interval
        beat = p.encode(p.Heartbeat())
        while True:
            await anyio.sleep(min(interval, self.timeout / 4))
            silent = time.monotonic() - self._last_heard
            if silent > self.timeout:
                self._die(EngineDeadError(f"the engine at {self.address} sent nothing for {silent:.1f} s"))
                return
            with contextlib.suppress(zmq.ZMQError):
                self._sock.send(beat, flags=zmq.NOBLOCK)

    def _die(self, exc: BaseException) -> None:
        if self._dead is not None:  # the reader and the heartbeat can both notice; say it once
            return
        log.error("%s", exc)
        self._dead = exc
        self._fail_all(exc)

    def _fail_all(self, exc: BaseException) -> None:
        for mailbox in self._mailboxes.values():
            mailbox.fail(exc)
        self._mailboxes.clear()
        for event, _ in self._stats_waiters:
            event.set()
        self._stats_waiters.clear()

    # ---- requests --------------------------------------------------------------------------------

    def _submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> _Mailbox:
        self._check_open()
        frame = p.encode(p.Add(request_id, prompt_token_ids, params))
        if len(frame) > p.MAX_MESSAGE_BYTES:
            raise InvalidRequestError(f"the request is {len(frame)} bytes, over the {p.MAX_MESSAGE_BYTES}-byte limit")
        mailbox = self._mailboxes[request_id] = _Mailbox()
        self._sock.send(frame, flags=zmq.NOBLOCK)
        return mailbox

    def _abort(self, request_id: str) -> None:
        self._mailboxes.pop(request_id, None)
        if self._state == "open":
            with contextlib.suppress(zmq.ZMQError):
                self._sock.send(p.encode(p.Abort([request_id])), flags=zmq.NOBLOCK)

    def _params(self, sampling_params: SamplingParams | None, kwargs: dict[str, Any]) -> SamplingParams:
        if sampling_params is None:
            return SamplingParams(**kwargs)
        return dataclasses.replace(sampling_params, **kwargs) if kwargs else sampling_params

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt).input_ids
        if isinstance(prompt, (list, tuple)):
            return list(prompt)
        raise TypeError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def stream(
        self, prompt: str | list[int], sampling_params: SamplingParams | None = None, **sampling_kwargs: Any
    ) -> Stream:
        """Stream the completion of ``prompt`` (text or token ids).

        ``sampling_kwargs`` are SamplingParams fields (``max_tokens=64, temperature=0``), applied over
        ``sampling_params`` when both are given.
        """
        self._check_open()
        return Stream(self, self._prompt_ids(prompt), self._params(sampling_params, sampling_kwargs))

    def chat(
        self, messages: list[dict[str, str]], sampling_params: SamplingParams | None = None, **sampling_kwargs: Any
    ) -> Stream:
        """Stream a reply to ``messages`` ([{"role": ..., "content": ...}]) with the model's chat template.

        A model without a chat template gets a plain "role: content" transcript ending in "assistant:".
        """
        self._check_open()
        if self.tokenizer.chat_template:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        return Stream(self, ids, self._params(sampling_params, sampling_kwargs))

    async def generate(
        self, prompt: str | list[int], sampling_params: SamplingParams | None = None, **sampling_kwargs: Any
    ) -> Completion:
        """The whole completion of ``prompt``."""
        text, ids, logprobs, last = [], [], [], None
        async with self.stream(prompt, sampling_params, **sampling_kwargs) as stream:
            async for chunk in stream:
                text.append(chunk.text)
                ids += chunk.token_ids
                logprobs += chunk.logprobs or []
                last = chunk
        lps = logprobs if stream.params.logprobs is not None else None
        return Completion(stream.request_id, "".join(text), ids, last.finish_reason, last.usage, lps)

    async def stats(self) -> p.Stats:
        """The engine's counters: running and waiting requests, free KV blocks, clients."""
        self._check_open()
        event, slot = anyio.Event(), []
        self._stats_waiters.append((event, slot))
        self._sock.send(p.encode(p.GetStats()), flags=zmq.NOBLOCK)
        with anyio.fail_after(self.timeout):
            await event.wait()
        if not slot:
            raise EngineDeadError(str(self._dead or "the client was closed"))
        return slot[0]
