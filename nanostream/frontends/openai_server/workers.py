"""``nanostream frontend openai --workers N``: N server processes accept on one listening socket.

One process streams about 5,000 server-sent events a second (a core's worth of Python per event:
the HTTP framing, the JSON, the stream's detokenizer); hundreds of concurrent streams at the
engine's pace need more. Each worker is a whole server with its own ``AsyncClient``, so the engine
sees N clients; the kernel spreads new connections over the workers. One Ctrl-C or SIGTERM stops
them all; a worker that dies stops the others, and the command exits non-zero. The Responses API's
stored responses are one store for all, in a manager process (``previous_response_id`` finds a
response whichever worker made it).
"""

from __future__ import annotations

import argparse
import errno
import multiprocessing as mp
import signal
import socket
import sys
import time
from multiprocessing.managers import BaseManager

from nanostream.frontends.openai_server.response_store import ResponseStore

NO_ENGINE = 3
"""A worker's exit code when it never served: no engine answered within ``--engine-wait``."""


def listen(host: str, port: int) -> socket.socket | None:
    """The server's listening socket; None, after one line that says what to change, if it cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        in_use = exc.errno == errno.EADDRINUSE
        why = f"port {port} is in use: pass --port" if in_use else f"cannot listen on {host}:{port}"
        print(f"nanostream frontend openai: {why} ({exc.strerror})", file=sys.stderr)
        return None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class _StoreManager(BaseManager):
    """Serves the workers' one ResponseStore from a process of its own (each call: a round trip)."""


_StoreManager.register("ResponseStore", ResponseStore)


def _worker(sock: socket.socket, args: argparse.Namespace, gave_up: mp.SimpleQueue, store: ResponseStore) -> None:
    import uvicorn

    from nanostream.frontends.openai_server import app_options, create_app

    app = create_app(args.engine, **{**app_options(args, worker=True), "response_store": store})
    server = uvicorn.Server(uvicorn.Config(app, log_level="info"))
    state = app.state.server
    state.on_give_up = lambda: setattr(server, "should_exit", True)
    server.run(sockets=[sock])
    if state.gave_up is not None:  # the parent says it, once for every worker
        gave_up.put(state.gave_up)
        sys.exit(NO_ENGINE)
    sys.exit(0 if server.started else NO_ENGINE)  # it never served (no engine answered), as uvicorn.run exits


def serve_workers(args: argparse.Namespace, sock: socket.socket) -> int:
    ctx = mp.get_context("spawn")
    gave_up = ctx.SimpleQueue()
    manager = _StoreManager(ctx=ctx)
    manager.start()
    store = manager.ResponseStore(args.max_stored_responses, args.max_stored_response_bytes)
    workers = [
        ctx.Process(target=_worker, args=(sock, args, gave_up, store), name=f"openai-worker-{i}")
        for i in range(args.workers)
    ]
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    for w in workers:
        w.start()
    print(f"nanostream frontend openai: {args.workers} workers on http://{args.host}:{args.port}", flush=True)
    try:
        while not stopping and all(w.is_alive() for w in workers):
            time.sleep(0.2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        dead = [w for w in workers if not w.is_alive()]
        for w in workers:
            if w.is_alive():
                w.terminate()  # SIGTERM: uvicorn finishes its open responses and closes its client
        for w in workers:
            w.join(30)
            if w.is_alive():
                w.kill()
        sock.close()
        manager.shutdown()
    if dead and not stopping and not gave_up.empty():  # no engine came within --engine-wait
        print(f"nanostream frontend openai: {gave_up.get()}", file=sys.stderr)
        return 1
    if dead and not stopping:
        codes = ", ".join(f"{w.name} exited with code {w.exitcode}" for w in dead)
        print(f"nanostream frontend openai: {codes}; stopped the other workers", file=sys.stderr)
        return 1
    return 0
