"""The engine's address: a fresh one, which ones it may bind, and the probe that says clients can reach it.

An ipc:// address is a socket file in the user's runtime directory, named by the process and a random
token, so two engines on one machine never collide. Beyond the loopback the engine needs a shared secret.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import socket
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import zmq

from nanostream import protocol as p


def default_address() -> str:
    """A fresh ipc:// path in the user's runtime directory."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return f"ipc://{base}/nanostream-{os.getpid()}-{secrets.token_hex(4)}.sock"


def check_bind_address(address: str, auth_token: str | None) -> None:
    """Refuse to expose an engine beyond this machine without a shared secret, and an ipc path where
    another engine listens (a socket file nobody listens on is stale: it is replaced when binding)."""
    if address.startswith("ipc://"):
        path = ipc_path(address)
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


def ipc_path(address: str) -> Path | None:
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


class SelfProbe:
    """A hello this process sends to its own engine through the address clients use. When the busy loop
    reads it, a client can connect there and be heard: only then does the engine say it is ready (a
    bind alone proves less: the socket file may have moved, a listener may not be accepting yet)."""

    def __init__(self, address: str) -> None:
        self.identity = f"ready-probe-{secrets.token_hex(8)}".encode()
        self.sent = time.monotonic()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.ROUTING_ID, self.identity)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        # Queued in ZeroMQ until the connection is up, then sent: no retry of ours is needed.
        self._sock.send(p.encode(p.Hello(p.PROTOCOL_VERSION, None, os.getpid(), None)), flags=zmq.NOBLOCK)

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()
