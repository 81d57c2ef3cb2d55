"""The engine process's socket side: a ZeroMQ ROUTER served by two threads.

    ROUTER ──▶ io thread: recv, decode ──▶ ``inputs`` queue ──▶ (the busy loop)
    ROUTER ◀── io thread: send ◀── inproc PULL ◀── encoder thread: encode ◀── ``send()`` ◀── (the busy loop)

Only the io thread touches the ROUTER and only the encoder thread its PUSH end, so (de)serialisation
and socket I/O overlap the model step and the busy loop never waits on a socket.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import queue
import secrets
import tempfile
import threading
from pathlib import Path
from urllib.parse import urlsplit

import zmq

from nanostream import protocol as p
from nanostream.errors import ProtocolError

log = logging.getLogger(__name__)


def default_address() -> str:
    """A fresh ipc:// path in the user's runtime directory."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return f"ipc://{base}/nanostream-{os.getpid()}-{secrets.token_hex(4)}.sock"


def check_bind_address(address: str, auth_token: str | None) -> None:
    """Refuse to expose an engine beyond this machine without a shared secret."""
    if not address.startswith("tcp://"):
        return
    host = urlsplit(address).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not auth_token:
        raise ValueError(
            f"binding {address} exposes the engine beyond this machine; pass --auth-token (or set "
            "NANOSTREAM_AUTH_TOKEN) so that only clients holding it can connect, or bind to 127.0.0.1"
        )


class Transport:
    """Binds ``address`` (tcp port 0: any free port); ``address`` then holds the bound endpoint."""

    def __init__(self, address: str) -> None:
        self.inputs: queue.Queue[tuple[bytes, p.ClientMessage]] = queue.Queue()
        self._outputs: queue.Queue[tuple[bytes, bytes | p._Message] | None] = queue.Queue()
        self._ctx = zmq.Context()
        self._pipe = f"inproc://nanostream-out-{secrets.token_hex(8)}"
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.MAXMSGSIZE, p.MAX_MESSAGE_BYTES)
        self._router.setsockopt(zmq.SNDHWM, 0)  # never drop tokens for a slow reader; silent ones time out
        self._router.setsockopt(zmq.RCVHWM, 0)
        self._router.setsockopt(zmq.LINGER, 2000)
        self._router.bind(address.replace(":0", ":*") if address.startswith("tcp://") else address)
        self.address = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        pull = self._ctx.socket(zmq.PULL)
        pull.bind(self._pipe)
        self._threads = [
            threading.Thread(target=self._io_loop, args=(pull,), name="nanostream-io", daemon=True),
            threading.Thread(target=self._encode_loop, name="nanostream-encode", daemon=True),
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def send(self, identity: bytes, message: bytes | p._Message) -> None:
        """Queue a message (or pre-encoded bytes) for one client; never blocks."""
        self._outputs.put((identity, message))

    def close(self) -> None:
        """Send everything queued, then close the sockets and remove an ipc socket file."""
        self._outputs.put(None)
        for t in self._threads:
            t.join(timeout=5)
        self._ctx.term()
        if self.address.startswith("ipc://"):
            Path(self.address[len("ipc://") :]).unlink(missing_ok=True)

    def _io_loop(self, pull: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(pull, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll())
                if pull in events:
                    frames = pull.recv_multipart(copy=False)
                    if len(frames) == 1:  # the encoder's end-of-stream marker
                        break
                    self._router.send_multipart(frames, copy=False)
                if self._router in events:
                    frames = self._router.recv_multipart(copy=False)
                    identity = frames[0].bytes
                    try:
                        if len(frames) != 2:
                            raise ProtocolError(f"expected one frame per message, got {len(frames) - 1}")
                        message = p.decode_client_message(frames[1].buffer)
                    except ProtocolError as exc:
                        log.warning("client %s: %s", identity.hex(), exc)
                        self._router.send_multipart([identity, p.encode(p.refusal(frames[-1].bytes, exc))])
                        continue
                    self.inputs.put((identity, message))
        finally:
            pull.close(linger=0)
            self._router.close()

    def _encode_loop(self) -> None:
        push = self._ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 0)
        push.connect(self._pipe)
        while (item := self._outputs.get()) is not None:
            identity, message = item
            push.send_multipart([identity, message if isinstance(message, bytes) else p.encode(message)], copy=False)
        push.send(b"")
        push.close(linger=-1)

    def _send(self, identity: bytes, message: bytes | p._Message) -> None:
        self._outputs.put((identity, message))
