"""Start ``nanostream serve`` as a child process and wait until it accepts clients."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Any

READY = "nanostream engine ready at "
CACHE_LINE = "  cache: "
"""The engine's line before ``READY``: what its KV and state pools hold."""


class EngineProcess:
    """An engine in a child process, for programs and tests that want one of their own.

    Example::

        with EngineProcess("/models/Qwen3-0.6B", max_num_seqs=64) as engine:
            async with AsyncClient(engine.address) as client: ...

    Options are ``nanostream serve`` options (EngineConfig and ServerConfig fields) as keywords. The
    engine stops when this process exits, even by SIGKILL (``exit_with_parent``; pass False to keep it).
    """

    def __init__(self, model: str | None = None, *, startup_timeout: float = 300.0, **options: Any) -> None:
        options.setdefault("exit_with_parent", True)
        options.setdefault("register", False)  # private to this program: not for `AsyncClient()` to find
        self.cmd = [sys.executable, "-m", "nanostream", "serve"] + ([str(model)] if model else [])
        for name, value in options.items():
            flag = "--" + name.replace("_", "-")
            if value is True:
                self.cmd.append(flag)
            elif value is False:
                self.cmd.append("--no-" + name.replace("_", "-"))
            elif value is not None:
                self.cmd += [flag, str(value)]
        self.startup_timeout = startup_timeout
        self.address: str | None = None
        self.proc: subprocess.Popen | None = None
        self.log: deque[str] = deque(maxlen=200)  # the engine's last lines of output

    def start(self) -> EngineProcess:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )
        ready = threading.Event()

        def pump() -> None:
            for line in self.proc.stdout:
                self.log.append(line.rstrip())
                if line.startswith(READY) and not ready.is_set():
                    self.address = line[len(READY) :].strip()
                    ready.set()
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + self.startup_timeout
        while not ready.wait(0.1):
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the engine did not start within {self.startup_timeout} s:\n" + self.output())
        if self.address is None:
            self.proc.wait()
            raise RuntimeError(f"the engine exited with code {self.proc.returncode}:\n" + self.output())
        return self

    def output(self) -> str:
        return "\n".join(self.log)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM (clean shutdown), then SIGKILL after ``timeout``; returns the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __enter__(self) -> EngineProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
