"""Prometheus metrics of one app: requests, tokens, latency histograms and the engine's gauges."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from nanostream.client.stream import Stream, StreamChunk
from nanostream.errors import EngineDeadError
from nanostream.protocol import Stats, step_ms_quantile

# ---- metrics --------------------------------------------------------------------------------------


class Metrics:
    """The server's Prometheus metrics, in a registry of its own (two apps in one process never collide)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "nanostream_requests",
            "Generation requests by endpoint and finish reason (abort: the HTTP client left)",
            ["endpoint", "finish_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter("nanostream_prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter("nanostream_generation_tokens", "Generated tokens sent", registry=r)
        self.ttft = Histogram(
            "nanostream_time_to_first_token_seconds",
            "Seconds from receiving a request to its first token",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.itl = Histogram(
            "nanostream_inter_token_latency_seconds",
            "Seconds between consecutive tokens of a request",
            buckets=(0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56),
            registry=r,
        )
        self.running = Gauge("nanostream_requests_running", "Requests the engine is running", registry=r)
        self.waiting = Gauge("nanostream_requests_waiting", "Requests waiting in the engine's queue", registry=r)
        self.kv_usage = Gauge("nanostream_kv_cache_usage", "Fraction of KV-cache blocks in use", registry=r)
        self.engine_up = Gauge("nanostream_engine_up", "1 if the engine answered the last scrape, else 0", registry=r)
        # The engine's own counters (totals since it started), as vLLM's /metrics has them.
        self.engine_steps = Gauge("nanostream_engine_steps", "Engine steps by kind", ["kind"], registry=r)
        self.step_seconds = Gauge("nanostream_engine_step_seconds", "Wall time in engine steps, summed", registry=r)
        self.step_quantiles = Gauge(
            "nanostream_engine_step_seconds_quantile",
            "Step wall time at a quantile, over the engine's life (upper bound of its histogram bucket)",
            ["quantile"],
            registry=r,
        )
        self.mean_batch = Gauge("nanostream_engine_mean_batch_size", "Requests per engine step, mean", registry=r)
        self.preemptions = Gauge("nanostream_engine_preemptions", "Requests preempted (recomputed)", registry=r)
        self.prefix_hit_rate = Gauge(
            "nanostream_prefix_cache_hit_rate", "Share of admitted prompt tokens found in the prefix cache", registry=r
        )
        self.prefix_queries = Gauge(
            "nanostream_prefix_cache_queries", "Prompt tokens of the requests admitted", registry=r
        )
        self.prefix_hits = Gauge("nanostream_prefix_cache_hits", "Of them, found in the prefix cache", registry=r)
        # The engine's part of the time to first token, summed over the requests that got one.
        self.first_tokens = Gauge("nanostream_engine_first_tokens", "Requests that got their first token", registry=r)
        self.queue_seconds = Gauge(
            "nanostream_engine_queue_seconds", "Arrival to first scheduled, summed over those requests", registry=r
        )
        self.prefill_seconds = Gauge(
            "nanostream_engine_prefill_seconds", "First scheduled to first token, summed over them", registry=r
        )

    def engine_stats(self, stats: Stats | None) -> None:
        self.engine_up.set(stats is not None)
        if stats is not None:
            self.running.set(stats.running)
            self.waiting.set(stats.waiting)
            self.kv_usage.set(1 - stats.free_kv_blocks / max(stats.total_kv_blocks, 1))
        if stats is not None and stats.engine is not None:
            e = stats.engine
            for kind in ("prefill", "decode", "mixed"):
                self.engine_steps.labels(kind).set(e.steps.get(kind, 0))
            steps = sum(e.steps.values())
            self.step_seconds.set(e.step_seconds)
            for q in (0.5, 0.9, 0.99):
                self.step_quantiles.labels(str(q)).set(step_ms_quantile(e.step_ms_buckets, q) / 1e3)
            self.mean_batch.set(e.scheduled_requests / max(steps, 1))
            self.preemptions.set(e.preemptions)
            self.prefix_queries.set(e.prefix_cache_queries)
            self.prefix_hits.set(e.prefix_cache_hits)
            self.prefix_hit_rate.set(e.prefix_cache_hits / max(e.prefix_cache_queries, 1))
            self.first_tokens.set(e.first_tokens)
            self.queue_seconds.set(e.queue_seconds)
            self.prefill_seconds.set(e.prefill_seconds)

    async def timed(self, stream: Stream, endpoint: str) -> AsyncIterator[StreamChunk]:
        """``stream``'s chunks, counted and timed; however the iteration ends, so does the request."""
        start = last = time.perf_counter()
        first = True
        reason = "abort"  # unless it finishes or fails: the HTTP client went away
        try:
            async with stream:
                async for chunk in stream:
                    now = time.perf_counter()
                    if first:
                        first = False
                        self.prompt_tokens.inc(stream.num_prompt_tokens)
                        self.ttft.observe(now - start)
                    elif chunk.token_ids:  # tokens that arrive together share the gap
                        for _ in chunk.token_ids:
                            self.itl.observe((now - last) / len(chunk.token_ids))
                    last = now
                    self.generation_tokens.inc(len(chunk.token_ids))
                    if chunk.finish_reason == "abort":  # the engine gave up on a request we still want
                        raise EngineDeadError("the engine aborted the request before it finished; retry it")
                    reason = chunk.finish_reason or reason
                    yield chunk
        except Exception:
            reason = "error"
            raise
        finally:
            self.requests.labels(endpoint, reason).inc()
