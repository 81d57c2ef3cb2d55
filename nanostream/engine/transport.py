"""The engine process's socket side: a ZeroMQ ROUTER served by an io thread.

    ROUTER ──▶ io thread: recv, decode ──▶ ``inputs`` queue ──▶ (the busy loop)
    ROUTER ◀── io thread: send ◀── inproc PULL ◀── PUSH ◀── ``send()``: encode; ``flush()`` ◀── (the busy loop)

Only the io thread touches the ROUTER. The busy loop encodes its outputs itself (msgspec: ~50 µs for
a step of 256 requests), while the step it has just launched runs on the device, and hands each
iteration's messages to the io thread as one inproc message: one wake of the io thread per step.
A thread of its own for encoding would wait for the GIL until the busy loop next blocks (the
device's synchronisation, up to a step later), and delay every token by that much.

No frame can stop the io thread: one that fails to decode in any way is answered with a refusal. A
peer that has not been welcomed may send a small hello and nothing else; a welcomed one frames of
up to ``max_request_bytes`` (ZeroMQ cuts off a peer that sends more). If a thread dies anyway,
``failure`` says why and the busy loop stops the engine. A peer's disconnection reaches the busy
loop as ``DISCONNECTED`` (from the ROUTER's monitor, matched to the peer by the connection's file
descriptor), so a dead client's requests are aborted at once.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import os
import queue
import secrets
import socket
import tempfile
import threading
from pathlib import Path
from urllib.parse import urlsplit

import zmq
from zmq.utils.monitor import parse_monitor_message

from nanostream import protocol as p
from nanostream.errors import ProtocolError

log = logging.getLogger(__name__)

DISCONNECTED = object()
"""Put in ``inputs`` in place of a message when a peer's connection closed."""
NOT_READING = object()
"""Put in ``inputs`` in place of a message when a peer has left its last ``_SNDHWM`` messages unread."""
_INPUT_QUEUE = 4096  # decoded messages waiting for the busy loop; past this the io thread stops reading
_RCVHWM = 1000  # frames ZeroMQ buffers per peer before it stops reading that peer's connection
_SNDHWM = 10_000  # messages (about one per step) a peer may leave unread before the engine drops it


class _Unregistered(ProtocolError):
    """A frame from a peer the engine has not welcomed (or has dropped) that is not a hello."""


def default_address() -> str:
    """A fresh ipc:// path in the user's runtime directory."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return f"ipc://{base}/nanostream-{os.getpid()}-{secrets.token_hex(4)}.sock"


def check_bind_address(address: str, auth_token: str | None) -> None:
    """Refuse to expose an engine beyond this machine without a shared secret, and an ipc path where
    another engine listens (a socket file nobody listens on is stale: it is replaced when binding)."""
    if address.startswith("ipc://"):
        path = _ipc_path(address)
        if path is not None and _listening(path):
            raise ValueError(
                f"address in use: an engine already listens at {address}; stop it or pick another --address"
            )
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


def _ipc_path(address: str) -> Path | None:
    """The socket file of an ipc:// address; None for Linux's abstract namespace (ipc://@name)."""
    rest = address[len("ipc://") :]
    return None if rest.startswith("@") else Path(rest)


def _listening(path: Path) -> bool:
    if not path.exists():
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:  # refused (nobody listens) or not a socket
            return False
    return True


