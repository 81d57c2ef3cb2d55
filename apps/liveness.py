"""How fast each side of an engine/client connection notices that the other is gone.

    python apps/liveness.py                       # tiny random model on CPU, 5 repeats of each scenario
    python apps/liveness.py --repeats 20 --heartbeat-interval 0.5 --client-timeout 3 --timeout 2

One engine (``nanostream serve``, CPU) runs with ``--heartbeat-interval`` and ``--client-timeout``;
every client has ``AsyncClient(timeout=--timeout)``. A client streams one long greedy request
(2000 tokens, ``ignore_eos``: ~16 s on two CPU cores, longer than any scenario), and at its first
chunk:

1. client SIGKILL: the client process (a child, ``liveness.py --child``) is killed; seconds until
   the engine has aborted its request (an observer client in the driver polls ``stats()`` every
   10 ms for running == 0 and one more dropped client). Bound ≈ 0: the engine sees the socket close.
2. client SIGSTOP: the child is stopped; seconds until the engine drops it, measured the same way.
   The engine counts silence from the child's last heartbeat (sent every min(heartbeat_interval,
   timeout / 4) s) and looks every heartbeat_interval: bound client_timeout - that beat to
   client_timeout + heartbeat_interval. Then SIGCONT: the child's stream must raise
   ``ConnectionLostError`` and a new request of the same client must run.
3. engine SIGSTOP: the engine is stopped under a client in the driver; seconds until that stream
   raises ``EngineDeadError``. The client counts ``timeout`` from the engine's last message, which
   came at most a heartbeat before the stop (one step while streaming): bound timeout -
   heartbeat_interval to timeout. Then SIGCONT; the same client must run a new request.
4. engine SIGKILL: a fresh engine per repeat is killed; seconds until the stream raises
   ``ConnectionLostError``. Bound ≈ 0: the client sees the socket close.

Prints min / median / max of each and exit code 0 when every measurement lies within its bound
(± ``--slack``) and every check holds, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
from anyio.streams.buffered import BufferedByteReceiveStream

from nanostream import AsyncClient
from nanostream.client.launch import EngineProcess
from nanostream.errors import ConnectionLostError, EngineDeadError

CPU_ENGINE: dict[str, Any] = dict(max_model_len=2048, kvcache_block_size=16, num_kvcache_blocks=160, device="cpu")
PROMPT = "Once upon a time"
LONG: dict[str, Any] = dict(max_tokens=2000, temperature=0, ignore_eos=True)  # ~16 s on 2 CPU cores
POLL_S = 0.01  # the observer's stats() period
REPEAT_LIMIT_S = 30.0  # a repeat that takes longer fails


@dataclass(frozen=True)
class LivenessConfig:
    """One run; these defaults are also the command line's."""

    repeats: int = field(default=5, metadata={"help": "measurements of each scenario"})
    heartbeat_interval: float = field(default=0.2, metadata={"help": "engine: seconds between heartbeats"})
    client_timeout: float = field(default=1.5, metadata={"help": "engine: a client silent this long is dropped"})
    timeout: float = field(default=1.0, metadata={"help": "client: an engine silent this long is dead"})
    slack: float = field(default=0.3, metadata={"help": "seconds a measurement may lie outside its bound"})


@dataclass
class Scenario:
    name: str
    bound: tuple[float, float]  # seconds (low, high) that every measurement should lie within
    samples: list[float] = field(default_factory=list)
    checks: dict[str, list[str]] = field(default_factory=dict)  # per check, each repeat's "ok" or what came
    problems: list[str] = field(default_factory=list)

    def check(self, what: str, ok: bool, got: str = "failed") -> None:
        self.checks.setdefault(what, []).append("ok" if ok else got)

    def inside(self, slack: float) -> int:
        lo, hi = self.bound
        return sum(lo - slack <= s <= hi + slack for s in self.samples)

    def ok(self, slack: float) -> bool:
        checked = all(set(v) == {"ok"} for v in self.checks.values())
        return self.inside(slack) == len(self.samples) and not self.problems and checked

    def row(self, slack: float) -> list[str]:
        lo, hi = self.bound
        s = self.samples or [float("nan")]
        stats = [f"{min(s):.3f}", f"{statistics.median(s):.3f}", f"{max(s):.3f}"]
        bound = "≈ 0" if hi == 0 else f"{lo:.2f} – {hi:.2f}"
        return [self.name, bound, *stats, str(len(self.samples)), f"{self.inside(slack)}/{len(self.samples)}"]


