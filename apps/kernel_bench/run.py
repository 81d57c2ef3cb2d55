"""The run: the report being built, which units (one case, one engine) are done, and recovery.

A sticky CUDA error ends this process's work; ``Run.respawn`` continues in a fresh process of the
entry script, skipping the units done here (the one that crashed too), and merges its report.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from presets import QWEN3_0_6B, random_model

from kernel_bench.harness import ContextLost, Unavailable, check_alive_after, free_cuda, l2_bytes, short
from kernel_bench.peaks import measure_ceilings

MAX_RESPAWNS = 4


class Run:
    """The report being built, and which units (one case, one engine) are done."""

    def __init__(self, args: argparse.Namespace, script: Path) -> None:
        self.args = args
        self.script = script  # the entry point that a fresh process runs
        self.report: dict[str, Any] = {
            "argv": sys.argv[1:],
            "env": {},
            "ceilings": json.loads(args.ceilings_json) if args.ceilings_json else {},
            "store_kv": [],
            "attention": [],
            "steps": [],
            "prefill": [],
            "moe": [],
            "errors": {},
            "skipped": {},
            "notes": [],
        }
        self.done: list[str] = []
        self.skip = set(json.loads(args.skip_units)) if args.skip_units else set()
        self._model: Path | None = None
        self.start = time.monotonic()

    def unit(self, uid: str, fn: Callable[[], None]) -> None:
        """Run one unit of work; its error is recorded and the next unit runs (unless CUDA is lost)."""
        if uid in self.skip or (self.args.only and not re.search(self.args.only, uid)):
            return
        if self.remaining() <= 0:
            print(f"-- {uid}: skipped, over the --budget of {self.args.budget:.0f} s")
            self.report["skipped"][uid] = "over the time budget"
            return
        print(f"-- {uid}", flush=True)
        t = time.perf_counter()
        try:
            fn()
        except ContextLost:
            self.report["errors"].setdefault(uid, "CUDA context lost")
            raise
        except Unavailable as exc:
            print(f"   skipped: {exc}")
            self.report["skipped"][uid] = str(exc)
        except Exception as exc:
            traceback.print_exc()
            self.report["errors"][uid] = short(exc)
            check_alive_after(exc)
        finally:
            self.done.append(uid)
            free_cuda()
            self.save()
            print(f"   ({time.perf_counter() - t:.1f} s)", flush=True)

    def remaining(self) -> float:
        return self.args.budget - (time.monotonic() - self.start)

    def ceilings(self) -> dict | None:
        """The measured ceilings, measuring them now if no earlier section did; None if that fails."""
        if not self.report["ceilings"]:
            try:
                self.report["ceilings"] = measure_ceilings(self.args.quick)
            except Exception as exc:
                self.report["errors"]["ceilings"] = short(exc)
                check_alive_after(exc)
                return None
        return self.report["ceilings"]

    def model_path(self) -> Path:
        """The Qwen3-0.6B-shaped random model in --build-dir, built on first use (as by apps/bench.py --preset)."""
        if self._model is None:
            with random_model(QWEN3_0_6B, {}, self.args.build_dir) as path:  # a build dir is kept on exit
                self._model = path
        return self._model

    def save(self) -> None:
        if self.args.out:
            out = Path(self.args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(self.report, indent=1, default=str))

    def respawn(self, sections: list[str]) -> None:
        """Run ``sections`` in a fresh process, skipping the units done here (the crashed one too); merge."""
        if self.args.depth >= MAX_RESPAWNS:
            self.report["notes"].append(f"CUDA context lost; {MAX_RESPAWNS} fresh processes already: stopping")
            return
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "report.json"
            a = self.args
            cmd = [sys.executable, str(self.script), "--sections", ",".join(sections)]
            cmd += ["--build-dir", a.build_dir, "--backends", ",".join(a.backends), "--steps", str(a.steps)]
            cmd += ["--seed", str(a.seed), "--budget", str(max(0.0, self.remaining())), "--out", str(out)]
            cmd += ["--depth", str(a.depth + 1), "--no-table"]
            cmd += ["--skip-units", json.dumps(sorted(self.skip | set(self.done)))]
            cmd += ["--ceilings-json", json.dumps(self.report["ceilings"])] if self.report["ceilings"] else []
            cmd += ["--quick"] if a.quick else []
            cmd += ["--only", a.only] if a.only else []
            print(f"== continuing in a fresh process: {' '.join(sections)} ==", flush=True)
            rc = subprocess.call(cmd)
            if not out.is_file():
                self.report["errors"]["respawn"] = f"the fresh process exited {rc} without a report"
                return
            child = json.loads(out.read_text())
        for key, value in child.items():
            if isinstance(value, list) and key != "argv":
                self.report[key].extend(value)
            elif isinstance(value, dict) and key in ("errors", "skipped"):
                self.report[key].update(value)
        self.report["ceilings"] = self.report["ceilings"] or child.get("ceilings", {})
        self.report["notes"].append(f"continued in a fresh process after a lost CUDA context (exit {rc})")


def environment() -> dict:
    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception as exc:
        env["triton"] = short(exc)
    try:
        from importlib.metadata import version

        env["flash_attn_4"] = version("flash-attn-4")
    except Exception:
        env["flash_attn_4"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = props.name
        env["gpu_memory_gb"] = round(props.total_memory / 1e9, 1)
        env["sms"] = props.multi_processor_count
        env["l2_mb"] = round(l2_bytes() / 2**20, 1)
    else:
        env["gpu"] = None
    return env
