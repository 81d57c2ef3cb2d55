"""The engine process's socket side: a ZeroMQ ROUTER that the busy loop itself reads and writes.

    ROUTER ──▶ ``receive()``: recv, decode ──▶ (the busy loop handles each message)
    ROUTER ◀── ``flush()``: one send per queued message ◀── ``send()``: encode ◀── (the busy loop)

No thread of its own: a step's outputs leave in the busy loop's ``flush()``, microseconds after the
step's tokens are read, and nothing in this process competes with the busy loop for the GIL. (An io
thread did: it needed the GIL to forward each step's outputs, waited for it while the busy loop
scheduled and launched the next step, and the forced switches slowed the loop's host work.) ZeroMQ's
own I/O thread, which holds no GIL, moves the bytes; the busy loop reads what arrived between steps,
at most ``limit`` frames at a time, and a peer that sends faster meets ZeroMQ's receive high-water
mark, then TCP's flow control.

No frame can stop the engine: one that fails to decode in any way is answered with a refusal. A
peer that has not been welcomed may send a small hello and nothing else; a welcomed one frames of
up to ``max_request_bytes`` (ZeroMQ cuts off a peer that sends more). A peer's disconnection reaches
the busy loop as ``DISCONNECTED`` (from the ROUTER's monitor, matched to the peer by the connection's
file descriptor), so a dead client's requests are aborted at once.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import tempfile
from pathlib import Path

import zmq
from zmq.utils.monitor import parse_monitor_message

from nanostream import protocol as p
from nanostream.engine.process.address import check_bind_address, ipc_path
from nanostream.errors import ProtocolError

log = logging.getLogger(__name__)

DISCONNECTED = object()
"""Returned by ``receive()`` in place of a message when a peer's connection closed."""
NOT_READING = object()
"""Returned by ``receive()`` in place of a message when a peer has left its last ``_SNDHWM`` messages unread."""
_RCVHWM = 1000  # frames ZeroMQ buffers per peer before it stops reading that peer's connection
_SNDHWM = 10_000  # messages (about one per step) a peer may leave unread before the engine drops it


class _Unregistered(ProtocolError):
    """A frame from a peer the engine has not welcomed (or has dropped) that is not a hello."""