# ---- a client process (``--child``) -------------------------------------------------------------------


async def child(address: str, timeout: float) -> None:
    """Stream the long request ("streaming" on stdout at its first chunk); once it ends, print how, and
    whether a new request then ran."""
    async with AsyncClient(address, timeout=timeout) as client:
        error, streaming = "nothing (it finished)", False
        try:
            async for _ in client.stream(PROMPT, **LONG):
                if not streaming:
                    print("streaming", flush=True)
                    streaming = True
        except EngineDeadError as exc:
            error = f"{type(exc).__name__}: {exc}"
        try:
            ran = len((await client.generate(PROMPT, max_tokens=4, temperature=0)).token_ids) == 4
        except Exception:
            ran = False
        print(json.dumps(dict(error=error, ran=ran)), flush=True)


# ---- the scenarios -----------------------------------------------------------------------------------


async def until_dropped(observer: AsyncClient, dropped_before: int, t0: float) -> float:
    """Seconds from ``t0`` until the engine has dropped one more client and runs nothing."""
    while True:
        stats = await observer.stats()
        if stats.running == 0 and stats.dropped_clients > dropped_before:
            return time.monotonic() - t0
        await anyio.sleep(POLL_S)


async def client_signalled(sc: Scenario, address: str, observer: AsyncClient, cfg: LivenessConfig, sig: int) -> None:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", address, "--timeout", str(cfg.timeout)]
    async with await anyio.open_process(cmd, stdin=subprocess.DEVNULL, stderr=None) as proc:
        lines = BufferedByteReceiveStream(proc.stdout)
        try:
            if await lines.receive_until(b"\n", 1 << 16) != b"streaming":
                raise RuntimeError("the child client did not stream")
            before = (await observer.stats()).dropped_clients
            os.kill(proc.pid, sig)
            sc.samples.append(await until_dropped(observer, before, time.monotonic()))
            if sig == signal.SIGSTOP:
                os.kill(proc.pid, signal.SIGCONT)
                end = json.loads(await lines.receive_until(b"\n", 1 << 16))
                raised = end["error"].startswith("ConnectionLostError:")
                sc.check("then the child's stream raised ConnectionLostError", raised, end["error"])
                sc.check("then a new request of the child ran", end["ran"])
        finally:  # os.kill, not proc.kill(): that reaps a dead child under asyncio's watcher, which then warns
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)


async def until_engine_dead(client: AsyncClient, at_first_chunk: Callable[[], object]) -> tuple[float, EngineDeadError]:
    """Stream the long request, call ``at_first_chunk``, then return the seconds from that call until
    the stream raised ``EngineDeadError``, and the error."""
    t0 = None
    try:
        async for _ in client.stream(PROMPT, **LONG):
            if t0 is None:
                at_first_chunk()
                t0 = time.monotonic()
    except EngineDeadError as exc:
        return time.monotonic() - t0, exc
    raise RuntimeError("the long request finished under an engine that was signalled")


async def engine_stopped(sc: Scenario, engine: EngineProcess, client: AsyncClient, observer: AsyncClient) -> None:
    try:
        seconds, exc = await until_engine_dead(client, lambda: os.kill(engine.pid, signal.SIGSTOP))
    finally:
        os.kill(engine.pid, signal.SIGCONT)
    sc.samples.append(seconds)
    sc.check("the stream raised EngineDeadError (silence)", type(exc) is EngineDeadError, repr(exc))
    out = await client.generate(PROMPT, max_tokens=4, temperature=0)
    sc.check("after SIGCONT a new request of the same client ran", len(out.token_ids) == 4)
    while (stats := await observer.stats()).running or stats.waiting:  # the aborted request is gone
        await anyio.sleep(POLL_S)


async def engine_killed(sc: Scenario, options: dict[str, Any], address: str, cfg: LivenessConfig) -> None:
    engine = EngineProcess(**options, address=address)
    await anyio.to_thread.run_sync(engine.start)
    try:
        async with AsyncClient(engine.address, timeout=cfg.timeout) as client:
            seconds, exc = await until_engine_dead(client, engine.proc.kill)
        sc.samples.append(seconds)
        sc.check("the stream raised ConnectionLostError", isinstance(exc, ConnectionLostError), repr(exc))
    finally:
        await anyio.to_thread.run_sync(engine.stop)