class Transport:
    """Binds ``address`` (tcp port 0: any free port); ``address`` then holds the bound endpoint.

    An ipc socket file is created with mode 0600 (only this user may connect), whatever the umask.
    """

    def __init__(self, address: str, max_request_bytes: int = p.MAX_MESSAGE_BYTES) -> None:
        self.inputs: queue.Queue[tuple[bytes, object]] = queue.Queue(_INPUT_QUEUE)
        self.registered: set[bytes] = set()  # identities the busy loop welcomed (it adds and removes them)
        self.failure: BaseException | None = None  # why a thread died, if one did
        self.max_request_bytes = max_request_bytes
        self._outbox: list[bytes] = []  # identity, frame, identity, frame, ...: this iteration's messages
        self._closing = threading.Event()
        self._ctx = zmq.Context()
        self._pipe = f"inproc://nanostream-out-{secrets.token_hex(8)}"
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.MAXMSGSIZE, max_request_bytes)
        # A client's reader drains its socket at once (mailboxes merge), so one that leaves _SNDHWM
        # messages unread is stuck or hostile: the send fails (ROUTER_MANDATORY) and the engine drops it,
        # rather than hold its output without bound or lose tokens silently.
        self._router.setsockopt(zmq.SNDHWM, _SNDHWM)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.setsockopt(zmq.RCVHWM, _RCVHWM)
        self._router.setsockopt(zmq.LINGER, 2000)
        # A peer's disconnection: the monitor names the connection's fd, each frame the fd it came in on.
        self._monitor = self._router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._peers: dict[int, bytes] = {}  # fd -> identity of the last frame received on it
        try:
            self.address = self._bind(address)
        except zmq.ZMQError as exc:
            self._router.disable_monitor()
            self._monitor.close(linger=0)
            self._router.close(linger=0)
            self._ctx.term()
            hint = (
                "address in use: stop what listens there or pick another --address"
                if exc.errno == errno.EADDRINUSE
                else ""
            )
            raise ValueError(f"cannot bind {address}: {hint or exc}") from None
        pull = self._ctx.socket(zmq.PULL)
        pull.bind(self._pipe)
        self._push = self._ctx.socket(zmq.PUSH)  # the busy loop's end of the pipe
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.connect(self._pipe)
        self._threads = [
            threading.Thread(target=self._guard, args=(self._io_loop, pull), name="nanostream-io", daemon=True)
        ]

    def _bind(self, address: str) -> str:
        if address.startswith("tcp://"):
            self._router.bind(address.replace(":0", ":*"))
            return self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        path = _ipc_path(address)
        if path is None:
            self._router.bind(address)
            return address
        # Bind inside a fresh 0700 directory, make the socket 0600, then move it into place: no other
        # user can connect in between, and a stale file left by a killed engine is replaced.
        check_bind_address(address, None)
        private = Path(tempfile.mkdtemp(dir=path.parent, prefix=".ns"))  # short: ipc paths hold 107 bytes
        try:
            self._router.bind(f"ipc://{private}/s")
            os.chmod(private / "s", 0o600)
            os.replace(private / "s", path)
        finally:
            with contextlib.suppress(OSError):
                os.rmdir(private)
        return address

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def register(self, identity: bytes) -> None:
        self.registered.add(identity)

    def unregister(self, identity: bytes) -> None:
        self.registered.discard(identity)

    def send(self, identity: bytes, message: bytes | p._Message) -> None:
        """Queue a message (or pre-encoded bytes) for one client until ``flush()``; never blocks."""
        try:
            frame = message if isinstance(message, bytes) else p.encode(message)
        except Exception:  # a bug: lose this message, not the engine
            log.exception("encoding a %s for client %s failed", type(message).__name__, identity.hex())
            return
        self._outbox += (identity, frame)

    def flush(self) -> None:
        """Hand everything queued to the io thread (one inproc message); never blocks."""
        if self._outbox:
            with contextlib.suppress(zmq.Again):  # no peer: the io thread is gone, and the engine stops
                self._push.send_multipart(self._outbox, flags=zmq.NOBLOCK)
            self._outbox = []

    def close(self) -> None:
        """Send everything queued, then close the sockets and remove an ipc socket file."""
        self._closing.set()
        self.flush()
        with contextlib.suppress(zmq.Again):  # the end-of-stream marker: the io thread sends what came before
            self._push.send(b"", flags=zmq.NOBLOCK)
        self._push.close(linger=0 if self.failure is not None else -1)  # a dead io thread reads nothing
        for t in self._threads:
            t.join(timeout=5)
        self._ctx.term()
        path = _ipc_path(self.address) if self.address.startswith("ipc://") else None
        if path is not None:
            path.unlink(missing_ok=True)

    def _guard(self, loop, *args) -> None:
        """Run a thread's loop; if it dies, record why, so that the busy loop stops the engine."""
        try:
            loop(*args)
        except BaseException as exc:
            if not self._closing.is_set():
                log.critical("the engine's %s thread died", threading.current_thread().name, exc_info=True)
                self.failure = exc

    def _io_loop(self, pull: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(pull, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll())
                if self._monitor in events:  # before the frames: a new peer may reuse a closed one's fd
                    fd = parse_monitor_message(self._monitor.recv_multipart())["value"]
                    identity = self._peers.pop(fd, None)
                    if identity is not None:  # after its hello, if that is still queued: both reach the loop
                        self._put(identity, DISCONNECTED)
                if pull in events:
                    frames = pull.recv_multipart(copy=False)
                    if len(frames) == 1:  # close()'s end-of-stream marker
                        break
                    for i in range(0, len(frames), 2):
                        self._send_now(frames[i : i + 2])
                if self._router in events:
                    frames = self._router.recv_multipart(copy=False)
                    try:
                        self._receive(frames)
                    except Exception:  # a bug in handling one frame must not stop the engine hearing
                        log.exception("handling a frame failed")
        finally:
            pull.close(linger=0)
            self._router.disable_monitor()
            self._monitor.close(linger=0)
            self._router.close()

    def _receive(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        self._peers[frames[-1].get(zmq.SRCFD)] = identity
        welcomed = identity in self.registered
        try:
            if len(frames) != 2:
                raise ProtocolError(f"expected one frame per message, got {len(frames) - 1}")
            if welcomed:
                message = p.decode_client_message(frames[1].buffer, self.max_request_bytes)
            elif len(frames[1]) > p.MAX_HELLO_BYTES:
                raise _Unregistered(
                    f"this connection is not registered with the engine: its {len(frames[1])}-byte frame is "
                    "refused unread; say hello first"
                )
            else:
                message = self._decode_unwelcomed(frames[1].buffer)
        except ProtocolError as exc:
            log.warning("client %s: %s", identity.hex(), exc)
            if isinstance(exc, _Unregistered):
                refusal = p.Error(str(exc), code="unregistered")
            else:
                refusal = p.refusal(frames[-1].buffer, exc)
            self._send_now([identity, p.encode(refusal)])
            return
        self._put(identity, message)

    def _send_now(self, frames: list) -> None:
        identity = frames[0] if isinstance(frames[0], bytes) else frames[0].bytes
        try:
            self._router.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:  # the peer has not read its last _SNDHWM messages
            if identity in self.registered:
                self._put(identity, NOT_READING)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the peer is gone; what was owed to it with it
            log.debug("client %s: %s", identity.hex(), exc)

    @staticmethod
    def _decode_unwelcomed(frame: memoryview) -> p.ClientMessage:
        """A small frame from a peer that has not been welcomed: a Hello is accepted; anything else is
        answered with "unregistered" (a client the engine dropped says hello again when told so)."""
        try:
            return p.decode_hello(frame)
        except ProtocolError as exc:
            try:
                message = p.decode_client_message(frame, p.MAX_HELLO_BYTES)
            except ProtocolError:
                raise exc from None
            if isinstance(message, p.Bye):
                return message
            raise _Unregistered(
                "this connection is not registered with the engine (it never said hello, or the engine "
                "dropped it): say hello first"
            ) from None

    def _put(self, identity: bytes, message: object) -> None:
        while not self._closing.is_set():
            try:
                self.inputs.put((identity, message), timeout=0.1)
                return
            except queue.Full:  # the busy loop is behind: stop reading until it catches up
                continue
