"""``nanostream serve MODEL --openai-port PORT [--gradio-port PORT]``: an engine and its frontends as
one service.

The engine and each frontend run as child processes of this one. One Ctrl-C or SIGTERM stops them
all. A child that exits stops the others; this process then says which one and exits 1. The engine
dies with this process even if it is killed (``exit_with_parent``); the frontends find the engine
by its address.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import signal
import subprocess
import sys
import time

from nanostream.client.launch import CACHE_LINE, EngineProcess
from nanostream.config import EngineConfig

_POLL_S = 0.2


def _loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


STREAMS_PER_WORKER = 32
"""What one OpenAI server process keeps up with: it streams about 5,000 events a second (measured on an
H200 host, BENCHMARKS.md), 32 streams at the ~6 ms decode step of a small model at full batch."""


def openai_workers(value: str | None, options: dict) -> int:
    """``--openai-workers``: a number, or ``auto``: one worker per ``STREAMS_PER_WORKER`` of the engine's
    max_num_seqs, at least 1 and at most half of this machine's cores (the engine's loop and the
    HTTP clients need the rest)."""
    if value not in (None, "auto"):
        return int(value)
    max_num_seqs = options.get("max_num_seqs") or EngineConfig.max_num_seqs
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(math.ceil(max_num_seqs / STREAMS_PER_WORKER), cores // 2))


def run_service(args: argparse.Namespace, model: str | None, options: dict) -> int:
    """Start the engine (``options``: its serve options), then the frontends; supervise until one ends."""
    if not _loopback(args.host) and not args.api_key:
        print(
            f"nanostream serve: warning: serving HTTP on {args.host} with no --api-key: anyone who can reach it "
            "may use the model",
            file=sys.stderr,
        )
    stopping: list[int] = []
    previous = {sig: signal.signal(sig, lambda n, _: stopping.append(n)) for sig in (signal.SIGINT, signal.SIGTERM)}
    engine = EngineProcess(model, **{"register": True, **options})  # found by local clients unless --no-register
    children: list[tuple[str, subprocess.Popen]] = []
    try:
        try:
            engine.start()
        except (RuntimeError, TimeoutError) as exc:  # it said why; its last lines are in the message
            print(f"nanostream serve: {exc}", file=sys.stderr)
            return 1
        for line in list(engine.log):  # what its pools hold, as the engine said before it was ready
            if line.startswith(CACHE_LINE):
                print(line, flush=True)
        print(f"nanostream engine ready at {engine.address}", flush=True)
        env = dict(os.environ, NANOSTREAM_ADDRESS=engine.address)
        if options.get("auth_token"):
            env["NANOSTREAM_AUTH_TOKEN"] = options["auth_token"]
        frontends = [("openai", args.openai_port, "OpenAI API", "/v1"), ("gradio", args.gradio_port, "Gradio chat", "")]
        for name, port, what, path in frontends:
            if port is None:
                continue
            cmd = [sys.executable, "-m", "nanostream", "frontend", name, "--host", args.host, "--port", str(port)]
            workers = openai_workers(args.openai_workers, options) if name == "openai" else 1
            if name == "openai":
                cmd += ["--workers", str(workers)]
            if name == "openai" and args.api_key:
                cmd += ["--api-key", args.api_key]
            options = ("reasoning_parser", "tool_call_parser", "max_stored_responses", "max_stored_response_bytes",
                       "allowed_media_domains", "allowed_local_media_path")  # fmt: skip
            for option in options:  # checked by the frontend's own parser
                value = getattr(args, option, None)
                if name == "openai" and value is not None:
                    cmd += ["--" + option.replace("_", "-"), *map(str, value if isinstance(value, list) else [value])]
            children.append((f"the {what} frontend", subprocess.Popen(cmd, env=env)))
            processes = f" ({workers} server processes)" if workers > 1 else ""
            print(f"nanostream: {what} at http://{args.host}:{port}{path}{processes}", flush=True)
            if name == "openai":
                from nanostream.frontends.openai_server.routes import describe_routes  # (no FastAPI import)

                print(describe_routes(), flush=True)
        while not stopping:
            if engine.proc.poll() is not None:
                return _ended("the engine", engine.proc.returncode)
            for what, proc in children:
                if proc.poll() is not None:
                    return _ended(what, proc.returncode)
            time.sleep(_POLL_S)
        return 130 if stopping[0] == signal.SIGINT else 0  # Ctrl-C, as a shell counts it; SIGTERM: 0
    except KeyboardInterrupt:
        return 130
    finally:
        for _, proc in children:
            if proc.poll() is None:
                proc.terminate()
        for _, proc in children:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        engine.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _ended(what: str, code: int | None) -> int:
    how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
    print(f"nanostream serve: {what} {how}; stopping the service", file=sys.stderr)
    return 1