async def repeat(sc: Scenario, n: int, once: Callable[[int], Awaitable[None]]) -> None:
    for i in range(n):
        with anyio.move_on_after(REPEAT_LIMIT_S) as scope:
            try:
                await once(i)
            except Exception as exc:  # recorded: the run fails, the other scenarios still run
                sc.problems.append(f"repeat {i + 1}: {exc!r}")
        if scope.cancelled_caught:
            sc.problems.append(f"repeat {i + 1} took over {REPEAT_LIMIT_S:g} s")


async def measure(model: str, cfg: LivenessConfig, tmp: Path) -> list[Scenario]:
    beat = min(cfg.heartbeat_interval, cfg.timeout / 4)  # the client's heartbeat period (client.py)
    ct, hb = cfg.client_timeout, cfg.heartbeat_interval
    scenarios = [
        Scenario("client SIGKILL → engine aborts", (0.0, 0.0)),
        Scenario("client SIGSTOP → engine drops", (ct - beat, ct + hb)),
        Scenario("engine SIGSTOP → EngineDeadError", (cfg.timeout - hb, cfg.timeout)),
        Scenario("engine SIGKILL → ConnectionLostError", (0.0, 0.0)),
    ]
    s1, s2, s3, s4 = scenarios
    options = dict(model=model, heartbeat_interval=hb, client_timeout=ct, **CPU_ENGINE)
    engine = EngineProcess(**options, address=f"ipc://{tmp}/engine.sock")
    await anyio.to_thread.run_sync(engine.start)
    try:
        async with (
            AsyncClient(engine.address, timeout=cfg.timeout) as observer,
            AsyncClient(engine.address, timeout=cfg.timeout) as client,
        ):
            a = engine.address
            await repeat(s1, cfg.repeats, lambda _: client_signalled(s1, a, observer, cfg, signal.SIGKILL))
            await repeat(s2, cfg.repeats, lambda _: client_signalled(s2, a, observer, cfg, signal.SIGSTOP))
            await repeat(s3, cfg.repeats, lambda _: engine_stopped(s3, engine, client, observer))
    finally:
        await anyio.to_thread.run_sync(engine.stop)
    await repeat(s4, cfg.repeats, lambda i: engine_killed(s4, options, f"ipc://{tmp}/killed-{i}.sock", cfg))
    return scenarios


def report(scenarios: list[Scenario], cfg: LivenessConfig, model: str) -> str:
    head = ["scenario", "bound expected (s)", "min", "median", "max", "n", "in bound"]
    rows = [head, *(s.row(cfg.slack) for s in scenarios)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    for s in scenarios:
        for what, seen in s.checks.items():
            lines.append(f"  {s.name}: {what}: {seen.count('ok')}/{len(seen)}")
            lines += [f"    instead: {got}" for got in dict.fromkeys(seen) if got != "ok"]
        lines += [f"  {s.name}: PROBLEM: {p}" for p in s.problems]
    lines.append(
        f"settings: model {model}, {CPU_ENGINE}; engine heartbeat_interval {cfg.heartbeat_interval:g} s, "
        f"client_timeout {cfg.client_timeout:g} s; client timeout {cfg.timeout:g} s (heartbeat every "
        f"{min(cfg.heartbeat_interval, cfg.timeout / 4):g} s); {cfg.repeats} repeats; slack {cfg.slack:g} s"
    )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    doc = __doc__.split("\n\n", 1)
    parser = argparse.ArgumentParser(
        description=doc[0], epilog=doc[1], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", metavar="DIR", help="Hugging Face model directory (default: a tiny random model)")
    for f in dataclasses.fields(LivenessConfig):
        flag, kind = "--" + f.name.replace("_", "-"), type(f.default)
        help = f"{f.metadata['help']} ({f.default})"
        parser.add_argument(flag, type=kind, default=f.default, metavar=kind.__name__.upper(), help=help)
    parser.add_argument("--child", metavar="ADDRESS", help=argparse.SUPPRESS)  # a client process (internal)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.getLogger("nanostream").setLevel(logging.CRITICAL)  # every lost connection here is on purpose
    if args.child:
        anyio.run(child, args.child, args.timeout)
        return 0
    cfg = LivenessConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(LivenessConfig)})
    with tempfile.TemporaryDirectory(prefix="nanostream-liveness-") as tmp:
        model = args.model
        if model is None:
            from nanostream.testing import make_tiny_model

            model = str(make_tiny_model(Path(tmp) / "model"))
        scenarios = anyio.run(measure, model, cfg, Path(tmp))
        print(report(scenarios, cfg, args.model or "tiny random"))
    return 0 if all(s.ok(cfg.slack) for s in scenarios) else 1


if __name__ == "__main__":
    sys.exit(main())
