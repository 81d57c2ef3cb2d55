"""The wire's floor: how long a step-sized message takes from a busy-loop-style sender to an asyncio
reader in another process, with no engine and no model, three ways: ZeroMQ (ROUTER → DEALER over
ipc) read through ``zmq.asyncio``; the same sockets read in the event loop's callback on the
socket's descriptor, as ``AsyncClient`` reads them; a plain Unix socket (no I/O thread on either side).

    python3 apps/bench_wire.py --clients 4 --period-ms 5 --messages 2000

Each ``--period-ms`` the sender stamps ``time.monotonic()`` into one ``--bytes`` message per client
and sends them; each client records its reader's wake-up time minus the stamp. Printed: p50/p90/p99
per way, the first client's and the last one's (sent last) apart. First, what this machine charges
for the steps a client repeats per message and per stream: a system call, a clock read, a
non-blocking ZeroMQ read that finds nothing, an asyncio future, and one task's turn when 64 wake at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import os
import socket
import struct
import tempfile
import time
import timeit

import zmq
import zmq.asyncio
from engine_readings import ms, percentiles

STAMP = struct.Struct("<d")


async def _read_zmq(address: str, index: int, n: int, ready, results) -> None:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, b"c%d" % index)
    sock.connect(address)
    await sock.send(b"hello")
    ready.put(index)
    lags = []
    for _ in range(n):
        frame = await sock.recv()
        lags.append(time.monotonic() - STAMP.unpack_from(frame)[0])
    results.put((index, lags))
    sock.close(linger=0)
    ctx.term()


async def _read_zmq_fd(address: str, index: int, n: int, ready, results) -> None:
    """A plain ZeroMQ socket read from the event loop's own callback on its file descriptor: no
    future per message, no second pass of the loop before the reader runs."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, b"c%d" % index)
    sock.connect(address)
    sock.send(b"hello")
    ready.put(index)
    lags, done = [], asyncio.get_running_loop().create_future()

    def on_readable() -> None:
        while len(lags) < n and sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frame = sock.recv(zmq.NOBLOCK)
            lags.append(time.monotonic() - STAMP.unpack_from(frame)[0])
        if len(lags) >= n and not done.done():
            done.set_result(None)

    loop = asyncio.get_running_loop()
    loop.add_reader(sock.getsockopt(zmq.FD), on_readable)
    on_readable()  # the descriptor is edge-triggered: take what came before it was watched
    await done
    loop.remove_reader(sock.getsockopt(zmq.FD))
    results.put((index, lags))
    sock.close(linger=0)
    ctx.term()


async def _read_unix(path: str, index: int, n: int, ready, results) -> None:
    reader, writer = await asyncio.open_unix_connection(path)
    ready.put(index)
    lags = []
    for _ in range(n):
        frame = await reader.readexactly(int.from_bytes(await reader.readexactly(4), "little"))
        lags.append(time.monotonic() - STAMP.unpack_from(frame)[0])
    results.put((index, lags))
    writer.close()


def client(kind: str, where: str, index: int, n: int, ready, results) -> None:
    read = {"zmq": _read_zmq, "zmq-fd": _read_zmq_fd, "unix": _read_unix}[kind]
    asyncio.run(read(where, index, n, ready, results))


def run(kind: str, args: argparse.Namespace) -> dict[int, list[float]]:
    ctx, tmp = mp.get_context("spawn"), tempfile.mkdtemp()
    ready, results = ctx.Queue(), ctx.Queue()
    payload = os.urandom(args.bytes - STAMP.size)
    if kind.startswith("zmq"):
        zctx = zmq.Context()
        router = zctx.socket(zmq.ROUTER)
        where = f"ipc://{tmp}/wire"
        router.bind(where)
    else:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        where = f"{tmp}/wire"
        listener.bind(where)
        listener.listen()
    procs = [
        ctx.Process(target=client, args=(kind, where, i, args.messages, ready, results)) for i in range(args.clients)
    ]
    for proc in procs:
        proc.start()
    if kind.startswith("zmq"):
        peers = [router.recv_multipart()[0] for _ in procs]
        send = [lambda frame, peer=peer: router.send_multipart((peer, frame)) for peer in peers]
    else:
        conns = [listener.accept()[0] for _ in procs]
        send = [lambda frame, conn=conn: conn.sendall(len(frame).to_bytes(4, "little") + frame) for conn in conns]
    for _ in procs:
        ready.get()
    time.sleep(0.5)
    period, deadline = args.period_ms / 1e3, time.monotonic()
    for _ in range(args.messages):
        deadline += period
        while time.monotonic() < deadline:  # spin, as a busy loop that steps would
            pass
        for s in send:
            s(STAMP.pack(time.monotonic()) + payload)
    lags = dict(results.get() for _ in procs)
    for proc in procs:
        proc.join()
    if kind.startswith("zmq"):
        router.close(linger=0)
        zctx.term()
    else:
        for conn in conns:
            conn.close()
        listener.close()
    return {i: v[args.messages // 10 :] for i, v in lags.items()}  # the first tenth: warm-up


def host_costs() -> str:
    """Microseconds per call of what a client does per message and per stream, on this machine."""

    def us(stmt: str, **names) -> float:
        return 1e6 * timeit.timeit(stmt, number=20_000, globals=names) / 20_000

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)

    def nothing() -> None:
        with contextlib.suppress(zmq.Again):
            sock.recv(zmq.NOBLOCK)

    costs = {"getpid": us("getpid()", getpid=os.getpid), "monotonic": us("f()", f=time.monotonic)}
    costs["zmq recv (none)"] = us("f()", f=nothing)
    sock.close(linger=0)
    ctx.term()

    async def loop_costs() -> None:
        loop = asyncio.get_running_loop()
        costs["future"] = us("f()", f=loop.create_future)
        waiters, woke = [], []

        async def waiter() -> None:
            while True:
                waiters.append(loop.create_future())
                await waiters[-1]
                woke.append(time.perf_counter())

        tasks = [asyncio.create_task(waiter()) for _ in range(64)]
        turns = []
        for _ in range(200):
            await asyncio.sleep(0.001)
            woke.clear()
            wake, waiters[:] = list(waiters), []
            for f in wake:
                f.set_result(None)
            while len(woke) < len(tasks):
                await asyncio.sleep(0)
            turns.append((woke[-1] - woke[0]) / (len(woke) - 1))
        for task in tasks:
            task.cancel()
        costs["task turn of 64"] = 1e6 * sorted(turns)[len(turns) // 2]

    asyncio.run(loop_costs())
    return ", ".join(f"{name} {value:.2f}" for name, value in costs.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=4, help="reader processes (default: 4)")
    parser.add_argument("--period-ms", type=float, default=5.0, help="ms between sends (default: 5, a step)")
    parser.add_argument("--messages", type=int, default=2000, help="messages per client (default: 2000)")
    parser.add_argument("--bytes", type=int, default=2048, help="bytes per message (default: 2048, 64 deltas)")
    args = parser.parse_args()
    print(f"this machine, us per call: {host_costs()}")
    print(f"{args.clients} clients, a {args.bytes}-byte message each every {args.period_ms:g} ms, {args.messages} each")

    for kind in ("zmq", "zmq-fd", "unix"):
        lags = run(kind, args)
        every = [lag for v in lags.values() for lag in v]
        every, first, last = (percentiles(v) for v in (every, lags[0], lags[args.clients - 1]))
        print(f"{kind:>6}: stamp -> reader awake p50/p90/p99 ms: all {ms(every)}; first {ms(first)}; last {ms(last)}")


if __name__ == "__main__":
    main()
