"""Liveness between an engine's ranks: each worker beats through the store, rank 0 watches the beats.

A worker's main thread may wait in a collective for as long as rank 0 idles, so it cannot answer
anything; a thread of its own adds 1 to the worker's counter in the store every ``interval`` seconds.
Rank 0's ``Watch`` reads the counters: a worker whose counter stands still for ``timeout`` seconds is
stopped or hung, one whose process exited is dead (on this host the watch polls the processes too). The
first failure is final: ``on_failure(reason)`` runs once, on the watch's thread.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

log = logging.getLogger(__name__)

BEAT_INTERVAL = 0.25  # seconds between a worker's beats
STARTUP_TIMEOUT = 300.0
"""Seconds a worker may take to its first beat (starting Python and importing torch on a loaded host)."""


def beat_key(rank: int) -> str:
    return f"heartbeat/{rank}"


class Heartbeat:
    """A worker's beat. ``on_lost()`` runs (on the beat's thread) when the store cannot be reached or the
    process that started this one has gone: the worker must then exit, its engine is dead.

    A worker told to stop calls ``stop()`` before it returns: rank 0 closes the store as it ends, and a beat
    still inside the store's client when the interpreter finalizes would abort the process."""

    def __init__(self, store: dist.Store, rank: int, on_lost: Callable[[str], None], parent_pid: int | None) -> None:
        self._store, self._key, self._on_lost, self._parent = store, beat_key(rank), on_lost, parent_pid
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"nanostream-heartbeat-{rank}", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> bool:
        """End the beats; True once the thread has left the store (False if a beat is still stuck in it)."""
        self._stopped.set()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while not self._stopped.is_set():
            if self._parent is not None and os.getppid() != self._parent:
                self._on_lost(f"the engine process {self._parent} is gone")
                return
            try:
                self._store.add(self._key, 1)
            except Exception as exc:
                if not self._stopped.is_set():  # the store closing after a stop is the engine ending
                    self._on_lost(f"the engine's store cannot be reached ({exc})")
                return
            self._stopped.wait(BEAT_INTERVAL)


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


class Watch:
    """Rank 0's watch over ranks ``1..world_size-1``; ``processes`` are those started on this host."""

    def __init__(
        self,
        store: dist.Store,
        world_size: int,
        timeout: float,
        on_failure: Callable[[str], None],
        processes: dict[int, subprocess.Popen] | None = None,
    ) -> None:
        self._store, self._timeout, self._on_failure = store, timeout, on_failure
        self._processes = processes if processes is not None else {}  # filled in by the caller as it starts them
        now = time.monotonic()
        self._beats = {rank: (-1, now) for rank in range(1, world_size)}  # rank -> (count, when it last moved)
        self._stopped = threading.Event()
        self.failure: str | None = None
        self._thread = threading.Thread(target=self._run, name="nanostream-worker-watch", daemon=True)

    def start(self) -> Watch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def exited(self) -> str | None:
        """Which worker started on this host has exited, and how; None if none has."""
        for rank, proc in list(self._processes.items()):  # (a copy: the caller may be adding to it)
            if proc.poll() is not None:
                return f"tensor-parallel worker rank {rank} (pid {proc.pid}) {describe_exit(proc.returncode)}"
        return None

    def _check(self) -> str | None:
        """Why a worker is dead now, or None: one look at the processes and the beats."""
        exited = self.exited()
        if exited is not None:
            return exited
        now = time.monotonic()
        for rank, (count, moved) in self._beats.items():
            try:
                latest = self._store.add(beat_key(rank), 0)
            except Exception as exc:
                return f"the engine's store failed while watching its workers ({exc})"
            if latest != count:
                self._beats[rank] = (latest, now)
                continue
            limit = self._timeout if count > 0 else STARTUP_TIMEOUT
            if now - moved > limit:
                state = "stopped or hung" if count > 0 else "never started"
                return f"tensor-parallel worker rank {rank} sent no heartbeat for {now - moved:.1f} s ({state})"
        return None

    def _run(self) -> None:
        while not self._stopped.wait(BEAT_INTERVAL):
            try:
                reason = self._check()
            except Exception as exc:  # a watch that cannot look is no watch: say so rather than go blind
                reason = f"the watch over the tensor-parallel workers failed ({type(exc).__name__}: {exc})"
            if reason is not None and not self._stopped.is_set():
                self.failure = reason
                log.error("%s: the engine cannot go on", reason)
                self._on_failure(reason)
                return
