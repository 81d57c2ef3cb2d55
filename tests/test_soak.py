"""apps/soak.py at CI size: two client processes of four streams, random greedy requests, some left
early by break, cancellation or aclose(), one client SIGKILLed mid-stream and replaced.

What a user of a shared engine relies on, under that churn: every streamed token equals the offline
``LLM``'s, the engine ends idle with every KV block free once it has dropped the killed client, and
its memory and file descriptors do not grow.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # engine processes, servers or browsers: not in the fast lane

SCRIPT = Path(__file__).resolve().parents[1] / "apps" / "soak.py"


@pytest.fixture(scope="module")
def soak(load_app):
    return load_app("soak")


@pytest.fixture(scope="module")
def report(soak, qwen3_dir):
    cfg = soak.SoakConfig(clients=2, streams=4, requests=72, abort_share=0.3, max_tokens=32, kills=1, seed=7)
    start = time.monotonic()
    result = soak.run_soak(str(qwen3_dir), cfg)
    print(result.summary(), f"\n(the whole run: {time.monotonic() - start:.1f} s)")
    return result


def test_soak_passes_every_check(report):
    assert report.problems() == []
    assert report.ok


def test_soak_exercised_what_it_claims(report, soak):
    ended = report.ended
    assert len(report.records) == 72, "the replacement made the killed client's remaining requests"
    assert ended["killed"] >= 1, "the kill landed while the client had streams open"
    assert all(ended[way] >= 1 for way in soak.WAYS), f"every way of leaving a stream was taken: {ended}"
    assert ended["completed"] >= 36
    assert sum(len(r["ids"]) for r in report.records if r["how"] == "completed") > 500


def test_engine_ends_idle_without_growth(report):
    stats = report.final_stats
    assert stats["running"] == stats["waiting"] == 0
    assert stats["free_kv_blocks"] == stats["total_kv_blocks"]
    assert stats["clients"] == 1, "the killed client was dropped; only the soak's own client is left"
    assert report.fds[1] - report.fds[0] <= 4
    assert report.rss_mib[1] - report.rss_mib[0] < 100


def test_the_comparison_catches_wrong_tokens(report, soak, qwen3_dir):
    """The offline check is not vacuous: a changed token or character is a mismatch, a correct prefix is not."""
    done = next(r for r in report.records if r["how"] == "completed" and len(r["ids"]) > 2)
    left = next(r for r in report.records if r["how"] in soak.WAYS and r["ids"])
    cases = [
        dict(done, key="right-prefix", how="break", ids=done["ids"][:2], text=""),
        dict(done, key="one-token-short", ids=done["ids"][:-1]),
        dict(done, key="other-text", text=done["text"] + "x"),
        dict(left, key="other-first-token", ids=[left["ids"][0] + 1, *left["ids"][1:]]),
        dict(left, key="late-chunk", late=1),
    ]
    mismatches = soak.compare_offline(str(qwen3_dir), soak.CPU_ENGINE, cases)
    assert [m.split()[0] for m in mismatches] == ["one-token-short", "other-text", "other-first-token", "late-chunk"]


def test_same_seed_same_requests(soak, qwen3_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    cfg = soak.SoakConfig(seed=3, abort_share=0.5)
    first = list(soak.plan_requests(cfg, 1, 0, 60, tokenizer))
    assert first == list(soak.plan_requests(cfg, 1, 0, 60, tokenizer))
    assert first != list(soak.plan_requests(cfg, 1, 1, 60, tokenizer)), "a replacement makes fresh requests"
    ways = [r.way for r in first if r.way]
    assert max(map(ways.count, soak.WAYS)) - min(map(ways.count, soak.WAYS)) <= 1, "the ways of leaving take turns"
    assert all(cfg.min_tokens <= r.max_tokens <= cfg.max_tokens for r in first)
