"""Soak test of one engine process: client processes stream random greedy requests, leave some of
them early, one of them is SIGKILLed, and every token is checked against the offline ``LLM``.

    python apps/soak.py                                # tiny random model, 3 clients x 8 streams, 300 requests
    python apps/soak.py --requests 0 --seconds 600 --model DIR --device cuda --num-kvcache-blocks 1024

1. ``nanostream serve`` starts (short ``--client-timeout``); a warm-up batch of clients x streams
   requests runs; the engine's RSS and open file descriptors are read from /proc.
2. ``--clients`` processes (``soak.py --worker``) run ``--streams`` concurrent streams each: prompts
   of random token ids, of random words, or sharing a two-block prefix; greedy with ``ignore_eos``, so
   lengths are fixed; all drawn from ``--seed``. ``--abort-share`` of them are left after a random
   number of chunks by ``break``, by cancelling the reading task, or by ``aclose()``, in turn.
   ``--kills`` times a worker is SIGKILLed mid-stream and a fresh one takes over its remaining
   requests. Workers write a JSON line when a request starts and when it ends.
3. The engine must go idle (nothing running or waiting, every KV block free, one client: this one)
   once it has dropped the killed clients; RSS and descriptors are read again.
4. With the engine stopped, ``LLM`` generates every request offline: a completed stream's ids, text
   and finish reason must equal the offline ones, a left stream's ids and text must be prefixes.

Exit code 0 when every check passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import anyio
import msgspec

from nanostream import AsyncClient, SamplingParams, Stream, StreamChunk
from nanostream.client.launch import EngineProcess
from nanostream.options import add_engine_args, engine_kwargs

CPU_ENGINE: dict[str, Any] = dict(max_model_len=256, kvcache_block_size=16, num_kvcache_blocks=96, device="cpu")
WAYS = ("break", "cancel", "aclose")  # how a stream is left early
CHECKED = ("completed", *WAYS)  # endings whose output is compared with the offline one
BAD = ("error", "unfinished", "lost")  # endings that fail the run ("lost": a live worker never ended it)
WORDS = ["lamp", "tide", "keeper", "river", "mill", "grain", "sand", "boats", "pier", "morning", "東京", "🌊", "naïve"]
SHARED_PREFIX = 32  # tokens a third of the prompts start with: two 16-token blocks, prefix-cache hits


def _opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class SoakConfig:
    """One soak run; these defaults are also the command line's."""

    clients: int = _opt(3, "client processes at a time")
    streams: int = _opt(8, "concurrent streams in each client process")
    requests: int = _opt(300, "requests in all (0: no limit, stop after --seconds)")
    seconds: float = _opt(0.0, "stop issuing requests after this many seconds (0: no limit)")
    abort_share: float = _opt(0.2, "share of requests left early (break, cancel, aclose in turn)")
    kills: int = _opt(1, "client processes SIGKILLed mid-stream, each replaced by a fresh one")
    seed: int = _opt(0, "seed of every random choice: a seed gives the same requests")
    max_prompt: int = _opt(64, f"longest prompt in tokens (more than {SHARED_PREFIX})")
    min_tokens: int = _opt(4, "fewest tokens a request asks for")
    max_tokens: int = _opt(40, "most tokens a request asks for")
    client_timeout: float = _opt(3.0, "engine: a silent (killed) client's requests are aborted after this")
    heartbeat_interval: float = _opt(0.5, "engine: seconds between heartbeats")
    timeout: float = _opt(600.0, "fail if the clients are not done after this many seconds")
    max_rss_growth_mib: float = _opt(100.0, "fail if the engine's RSS grows more than this after warm-up")
    max_fd_growth: int = _opt(4, "fail if the engine's open descriptors grow more than this after warm-up")

    def __post_init__(self) -> None:
        if self.requests <= 0 and self.seconds <= 0:
            raise ValueError("give requests > 0 or seconds > 0 (or both), or the run never ends")
        if not 1 <= self.min_tokens <= self.max_tokens or self.max_prompt <= SHARED_PREFIX:
            raise ValueError(f"need 1 <= min_tokens <= max_tokens and max_prompt > {SHARED_PREFIX}")