class Transport:
    """Binds ``address`` (tcp port 0: any free port); ``address`` then holds the bound endpoint.

    An ipc socket file is created with mode 0600 (only this user may connect), whatever the umask.
    """

    def __init__(self, address: str, max_request_bytes: int = p.MAX_MESSAGE_BYTES) -> None:
        self.registered: set[bytes] = set()  # identities the busy loop welcomed (it adds and removes them)
        self.max_request_bytes = max_request_bytes
        self._socket_inode: int | None = None  # an ipc socket file's, to remove only our own at close
        self._outbox: list[tuple[bytes, bytes]] = []  # (identity, frame): this iteration's messages
        self._notices: list[tuple[bytes, object]] = []  # NOT_READING found while sending: the next receive()'s
        self._ctx = zmq.Context()
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
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        try:
            self.address = self._bind(address)
        except zmq.ZMQError as exc:
            self._close_sockets(linger=0)
            hint = (
                "address in use: stop what listens there or pick another --address"
                if exc.errno == errno.EADDRINUSE
                else ""
            )
            raise ValueError(f"cannot bind {address}: {hint or exc}") from None

    def _bind(self, address: str) -> str:
        if address.startswith("tcp://"):
            self._router.bind(address.replace(":0", ":*"))
            return self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        path = ipc_path(address)
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
            self._socket_inode = os.stat(private / "s").st_ino
            os.replace(private / "s", path)
        finally:
            with contextlib.suppress(OSError):
                os.rmdir(private)
        return address

    def register(self, identity: bytes) -> None:
        self.registered.add(identity)

    def unregister(self, identity: bytes) -> None:
        self.registered.discard(identity)

    def receive(self, timeout: float, limit: int, prompt_tokens: int) -> list[tuple[bytes, object]]:
        """What peers sent, decoded: (identity, message), or ``DISCONNECTED``/``NOT_READING`` in place of
        a message. Waits up to ``timeout`` seconds for something to arrive (0: only what is there), and
        returns at most about ``limit`` items, and Adds of about ``prompt_tokens`` prompt tokens at most
        (the one that reaches it is the last); the rest stay queued in ZeroMQ for the next call. A frame
        that does not decode is answered with a refusal here and not returned."""
        received, self._notices = self._notices, []
        tokens = 0
        ready = dict(self._poller.poll(0 if received else timeout * 1e3))
        if self._monitor in ready:  # before the frames: a new peer may reuse a closed one's fd
            while True:
                try:
                    event = self._monitor.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                identity = self._peers.pop(parse_monitor_message(event)["value"], None)
                if identity is not None:  # a hello still queued in ZeroMQ arrives after it: the client
                    received.append((identity, DISCONNECTED))  # is then dropped when its silence is seen
        while self._router in ready and len(received) < limit and tokens < prompt_tokens:
            try:
                frames = self._router.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            try:
                message = self._receive(frames)
            except Exception:  # a bug in handling one frame must not stop the engine hearing
                log.exception("handling a frame failed")
                continue
            if message is not None:
                received.append((frames[0].bytes, message))
                if type(message) is p.Add:
                    tokens += len(message.prompt_token_ids)
        return received

    def send(self, identity: bytes, message: bytes | p._Message) -> None:
        """Queue a message (or pre-encoded bytes) for one client until ``flush()``; never blocks."""
        try:
            frame = message if isinstance(message, bytes) else p.encode(message)
        except Exception:  # a bug: lose this message, not the engine
            log.exception("encoding a %s for client %s failed", type(message).__name__, identity.hex())
            return
        self._outbox.append((identity, frame))

    def flush(self) -> None:
        """Send everything queued; never blocks. A peer that has left its last ``_SNDHWM`` messages unread
        comes back from the next ``receive()`` as ``NOT_READING``."""
        outbox, self._outbox = self._outbox, []
        for identity, frame in outbox:
            self._send_now(identity, frame)

    def close(self) -> None:
        """Send everything queued, then close the sockets (ZeroMQ gets up to 2 s to deliver what was sent)
        and remove an ipc socket file."""
        self.flush()
        self._close_sockets(linger=None)
        path = ipc_path(self.address) if self.address.startswith("ipc://") else None
        # Only the file this engine made: a new engine at the same address may have bound while this
        # one's sockets lingered, and removing its file would leave it unreachable.
        with contextlib.suppress(OSError):
            if path is not None and os.stat(path).st_ino == self._socket_inode:
                path.unlink()

    def _close_sockets(self, linger: int | None) -> None:
        self._router.disable_monitor()
        self._monitor.close(linger=0)
        self._router.close(linger=linger)
        self._ctx.term()

    def _receive(self, frames: list[zmq.Frame]) -> object | None:
        """A frame's message, or None when it was refused (the refusal is sent)."""
        identity = frames[0].bytes
        self._peers[frames[-1].get(zmq.SRCFD)] = identity
        welcomed = identity in self.registered
        try:
            if len(frames) != 2:
                raise ProtocolError(f"expected one frame per message, got {len(frames) - 1}")
            if welcomed:
                return p.decode_client_message(frames[1].buffer, self.max_request_bytes)
            if len(frames[1]) > p.MAX_HELLO_BYTES:
                raise _Unregistered(
                    f"this connection is not registered with the engine: its {len(frames[1])}-byte frame is "
                    "refused unread; say hello first"
                )
            return self._decode_unwelcomed(frames[1].buffer)
        except ProtocolError as exc:
            log.warning("client %s: %s", identity.hex(), exc)
            if isinstance(exc, _Unregistered):
                refusal = p.Error(str(exc), code="unregistered")
            else:
                refusal = p.refusal(frames[-1].buffer, exc)
            self._send_now(identity, p.encode(refusal))
            return None

    def _send_now(self, identity: bytes, frame: bytes) -> None:
        try:
            self._router.send_multipart((identity, frame), copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:  # the peer has not read its last _SNDHWM messages
            if identity in self.registered:
                self._notices.append((identity, NOT_READING))
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
