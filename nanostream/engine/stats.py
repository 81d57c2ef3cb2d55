"""What an engine counts as it runs (steps by kind and wall time, batch sizes, tokens, finishes);
``LLMEngine.stats()`` adds the scheduler's (preemptions, prefix-cache hits) and returns it all as
``protocol.EngineStats``, which the engine process's stats message, ``/metrics`` and the
benchmarks read. Plain Python: a few additions per step."""

from __future__ import annotations

import bisect
from collections import Counter

from nanostream.protocol import STEP_MS_BUCKETS, EngineStats


class StepCounters:
    def __init__(self) -> None:
        self.steps: Counter[str] = Counter()
        self.step_seconds = 0.0
        self.step_ms_buckets = [0] * (len(STEP_MS_BUCKETS) + 1)
        self.scheduled_requests = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: Counter[str] = Counter()
        self.first_tokens = 0
        self.queue_seconds = 0.0
        self.prefill_seconds = 0.0

    def step(self, seconds: float, num_requests: int, num_prefill_tokens: int, num_decode_tokens: int) -> None:
        if not num_requests:
            return
        kind = "mixed" if num_prefill_tokens and num_decode_tokens else "prefill" if num_prefill_tokens else "decode"
        self.steps[kind] += 1
        self.step_seconds += seconds
        self.step_ms_buckets[bisect.bisect_left(STEP_MS_BUCKETS, seconds * 1e3)] += 1
        self.scheduled_requests += num_requests
        self.prompt_tokens += num_prefill_tokens

    def first_token(self, arrived: float, admitted: float, now: float) -> None:
        """A request's first token was read back at ``now`` (time.monotonic(), as the other two)."""
        self.first_tokens += 1
        self.queue_seconds += admitted - arrived
        self.prefill_seconds += now - admitted

    def snapshot(
        self, *, preemptions: int, prefix_cache_queries: int, prefix_cache_hits: int, device_wait_seconds: float
    ) -> EngineStats:
        return EngineStats(
            steps=dict(self.steps),
            step_seconds=self.step_seconds,
            step_ms_buckets=list(self.step_ms_buckets),
            scheduled_requests=self.scheduled_requests,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            preemptions=preemptions,
            prefix_cache_queries=prefix_cache_queries,
            prefix_cache_hits=prefix_cache_hits,
            finished=dict(self.finished),
            device_wait_seconds=device_wait_seconds,
            first_tokens=self.first_tokens,
            queue_seconds=self.queue_seconds,
            prefill_seconds=self.prefill_seconds,
        )
