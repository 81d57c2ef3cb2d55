"""A frontend started before its engine waits for it: ``--engine-wait SECONDS``.

Supervisors (systemd, compose files, ``nanostream serve``'s own children) start services side by
side, so a frontend may come up first. It then says once what it waits for, polls the address (or,
given none, this machine's record of running engines: nanostream/discovery.py) and carries on when
an engine listens there; after ``SECONDS`` with none it gives its one-line error. ``--engine-wait 0``
fails at once. Once connected, a frontend rides out an engine's restart on its own (the client
registers again), so this is about start-up only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import anyio
import anyio.to_thread

from nanostream.client.connection import ADDRESS_ENV
from nanostream.discovery import discover, live_engines, reachable

DEFAULT_ENGINE_WAIT = 60.0
"""Seconds a frontend waits at start for its engine (vLLM's API server waits about as long for its core)."""
_POLL_S = 0.25


def add_engine_wait_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engine-wait",
        type=float,
        default=DEFAULT_ENGINE_WAIT,
        metavar="SECONDS",
        help="at start, wait this long for the engine to answer (0: fail at once; default %(default)g)",
    )


def check_engine_wait(seconds: float) -> float:
    if not 0 <= seconds < float("inf"):
        raise ValueError(f"--engine-wait must be 0 or more seconds, got {seconds!r}")
    return seconds


class EngineWait:
    """The start-up wait of one frontend process: ``find()`` the address, then ``until_reachable()`` it
    (each returns at once when the engine is there). ``prog`` starts the one line it prints while it
    waits (``announce=False``: none, as in a server's second worker). Sync callers use ``anyio.run``."""

    def __init__(
        self, engine: str | None, seconds: float, prog: str, *, announce: bool = True, start: float | None = None
    ) -> None:
        self.engine = engine or os.environ.get(ADDRESS_ENV) or None
        self.seconds = check_engine_wait(seconds)
        self.prog = prog
        # (``start``: a time.monotonic() of this machine's, shared by processes: a server's workers wait as one)
        self.deadline = (time.monotonic() if start is None else start) + self.seconds
        self._announce = announce
        self._announced = False

    async def find(self) -> str:
        """The engine's address: the one given, else the one local engine once one is recorded.
        ``ValueError`` (discovery's message: none, or several to choose from) when the wait is over."""
        if self.engine is not None:
            return self.engine
        while True:
            engines = live_engines()
            if len(engines) == 1:
                return engines[0].address
            if len(engines) > 1 or self.left() <= 0:  # several: waiting would not choose one
                return discover()  # raises, naming them (or saying there is none)
            self._say("a local engine (`nanostream serve`)")
            await self._pause()

    async def until_reachable(self, address: str) -> bool:
        """Whether an engine listens at ``address`` within what is left of the wait."""
        # (a thread: a tcp connect to a host that drops packets takes seconds)
        while not await anyio.to_thread.run_sync(reachable, address, abandon_on_cancel=True):
            if self.left() <= 0:
                return False
            self._say(f"the engine at {address}")
            await self._pause()
        return True

    def announce_if_absent(self) -> None:
        """Say now, without waiting, what is waited for if it is not there (a server with workers
        says it once, for all of them)."""
        if self.engine is None and len(live_engines()) != 1:
            self._say("a local engine (`nanostream serve`)")
        elif self.engine is not None and not reachable(self.engine):
            self._say(f"the engine at {self.engine}")

    def left(self) -> float:
        return self.deadline - time.monotonic()

    async def _pause(self) -> None:
        # What is left is read again here: the deadline may have passed since the caller's check.
        await anyio.sleep(min(_POLL_S, max(self.left(), 0.0)))

    def no_engine(self, address: str) -> str:
        within = f" within {self.seconds:g} s (--engine-wait)" if self.seconds else ""
        return f"no engine answers at {address}{within}: start one with `nanostream serve`, or pass its --engine ADDR"

    def _say(self, what: str) -> None:
        if self._announce and not self._announced:
            self._announced = True
            print(f"{self.prog}: waiting up to {self.seconds:g} s for {what}", file=sys.stderr, flush=True)
