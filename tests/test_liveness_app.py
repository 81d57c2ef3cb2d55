"""apps/liveness.py at CI size: one repeat of each scenario, with short timeouts.

What a user relies on when a peer vanishes: the engine frees a killed or stopped client's request
within its bound, and a client's streams raise ``EngineDeadError`` within its own bound when the
engine hangs or dies; after a stop, both sides recover and a new request runs.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import anyio
import pytest

pytestmark = pytest.mark.slow  # engine processes, servers or browsers: not in the fast lane

SCRIPT = Path(__file__).resolve().parents[1] / "apps" / "liveness.py"


@pytest.fixture(scope="module")
def liveness(load_app):
    return load_app("liveness")


def test_every_side_notices_a_vanished_peer_within_its_bound(liveness, qwen3_dir):
    cfg = liveness.LivenessConfig(repeats=1, heartbeat_interval=0.1, client_timeout=0.6, timeout=0.5)
    with tempfile.TemporaryDirectory(prefix="ns-") as tmp:  # short: ipc paths hold at most 107 bytes
        scenarios = anyio.run(liveness.measure, str(qwen3_dir), cfg, Path(tmp))
    print(liveness.report(scenarios, cfg, "tiny random"))
    for s in scenarios:
        assert not s.problems, (s.name, s.problems)
        assert len(s.samples) == 1 and s.inside(cfg.slack) == 1, (s.name, s.samples, s.bound)
        for what, seen in s.checks.items():
            assert seen == ["ok"], (s.name, what, seen)
