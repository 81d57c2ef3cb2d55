"""The client's ZeroMQ DEALER socket on the asyncio event loop: frames in through the loop's reader
callback on the socket's descriptor, frames out without waiting, connection events from its monitor.

ZeroMQ's descriptor signals an edge, not a level: any call on the socket (a send, a look at its
events) may take the signal of a message that came meanwhile, so each of them reads again soon.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from nanostream import protocol as p


class Dealer:
    """One DEALER socket connected to ``address``. ``on_frame(frame, received)`` gets every frame as it
    is read (``received``: time.monotonic() then)."""

    def __init__(self, address: str, routing_id: bytes, on_frame: Callable[[bytes, float], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._on_frame = on_frame
        self._on_event: Callable[[int], None] | None = None
        self._ctx = zmq.Context()
        sock = self._sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        # Not IMMEDIATE: with it, ZeroMQ drops what the engine sent last (a shutdown's terminal outputs,
        # a request's final tokens) when the connection closes, before the reader has taken it.
        sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_MESSAGE_BYTES)
        self._monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        sock.connect(address)
        self._fd = sock.getsockopt(zmq.FD)
        self._loop.add_reader(self._fd, self._on_readable)

    def watch(self, on_event: Callable[[int], None]) -> None:
        """``on_event(event)`` for each ``zmq.EVENT_*`` of the connection from now on, starting with those so far."""
        self._on_event = on_event
        self._loop.add_reader(self._monitor.getsockopt(zmq.FD), self._on_monitor)
        self._on_monitor()

    def send(self, frame: bytes) -> bool:
        """Send without waiting; False if ZeroMQ refused the frame."""
        try:
            self._sock.send(frame, flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        self.recheck()
        return True

    def recheck(self) -> None:
        """Read what waits, soon (see the module's docstring)."""
        self._loop.call_soon(self._on_readable)

    def input_waits(self) -> bool:
        """Frames wait to be read (they will be, soon)."""
        if self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self.recheck()
            return True
        return False

    def close(self) -> None:
        self._loop.remove_reader(self._fd)
        if self._on_event is not None:
            self._loop.remove_reader(self._monitor.getsockopt(zmq.FD))
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=200)  # (ms) time for a last frame (a Bye) to go out; nothing else waits
        self._ctx.term()

    def _on_readable(self) -> None:
        """Every frame waiting is handled here and now (a step's outputs reach their mailboxes without a
        reader task to wake first)."""
        while True:
            try:  # (a look at the events costs a fifth of a read that finds nothing)
                if not self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    return
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.ZMQError:  # the socket closed meanwhile
                return
            self._on_frame(frame, time.monotonic())

    def _on_monitor(self) -> None:
        while True:
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))["event"]
            except zmq.ZMQError:  # nothing more (or closed)
                return
            self._on_event(event)
