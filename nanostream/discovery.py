"""Where local clients find an engine they were given no address for.

``nanostream serve`` records its address in this user's runtime directory
(``$XDG_RUNTIME_DIR/nanostream``, else ``<tmp>/nanostream-<uid>``, mode 0700) and removes the record
when it stops. A client with no address and no ``NANOSTREAM_ADDRESS`` takes the one live engine
recorded there; with none or several it says so, naming them. A record whose process is gone (a
killed engine) is ignored and removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Record:
    address: str
    pid: int
    model: str
    path: Path


def records_dir() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return Path(runtime) / "nanostream" if runtime else Path(tempfile.gettempdir()) / f"nanostream-{os.getuid()}"


def register(address: str, model: str) -> Path:
    """Record this process's engine; returns the record's path (``unregister`` it on exit)."""
    directory = records_dir()
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / f"engine-{os.getpid()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"address": address, "pid": os.getpid(), "model": model}))
    tmp.replace(path)
    return path


def unregister(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def live_engines() -> list[Record]:
    """The recorded engines that still run, oldest record first; stale records are removed."""
    found = []
    try:
        paths = sorted(records_dir().glob("engine-*.json"), key=lambda p: p.stat().st_mtime)
    except OSError:
        return []
    for path in paths:
        try:
            data = json.loads(path.read_text())
            record = Record(str(data["address"]), int(data["pid"]), str(data.get("model", "")), path)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if _alive(record):
            found.append(record)
        else:
            unregister(path)
    return found


def discover() -> str:
    """The address of the one live local engine; ``ValueError`` saying what to do if there is none or several."""
    engines = live_engines()
    if len(engines) == 1:
        return engines[0].address
    if not engines:
        raise ValueError(
            "no engine address given and no local engine is running: start one with `nanostream serve [MODEL]`, "
            "or pass the engine's address (--engine ADDR, AsyncClient(address), or NANOSTREAM_ADDRESS)"
        )
    listed = "; ".join(f"{e.address} ({e.model}, pid {e.pid})" for e in engines)
    raise ValueError(f"{len(engines)} local engines are running, pick one with --engine ADDR: {listed}")


def reachable(address: str, timeout: float = 2.0) -> bool:
    """Whether something listens at an engine address (a connect, no hello): to say "no engine there"
    in one line before a frontend starts, rather than fail later in its startup."""
    if address.startswith("ipc://"):
        path = address[len("ipc://") :]
        family, target = socket.AF_UNIX, ("\0" + path[1:] if path.startswith("@") else path)
    else:
        host, _, port = address[len("tcp://") :].rpartition(":")
        family, target = socket.AF_INET6 if ":" in host else socket.AF_INET, (host.strip("[]"), int(port or 0))
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.settimeout(timeout)
        try:
            probe.connect(target)
        except OSError:
            return False
    return True


def _alive(record: Record) -> bool:
    try:
        os.kill(record.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process took the pid
        return False
    if record.address.startswith("ipc://") and not record.address.startswith("ipc://@"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(record.address[len("ipc://") :])
            except OSError:
                return False
    return True