# ---- a client process ------------------------------------------------------------------------------


@dataclass
class Request:
    key: str  # "slot.life.n"
    prompt: str | list[int]
    max_tokens: int
    way: str | None  # None: read to the end; else one of WAYS
    after: int  # chunks read before leaving


def plan_requests(cfg: SoakConfig, slot: int, life: int, quota: int | None, tokenizer: Any) -> Iterator[Request]:
    """One worker's requests: the same for the same seed, slot and life (replacements get fresh ones)."""
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    shared = random.Random(cfg.seed).choices(vocab, k=SHARED_PREFIX)
    rng, n, left = random.Random(f"{cfg.seed}:{slot}:{life}"), 0, 0
    while quota is None or n < quota:
        kind = rng.randrange(3)
        if kind == 0:
            prompt: str | list[int] = " ".join(rng.choices(WORDS, k=rng.randint(1, cfg.max_prompt // 4)))
        else:
            prompt = rng.choices(vocab, k=rng.randint(1, cfg.max_prompt - SHARED_PREFIX))
            prompt = shared + prompt if kind == 2 else prompt
        max_tokens, way = rng.randint(cfg.min_tokens, cfg.max_tokens), None
        if rng.random() < cfg.abort_share:
            way, left = WAYS[left % len(WAYS)], left + 1
        yield Request(f"{slot}.{life}.{n}", prompt, max_tokens, way, rng.randint(1, max(1, max_tokens // 2)))
        n += 1


@dataclass
class Received:
    ids: list[int] = field(default_factory=list)
    text: str = ""
    chunks: int = 0
    finish: str | None = None
    late: int = 0  # chunks that came after aclose(): must stay 0

    def add(self, chunk: StreamChunk) -> None:
        self.ids += chunk.token_ids
        self.text += chunk.text
        self.chunks += 1
        self.finish = chunk.finish_reason


async def consume(stream: Stream, req: Request, got: Received) -> None:
    """Read ``stream`` to its end, or leave it after ``req.after`` chunks the ``req.way`` way."""
    closed = False
    with anyio.CancelScope() as scope:
        async for chunk in stream:  # the caller holds `stream`: on break, dropping the iterator must abort
            if closed:  # after aclose() the loop must end without another chunk
                got.late += 1
                continue
            got.add(chunk)
            if got.chunks == req.after and req.way == "break":
                break
            if got.chunks == req.after and req.way == "cancel":
                scope.cancel()  # lands where the loop next waits for tokens
            if got.chunks == req.after and req.way == "aclose":
                await stream.aclose()
                closed = True


def emit(out: TextIO, **record: Any) -> None:
    out.write(json.dumps(record, ensure_ascii=False) + "\n")
    out.flush()  # what a SIGKILL leaves behind is readable up to its last whole line


async def run_one(client: AsyncClient, req: Request, out: TextIO) -> bool:
    """Stream one request and record how it ended; False if it ended in an error."""
    got, record = Received(), dict(key=req.key, prompt=req.prompt, max_tokens=req.max_tokens)
    try:
        stream = client.stream(req.prompt, max_tokens=req.max_tokens, temperature=0, ignore_eos=True)
        emit(out, ev="start", **dict(record, prompt=stream.prompt_token_ids))
        await consume(stream, req, got)
        record.update(how="completed" if got.finish is not None else req.way or "unfinished", error=None)
    except Exception as exc:  # recorded: the driver fails the run
        record.update(how="error", error=repr(exc))
    emit(out, ev="end", **record, ids=got.ids, text=got.text, finish=got.finish, late=got.late)
    return record["how"] != "error"


async def worker(job: dict[str, Any]) -> None:
    cfg, deadline = SoakConfig(**job["config"]), job["deadline"]
    async with AsyncClient(job["address"], timeout=30) as client:
        plan = plan_requests(cfg, job["slot"], job["life"], job["quota"], client.tokenizer)
        with open(job["out"], "a", encoding="utf-8") as out:

            async def lane() -> None:  # one stream at a time; every lane takes from the one plan
                for req in plan:
                    if deadline and time.time() > deadline:
                        return
                    if not await run_one(client, req, out):
                        return  # the client is likely dead: one error per lane is enough

            async with anyio.create_task_group() as tg:
                for _ in range(cfg.streams):
                    tg.start_soon(lane)


# ---- the driver ------------------------------------------------------------------------------------


@dataclass
class Worker:
    slot: int
    life: int  # 0 for a slot's first process, +1 for each replacement
    quota: int | None  # requests it is to make; None: until the deadline
    out: Path  # its JSON lines
    proc: subprocess.Popen
    killed: bool = False
    lines: Counter = field(default_factory=Counter)  # "start" and "end" lines read so far
    _read: int = 0

    def progress(self) -> Counter:
        with open(self.out, "rb") as f:
            f.seek(self._read)
            data = f.read()
        whole = data[: data.rfind(b"\n") + 1]  # a line being written is read next time
        self._read += len(whole)
        self.lines.update(json.loads(line)["ev"] for line in whole.split(b"\n") if line)
        return self.lines


async def run_clients(address: str, cfg: SoakConfig, tmp: Path, everyone: list[Worker]) -> None:
    """Run the worker processes to the end, killing and replacing ``cfg.kills`` of them on the way."""
    deadline, n = time.time() + cfg.seconds if cfg.seconds else 0.0, cfg.requests

    def spawn(slot: int, life: int, quota: int | None) -> Worker:
        out = tmp / f"worker-{slot}-{life}.jsonl"
        out.touch()
        job = dict(address=address, config=dataclasses.asdict(cfg), slot=slot, life=life, quota=quota)
        job.update(deadline=deadline, out=str(out))
        with open(out.with_suffix(".err"), "w") as err:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(job)]
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
        everyone.append(Worker(slot, life, quota, out, proc))
        return everyone[-1]

    live = [spawn(i, 0, n // cfg.clients + (i < n % cfg.clients) if n else None) for i in range(cfg.clients)]
    start, kills = time.monotonic(), 0
    while any(w.proc.poll() is None for w in live):
        started = sum(w.progress()["start"] for w in everyone)
        done = max(started / n if n else 0.0, (time.monotonic() - start) / cfg.seconds if cfg.seconds else 0.0)
        victim = live[kills % cfg.clients]
        if kills < cfg.kills and done >= (kills + 1) / (cfg.kills + 1):
            if victim.proc.poll() is None and victim.lines["start"] > victim.lines["end"]:  # mid-stream
                victim.proc.kill()
                victim.proc.wait()
                victim.killed = True
                left = None if victim.quota is None else victim.quota - victim.progress()["start"]
                if left != 0:
                    live[victim.slot] = spawn(victim.slot, victim.life + 1, left)
            if victim.killed or victim.proc.poll() is not None:  # killed, or done before its turn
                kills += 1
        await anyio.sleep(0.05)


def engine_usage(pid: int) -> tuple[float, int]:
    """(VmRSS in MiB, open file descriptors) of a process."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    return rss_kib / 1024, len(os.listdir(f"/proc/{pid}/fd"))


@dataclass
class SoakReport:
    config: SoakConfig
    records: list[dict[str, Any]] = field(default_factory=list)  # one per request, as the workers wrote them
    mismatches: list[str] = field(default_factory=list)  # outputs that differ from the offline ones
    failures: list[str] = field(default_factory=list)  # workers that failed, a timeout
    elapsed_s: float = 0.0  # from the first worker's start to the last one's exit
    idle_after_s: float | None = None  # from then until the engine was idle; None: it never was
    final_stats: dict[str, Any] = field(default_factory=dict)
    rss_mib: tuple[float, float] = (0.0, 0.0)  # after warm-up, at the end
    fds: tuple[int, int] = (0, 0)
    engine_log: list[str] = field(default_factory=list)  # the engine's last lines of output

    @property
    def ended(self) -> Counter:
        return Counter(r["how"] for r in self.records)

    @property
    def tokens(self) -> int:
        return sum(len(r.get("ids", ())) for r in self.records)

    def problems(self) -> list[str]:
        bad = [
            f"{n} request(s) ended {how}: {', '.join(sorted(r['key'] for r in self.records if r['how'] == how)[:5])}"
            for how, n in self.ended.items()
            if how in BAD
        ]
        bad += sorted({f"error: {r['error']}" for r in self.records if r.get("error")})[:3]
        bad += self.failures + self.mismatches[:10]
        if self.idle_after_s is None:
            bad.append(f"the engine did not go idle: {self.final_stats}")
        if self.rss_mib[1] - self.rss_mib[0] > self.config.max_rss_growth_mib:
            bad.append(f"the engine's RSS grew from {self.rss_mib[0]:.1f} to {self.rss_mib[1]:.1f} MiB")
        if self.fds[1] - self.fds[0] > self.config.max_fd_growth:
            bad.append(f"the engine's open file descriptors grew from {self.fds[0]} to {self.fds[1]}")
        return bad

    @property
    def ok(self) -> bool:
        return not self.problems()

    def summary(self) -> str:
        e, s = self.ended, self.final_stats
        idle = "never" if self.idle_after_s is None else f"{self.idle_after_s:.1f} s after the last client"
        rate = self.tokens / max(self.elapsed_s, 1e-9)
        lines = [
            f"requests     {len(self.records)}: completed {e['completed']}, left early by break {e['break']} / "
            f"cancel {e['cancel']} / aclose {e['aclose']}, killed {e['killed']}, errors {e['error']}",
            f"tokens       {self.tokens} received in {self.elapsed_s:.1f} s ({rate:.0f} tok/s)",
            f"mismatches   {len(self.mismatches)} against offline greedy",
            f"engine       running {s.get('running')}, waiting {s.get('waiting')}, KV blocks free "
            f"{s.get('free_kv_blocks')}/{s.get('total_kv_blocks')}, clients {s.get('clients')}; idle {idle}",
            f"engine RSS   {self.rss_mib[0]:.1f} -> {self.rss_mib[1]:.1f} MiB, fds {self.fds[0]} -> {self.fds[1]}",
        ]
        return "\n".join(lines + ([f"FAIL  {p}" for p in self.problems()] or ["PASS"]))


async def wait_idle(client: AsyncClient, within: float) -> tuple[float | None, dict[str, Any]]:
    """Seconds until the engine runs nothing, holds no KV block and serves only ``client``; its stats."""
    start = time.monotonic()
    while True:
        stats = msgspec.structs.asdict(await client.stats())
        idle = stats["running"] == stats["waiting"] == 0 and stats["clients"] == 1
        if idle and stats["free_kv_blocks"] == stats["total_kv_blocks"]:
            return time.monotonic() - start, stats
        if time.monotonic() - start > within:
            return None, stats
        await anyio.sleep(0.05)


async def drive(engine: EngineProcess, report: SoakReport, tmp: Path, workers: list[Worker]) -> None:
    cfg = report.config
    async with AsyncClient(engine.address, timeout=30) as observer:
        warm = functools.partial(observer.generate, max_tokens=cfg.max_tokens, temperature=0, ignore_eos=True)
        async with anyio.create_task_group() as tg:  # the largest batch the clients will make
            for i in range(cfg.clients * cfg.streams):
                tg.start_soon(warm, [3 + i % 50] * cfg.max_prompt)
        before, start = engine_usage(engine.pid), time.monotonic()
        with anyio.move_on_after(cfg.timeout) as scope:
            await run_clients(engine.address, cfg, tmp, workers)
        if scope.cancelled_caught:
            report.failures.append(f"the clients were not done within {cfg.timeout:g} s")
        report.elapsed_s = time.monotonic() - start
        report.idle_after_s, report.final_stats = await wait_idle(observer, cfg.client_timeout + 5.0)
        after = engine_usage(engine.pid)
    report.rss_mib, report.fds = (before[0], after[0]), (before[1], after[1])


def load_records(workers: list[Worker]) -> list[dict[str, Any]]:
    records: dict[str, dict[str, Any]] = {}
    for w in workers:
        # split("\n"), not splitlines(): a text may hold U+2028, U+0085 and other line breaks of its own
        for line in filter(None, w.out.read_text(encoding="utf-8").split("\n")):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # the line a SIGKILL cut short
                continue
            if rec.pop("ev") == "start":
                rec["how"] = "killed" if w.killed else "lost"
            records.setdefault(rec["key"], {}).update(rec)
    return list(records.values())


def compare_offline(model: str, engine_options: dict[str, Any], records: list[dict[str, Any]]) -> list[str]:
    """Whole outputs of completed streams and prefixes of left ones that differ from offline greedy's."""
    from nanostream import LLM

    todo = [r for r in records if r["how"] in CHECKED]
    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in todo]
    refs = LLM(model, **engine_options).generate([r["prompt"] for r in todo], params, use_tqdm=False)
    bad = []
    for r, ref in zip(todo, refs):
        if r["how"] == "completed":
            same = (r["ids"], r["text"], r["finish"]) == (ref.token_ids, ref.text, ref.finish_reason)
        else:
            same = ref.token_ids[: len(r["ids"])] == r["ids"] and ref.text.startswith(r["text"]) and not r["late"]
        if not same:
            bad.append(f"{r['key']} {r['how']}: got {r['ids']} {r['text']!r}, offline {ref.token_ids} {ref.text!r}")
    return bad


def run_soak(model: str | None, cfg: SoakConfig, engine_options: dict[str, Any] | None = None) -> SoakReport:
    """One soak run (see the module's docstring) on ``model`` (None: a tiny random model)."""
    options, report = {**CPU_ENGINE, **(engine_options or {})}, SoakReport(cfg)
    with tempfile.TemporaryDirectory(prefix="nanostream-soak-") as tmp_dir:
        tmp, workers = Path(tmp_dir), []
        if model is None:
            from nanostream.testing import make_tiny_model

            model = str(make_tiny_model(tmp / "model"))
        server = dict(client_timeout=cfg.client_timeout, heartbeat_interval=cfg.heartbeat_interval)
        with EngineProcess(model, **server, **options) as engine:
            try:
                anyio.run(drive, engine, report, tmp, workers)
            finally:
                for w in workers:
                    w.proc.kill()
                    w.proc.wait()
                report.engine_log = list(engine.log)
        for w in workers:
            if not w.killed and w.proc.returncode != 0:
                err = w.out.with_suffix(".err").read_text().strip().splitlines()[-1:]
                report.failures.append(f"worker {w.slot}.{w.life} exited with code {w.proc.returncode}: {err}")
        report.records = load_records(workers)
        report.mismatches = compare_offline(model, options, report.records)
    return report


def _flag(group: Any, name: str, default: Any, help: str) -> None:  # an argparse argument group
    kind = type(default)
    flag, metavar = "--" + name.replace("_", "-"), kind.__name__.upper()
    group.add_argument(flag, type=kind, default=default, metavar=metavar, help=f"{help} ({default})")


def build_parser() -> argparse.ArgumentParser:
    doc = __doc__.split("\n\n", 1)
    parser = argparse.ArgumentParser(
        description=doc[0], epilog=doc[1], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", metavar="DIR", help="Hugging Face model directory (default: a tiny random model)")
    soak = parser.add_argument_group("soak options")
    for f in dataclasses.fields(SoakConfig):
        _flag(soak, f.name, f.default, f.metadata["help"])
    add_engine_args(parser, skip=("seed", *CPU_ENGINE))
    cpu = parser.add_argument_group("engine options with soak defaults")
    for name, default in CPU_ENGINE.items():
        _flag(cpu, name, default, "soak default")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # a client process's job, as JSON (internal)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        anyio.run(worker, json.loads(args.worker))
        return 0
    cfg = SoakConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SoakConfig)})
    report = run_soak(args.model, cfg, {k: v for k, v in engine_kwargs(args).items() if k != "seed"})
    print(report.summary())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
