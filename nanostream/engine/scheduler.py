"""Continuous batching with chunked prefill and preemption by recompute.

Policy of one step (``schedule``), within ``max_num_batched_tokens`` tokens and ``max_num_seqs``
requests:

1. Running requests that are decoding get their one token first, oldest first: a long prompt being
   prefilled never stalls the decodes.
2. Running requests part-way through a chunked prefill get the next chunk, oldest first.
3. Waiting requests are admitted first-come first-served, each with as much of its prompt as the
   remaining budget allows (the rest follows in later steps). Admission stops at the first request
   whose blocks do not fit, so a large request is not starved by a stream of small ones.

A step's sampled tokens are read back while the next step runs: ``launched`` advances the scheduled
sequences and appends a ``PENDING`` token for each sample, ``resolve`` fills the values in later. So
a request that samples a stop token may be scheduled once more; that extra token is dropped.

When a running request needs a KV block and none is free, the most recently admitted running
request that is not yet scheduled in this step is preempted: its blocks are freed and it goes back to
the front of the queue, to be recomputed (mostly from the prefix cache) later. If no such request is
left, the request itself is preempted.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from nanostream.engine.block_manager import BlockManager
from nanostream.engine.sequence import PENDING, Sequence, SequenceStatus
from nanostream.engine.state_slots import ChunkState


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_new_tokens: int  # tokens computed for seq this step, starting at seq.num_computed_tokens
    state: ChunkState | None = None  # a model with recurrent layers: its state's start and snapshots
    start: int = field(init=False)  # seq.num_computed_tokens when scheduled
    samples: bool = field(init=False)  # the chunk reaches the sequence's end: the step samples a token

    def __post_init__(self) -> None:
        self.start = self.seq.num_computed_tokens
        self.samples = self.start + self.num_new_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(
        self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.requests: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self.num_prefix_queries = 0  # prompt tokens of the requests admitted so far
        self.num_prefix_hits = 0  # of them, found in the prefix cache at first admission
        self.num_penalized = 0  # requests whose sampling reads their own output (penalties)
        self.num_constrained = 0  # requests with a grammar (structured outputs)
        self.num_prompt_logprobs = 0  # requests that asked for prompt logprobs
        self.num_waiting_tokens = 0  # tokens of the waiting requests (their prompts, or all a preempted one has)

    def __len__(self) -> int:
        return len(self.requests)

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.requests:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)
        self._enqueued(seq)
        self.num_penalized += seq.params.has_penalties
        self.num_constrained += seq.grammar is not None
        self.num_prompt_logprobs += seq.params.prompt_logprobs is not None

    def finish(self, request_id: str, reason: str) -> Sequence | None:
        """End a request in any state and free its blocks at once. Idempotent: unknown ids are ignored."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return None
        self.num_penalized -= seq.params.has_penalties
        self.num_constrained -= seq.grammar is not None
        self.num_prompt_logprobs -= seq.params.prompt_logprobs is not None
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
            self.num_waiting_tokens -= seq.queued_tokens
        self.block_manager.free(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        return seq

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []  # planned once every prefix hit of the step holds its blocks
        # 1 + 2: decodes, then chunks of prefills in progress.
        decodes, prefills = [], []
        for s in self.running:
            left = len(s.token_ids) - s.num_computed_tokens
            if left == 1 and not s.stopping:
                decodes.append(s)
            elif left > 1:
                prefills.append(s)
        queue = deque(decodes + prefills)
        while queue and budget:
            seq = queue.popleft()
            n = seq.next_chunk(seq.num_computed_tokens, budget)
            if not n:  # the rest of an image whose tokens go together: a later step
                continue
            while not self.block_manager.allocate(seq, n):
                if queue:
                    self._preempt(max(queue, key=self.running.index))
                    queue = deque(s for s in queue if s.status is SequenceStatus.RUNNING)
                else:
                    self._preempt(seq)
                    break
            else:
                scheduled.append((seq, n))
                budget -= n
        # 3. admissions.
        while self.waiting and budget and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = [] if seq.wants_prompt_logprobs else self.block_manager.match_prefix(seq)
            n = seq.next_chunk(len(hits) * self.block_manager.block_size, budget)
            if not n or not self.block_manager.allocate(seq, n, hits):
                break
            self.waiting.popleft()
            self.num_waiting_tokens -= seq.queued_tokens
            if not seq.admitted:
                seq.admitted, seq.num_cached_tokens = True, seq.num_computed_tokens
                seq.admitted_at = time.monotonic()
                self.num_prefix_queries += seq.num_prompt_tokens
                self.num_prefix_hits += seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n
        # The state snapshots the chunks take may evict cached ones, never one that an admission just hit.
        return [self._chunk(seq, n) for seq, n in scheduled]

    def _chunk(self, seq: Sequence, n: int) -> ScheduledChunk:
        """The next ``n`` tokens of ``seq`` (its blocks allocated), with its state's plan where the model has one."""
        return ScheduledChunk(seq, n, self.block_manager.plan_state(seq, seq.num_computed_tokens, n))

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self._enqueued(seq)
        self.num_preemptions += 1

    def _enqueued(self, seq: Sequence) -> None:
        seq.queued_tokens = seq.num_tokens
        self.num_waiting_tokens += seq.queued_tokens

    def needs_token_values(self) -> bool:
        """Some request's sampling reads its own output tokens (penalties): no token may be pending."""
        return self.num_penalized > 0

    def launched(self, scheduled: list[ScheduledChunk]) -> None:
        """The step is on the device: advance each sequence by its chunk, a PENDING token per sample."""
        for chunk in scheduled:
            seq = chunk.seq
            seq.num_computed_tokens += chunk.num_new_tokens
            if chunk.samples:
                seq.append_token(PENDING)
                seq.stopping = seq.reaches_length_limit(self.max_model_len)

    def resolve(self, scheduled: list[ScheduledChunk], sampled: dict[str, int]) -> list[Sequence]:
        """The launched step's samples arrived: fill them in, cache full blocks, finish requests that
        stop. Returns the sequences that took a token (finished ones have their finish_reason)."""
        took = []
        for chunk in scheduled:
            seq = chunk.seq
            if seq.is_finished:  # aborted, or stopped by its previous token while this step ran
                continue
            if chunk.samples:
                index = chunk.start + chunk.num_new_tokens  # where launched() put the PENDING token
                token = seq.token_ids[index] = sampled[seq.request_id]
                took.append(seq)
                if seq.grammar is not None and not seq.grammar.accept(token):
                    seq.error = f"the sampled token {token} breaks the request's grammar (structured outputs)"
                    reason = "error"
                else:
                    reason = seq.check_stop(self.max_model_len, index)
                if reason is not None:
                    del seq.token_ids[index + 1 :]  # a later step's PENDING token, if scheduled
                    self.block_manager.cache_full_blocks(seq)  # (a one-token request's prompt: cached too)
                    self.finish(seq.request_id, reason)
                    continue
            self.block_manager.cache_full_blocks(seq)
            self.block_manager.release_behind_window(seq)
        return took
