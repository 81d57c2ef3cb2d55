"""The scheduler driven as the engine drives it (schedule -> model -> update), with a fake model.

``FakeModel`` stands in for the model runner: it writes every computed token into a simulated KV
pool at the slot the block table gives, and samples the next token from what the pool holds for the
sequence. As in a real model, the entry at position p depends on tokens 0..p, so a lost, stale or
overwritten KV entry (a bad prefix hit, a block shared while written, a recompute that skips tokens)
changes the output, and the outputs are checked token-exact against ``reference_output``.
"""

import math
import random

import pytest

from nanostream.engine.block_manager import BlockManager
from nanostream.engine.scheduler import ScheduledChunk, Scheduler
from nanostream.engine.sequence import PENDING, Sequence, SequenceStatus
from nanostream.sampling_params import SamplingParams

BS = 4  # tokens per block in these tests
STOP = 7  # a stop token id that next_token never produces


def update(sched: Scheduler, chunks: list, sampled: dict[str, int]) -> list:
    """A step whose samples are known at once: launched() then resolve(); the sequences that finished."""
    sched.launched(chunks)
    return [seq for seq in sched.resolve(chunks, sampled) if seq.is_finished]


def next_token(context: list[int]) -> int:
    """The fake model: a greedy LM whose next token depends on every token of the context."""
    return 1000 + sum((i + 1) * t for i, t in enumerate(context)) % 997


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    context = list(prompt)
    for _ in range(max_tokens):
        context.append(next_token(context))
    return context[len(prompt) :]


def reference_run(seq: Sequence, max_model_len: int) -> tuple[list[int], str]:
    """The outputs and finish reason of ``seq`` computed alone, without a scheduler."""
    context = seq.prompt_token_ids
    while True:
        context.append(next_token(context))
        outputs = context[seq.num_prompt_tokens :]
        if len(outputs) >= seq.params.min_tokens and outputs[-1] in seq.stop_token_ids:
            return outputs, "stop"
        if len(outputs) >= seq.max_tokens or len(context) >= max_model_len:
            return outputs, "length"


def make_seq(
    request_id: str, prompt: list[int], max_tokens: int = 8, min_tokens: int = 0, stop: frozenset[int] = frozenset()
) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens)
    return Sequence(request_id, prompt, params, max_tokens=max_tokens, sampling_seed=0, stop_token_ids=stop)


def make_scheduler(
    num_blocks: int = 64,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 1024,
    enable_prefix_caching: bool = True,
    block_size: int = BS,
) -> Scheduler:
    return Scheduler(
        BlockManager(num_blocks, block_size, enable_prefix_caching),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
    )


def slot(seq: Sequence, pos: int, block_size: int) -> int:
    return seq.block_table[pos // block_size] * block_size + pos % block_size


class FakeModel:
    def __init__(self, block_size: int = BS) -> None:
        self.block_size = block_size
        self.kv: dict[int, tuple[int, ...]] = {}  # slot -> the tokens 0..p its K/V was computed from

    def execute(self, chunks: list[ScheduledChunk], in_flight: dict[str, int] | None = None) -> dict[str, int]:
        """Compute the chunks; a PENDING token takes its value from ``in_flight`` (the previous step's
        samples, as the runner reads them on the device)."""

        def tokens(seq: Sequence) -> list[int]:
            return [in_flight[seq.request_id] if t == PENDING else t for t in seq.token_ids]

        for chunk in chunks:  # write this step's K/V first, as a forward pass does
            seq, known = chunk.seq, tokens(chunk.seq)
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + chunk.num_new_tokens):
                self.kv[slot(seq, pos, self.block_size)] = tuple(known[: pos + 1])
        sampled = {}
        for chunk in chunks:
            if chunk.samples:
                seq = chunk.seq
                entries = [self.kv.get(slot(seq, p, self.block_size)) for p in range(seq.num_tokens)]
                intact = all(entry == entries[-1][: p + 1] for p, entry in enumerate(entries))
                sampled[seq.request_id] = next_token(list(entries[-1])) if intact else -1  # -1: garbage
        return sampled


def check_pool(sched: Scheduler) -> None:
    """Each block is held by exactly as many running requests as its ref count says; the rest are free."""
    bm = sched.block_manager
    holders = [0] * bm.num_blocks
    for seq in sched.running:
        for block_id in seq.block_table:
            holders[block_id] += 1
    for seq in sched.waiting:
        assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert [b.ref_count for b in bm.blocks] == holders
    assert set(bm.free_empty) | set(bm.free_cached) == {i for i, n in enumerate(holders) if n == 0}


def step(sched: Scheduler, model: FakeModel) -> tuple[list[ScheduledChunk], list[Sequence]]:
    """One engine step, checking the limits every step must respect."""
    chunks = checked_schedule(sched)
    finished = update(sched, chunks, model.execute(chunks))
    check_pool(sched)
    return chunks, finished


def pipelined_step(sched: Scheduler, model: FakeModel, in_flight: tuple | None) -> tuple | None:
    """One step as the engine runs it: launch this one, then resolve the one in flight."""
    chunks = checked_schedule(sched)
    sampled = model.execute(chunks, in_flight[1] if in_flight else None)
    sched.launched(chunks)
    if in_flight is not None:
        sched.resolve(*in_flight)
    check_pool(sched)
    return (chunks, sampled) if chunks else None


def checked_schedule(sched: Scheduler) -> list[ScheduledChunk]:
    chunks = sched.schedule()
    assert sum(c.num_new_tokens for c in chunks) <= sched.max_num_batched_tokens
    assert len(sched.running) <= sched.max_num_seqs
    assert len({c.seq.request_id for c in chunks}) == len(chunks)
    bm = sched.block_manager
    for chunk in chunks:
        seq = chunk.seq
        assert seq.status is SequenceStatus.RUNNING and chunk.num_new_tokens >= 1
        end = seq.num_computed_tokens + chunk.num_new_tokens
        assert end <= seq.num_tokens
        assert len(seq.block_table) * bm.block_size >= end
        # The blocks this step writes into belong to this request alone.
        for i in range(seq.num_computed_tokens // bm.block_size, bm.blocks_needed(end)):
            assert bm.blocks[seq.block_table[i]].ref_count == 1
    check_pool(sched)
    return chunks


def run(sched: Scheduler, model: FakeModel, max_steps: int = 2000) -> list[list[ScheduledChunk]]:
    steps = []
    while len(sched):
        assert len(steps) < max_steps, f"no progress: {sched.running} {list(sched.waiting)}"
        steps.append(step(sched, model)[0])
    return steps


def test_decodes_go_first_while_a_long_prompt_is_chunked():
    sched, model = make_scheduler(max_num_batched_tokens=8), FakeModel()
    short = [make_seq("s1", [1, 2, 3], max_tokens=20), make_seq("s2", [4, 5, 6], max_tokens=20)]
    for seq in short:
        sched.add(seq)
    step(sched, model)  # both prefilled, both sampled their first token
    long = make_seq("long", list(range(10, 40)), max_tokens=4)  # 30 tokens > the 8-token budget
    sched.add(long)
    prefill_steps = 0
    while long.num_output_tokens == 0:
        before = [s.num_output_tokens for s in short]
        chunks, _ = step(sched, model)
        prefill_steps += 1
        # The decodes come first and each gets its token; the prompt gets what is left of the budget.
        assert [c.seq for c in chunks] == [*short, long]
        assert [c.num_new_tokens for c in chunks] == [1, 1, min(6, 30 - 6 * (prefill_steps - 1))]
        assert [s.num_output_tokens for s in short] == [n + 1 for n in before]
    assert prefill_steps == math.ceil(30 / 6)
    run(sched, model)
    for seq in [*short, long]:
        assert seq.output_token_ids == reference_output(seq.prompt_token_ids, seq.max_tokens)


def test_a_chunked_prompt_samples_only_after_its_last_chunk():
    sched, model = make_scheduler(max_num_batched_tokens=8), FakeModel()
    seq = make_seq("a", list(range(1, 21)), max_tokens=3)
    sched.add(seq)
    chunks, samples = [], []
    for _ in range(3):
        (chunk,) = sched.schedule()
        chunks.append(chunk.num_new_tokens)
        samples.append(chunk.samples)  # read before update() advances the sequence
        sampled = model.execute([chunk])
        assert sampled.keys() == ({"a"} if chunk.samples else set())
        update(sched, [chunk], sampled)
    assert chunks == [8, 8, 4]
    assert samples == [False, False, True]
    assert seq.num_output_tokens == 1
    run(sched, model)
    assert seq.output_token_ids == reference_output(list(range(1, 21)), 3)


def test_token_budget_and_max_num_seqs_hold_every_step():
    sched, model = make_scheduler(max_num_seqs=4, max_num_batched_tokens=16), FakeModel()
    seqs = [make_seq(f"r{i}", [i + 1] * (1 + 7 * i % 40), max_tokens=3 + i % 5) for i in range(12)]
    for seq in seqs:
        sched.add(seq)
    steps = run(sched, model)  # step() asserts the limits on every step
    assert max(len(chunks) for chunks in steps) == 4  # the limits were reached, not just respected
    assert max(sum(c.num_new_tokens for c in chunks) for chunks in steps) == 16
    for seq in seqs:
        assert seq.finish_reason == "length"
        assert seq.output_token_ids == reference_output(seq.prompt_token_ids, seq.max_tokens)


def test_admission_is_first_come_first_served():
    sched, model = make_scheduler(max_num_seqs=2), FakeModel()
    seqs = [make_seq(f"r{i}", [10 + i, 20 + i], max_tokens=[6, 2, 4, 1, 3][i]) for i in range(5)]
    for seq in seqs:
        sched.add(seq)
    first_step, finish_step = {}, {}
    n = 0
    while len(sched):
        chunks, finished = step(sched, model)
        for chunk in chunks:
            first_step.setdefault(chunk.seq.request_id, n)
        for seq in finished:
            finish_step[seq.request_id] = n
        n += 1
    admitted = sorted(first_step, key=lambda rid: first_step[rid])
    assert admitted == [s.request_id for s in seqs]
    # With two slots, the third request starts right after the first one to finish.
    assert first_step["r2"] == min(finish_step["r0"], finish_step["r1"]) + 1


def test_admission_stops_at_the_first_request_that_does_not_fit():
    sched, model = make_scheduler(num_blocks=6), FakeModel()
    a = make_seq("a", list(range(1, 13)), max_tokens=8)  # 3 blocks now, 5 at the end
    big = make_seq("big", list(range(20, 36)), max_tokens=4)  # 4 blocks: does not fit beside a
    small = make_seq("small", [40, 41], max_tokens=2)  # 1 block: would fit, but arrived after big
    for seq in (a, big, small):
        sched.add(seq)
    step(sched, model)
    assert sched.running == [a]
    assert list(sched.waiting) == [big, small]
    assert sched.block_manager.num_free_blocks >= sched.block_manager.blocks_needed(small.num_tokens)
    first = {}
    n = 0
    while len(sched):
        for chunk in step(sched, model)[0]:
            first.setdefault(chunk.seq.request_id, n)
        n += 1
    assert first["big"] <= first["small"]
    for seq in (a, big, small):
        assert seq.output_token_ids == reference_output(seq.prompt_token_ids, seq.max_tokens)


def test_preemption_takes_the_newest_request_back_to_the_front_of_the_queue():
    sched, model = make_scheduler(num_blocks=4, max_num_seqs=2), FakeModel()
    a = make_seq("a", [1, 2, 3, 4, 5, 6, 7], max_tokens=6)
    b = make_seq("b", [11, 12, 13, 14, 15, 16, 17], max_tokens=6)
    c = make_seq("c", [21, 22, 23], max_tokens=2)
    for seq in (a, b, c):
        sched.add(seq)
    step(sched, model)  # a and b admitted with 2 blocks each: the pool is full
    step(sched, model)  # both decode into their second block
    assert sched.num_preemptions == 0
    chunks, _ = step(sched, model)  # a needs a third block: b, admitted after a, gives way
    assert [ch.seq for ch in chunks] == [a]
    assert sched.num_preemptions == 1
    assert b.status is SequenceStatus.WAITING
    assert list(sched.waiting) == [b, c]  # ahead of c, which was waiting already
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert b.output_token_ids == reference_output(b.prompt_token_ids, 2)  # its tokens so far are kept
    assert b.num_cached_tokens == 0
    steps = run(sched, model)
    # b is recomputed once a has finished, its first block (still cached) taken from the prefix cache.
    resumed = next(i for i, chunks in enumerate(steps) if any(ch.seq is b for ch in chunks))
    assert all(ch.seq is not b for chunks in steps[:resumed] for ch in chunks)
    assert a.is_finished and any(ch.seq is a for ch in steps[resumed - 1])
    assert [ch.num_new_tokens for ch in steps[resumed] if ch.seq is b] == [9 - BS]
    for seq in (a, b, c):
        assert seq.finish_reason == "length"
        assert seq.output_token_ids == reference_output(seq.prompt_token_ids, seq.max_tokens)
    assert b.num_cached_tokens == 0  # usage reports the cache hits of the first admission only
    assert sched.block_manager.num_free_blocks == 4


def test_preemption_picks_the_newest_of_several_and_never_a_scheduled_request():
    sched, model = make_scheduler(num_blocks=6, max_num_seqs=3), FakeModel()
    a, b, c = (make_seq(rid, list(range(base, base + 7)), max_tokens=6) for rid, base in zip("abc", (0, 20, 40)))
    d = make_seq("d", [60, 61, 62], max_tokens=2)
    for seq in (a, b, c, d):
        sched.add(seq)
    step(sched, model)  # a, b, c admitted with 2 blocks each: the pool is full
    step(sched, model)
    chunks, _ = step(sched, model)  # all three need a third block
    # a is served first and preempts c, the newest; b takes the second of c's freed blocks.
    assert [ch.seq for ch in chunks] == [a, b]
    assert c.status is SequenceStatus.WAITING and list(sched.waiting) == [c, d]
    assert sched.num_preemptions == 1
    run(sched, model)
    for seq in (a, b, c, d):
        assert seq.output_token_ids == reference_output(seq.prompt_token_ids, seq.max_tokens)
    assert sched.block_manager.num_free_blocks == 6


def test_the_last_request_to_be_served_preempts_itself_not_one_already_scheduled():
    sched, model = make_scheduler(num_blocks=5, max_num_seqs=2), FakeModel()
    a = make_seq("a", [1, 2, 3, 4, 5, 6, 7], max_tokens=4)
    b = make_seq("b", [11, 12, 13, 14, 15, 16, 17], max_tokens=4)
    sched.add(a)
    sched.add(b)
    step(sched, model)
    step(sched, model)  # 4 of 5 blocks used; both now need a third block
    chunks, _ = step(sched, model)
    assert [ch.seq for ch in chunks] == [a]  # a took the free block; b, with nothing left to preempt, gave way
    assert b.status is SequenceStatus.WAITING and b.block_table == []
    assert a.status is SequenceStatus.RUNNING
    run(sched, model)
    for seq in (a, b):
        assert seq.output_token_ids == reference_output(seq.prompt_token_ids, seq.max_tokens)


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_kv_pressure_preempts_and_recomputes_without_losing_tokens(enable_prefix_caching):
    sched = make_scheduler(
        num_blocks=10, max_num_seqs=6, max_num_batched_tokens=12, enable_prefix_caching=enable_prefix_caching
    )
    model = FakeModel()
    shared = list(range(100, 108))  # two blocks of common prefix for half of the requests
    seqs = []
    for i in range(10):
        prompt = (shared if i % 2 else []) + [i + 1] * (3 + 5 * i % 11)
        seq = make_seq(f"r{i}", prompt, max_tokens=4 + 3 * i % 13)
        assert sched.block_manager.blocks_needed(seq.num_tokens + seq.max_tokens) <= 10  # as the engine checks
        seqs.append(seq)
        sched.add(seq)
    run(sched, model)
    assert sched.num_preemptions > 0
    for seq in seqs:
        assert seq.finish_reason == "length"
        assert seq.num_output_tokens == seq.max_tokens
        assert seq.output_token_ids == reference_output(seq.prompt_token_ids, seq.max_tokens)
    assert sched.block_manager.num_free_blocks == 10
    assert len(sched) == 0 and not sched.running and not sched.waiting


def test_prefix_cache_hit_skips_the_cached_blocks_and_keeps_outputs_exact():
    sched, model = make_scheduler(), FakeModel()
    prompt = list(range(1, 11))  # 10 tokens: two full blocks
    first = make_seq("first", prompt, max_tokens=3)
    sched.add(first)
    run(sched, model)
    second = make_seq("second", prompt, max_tokens=5)
    sched.add(second)
    (chunk,), _ = step(sched, model)
    assert second.num_cached_tokens == 8
    assert chunk.num_new_tokens == 2
    run(sched, model)
    assert second.output_token_ids == reference_output(prompt, 5)


def test_requests_sharing_a_live_prefix_both_decode_correctly():
    sched, model = make_scheduler(max_num_batched_tokens=16), FakeModel()
    prefix = list(range(50, 62))  # three full blocks
    a = make_seq("a", [*prefix, 1], max_tokens=10)
    sched.add(a)
    step(sched, model)
    b = make_seq("b", [*prefix, 2, 3], max_tokens=10)
    sched.add(b)
    step(sched, model)
    assert b.num_cached_tokens == 12
    assert a.block_table[:3] == b.block_table[:3]
    run(sched, model)
    assert a.output_token_ids == reference_output(a.prompt_token_ids, 10)
    assert b.output_token_ids == reference_output(b.prompt_token_ids, 10)


def test_duplicate_request_id_is_rejected():
    sched = make_scheduler()
    sched.add(make_seq("a", [1, 2]))
    with pytest.raises(ValueError, match="already in use"):
        sched.add(make_seq("a", [3, 4]))
    assert len(sched) == 1 and sched.waiting[0].prompt_token_ids == [1, 2]


def test_nothing_to_schedule_gives_an_empty_step():
    sched = make_scheduler()
    assert sched.schedule() == []
    assert update(sched, [], {}) == []


def _bring_to(state: str, sched: Scheduler, model: FakeModel) -> Sequence:
    """Put a request "x" into ``state``, next to a request "other" that keeps running."""
    other = make_seq("other", list(range(30, 39)), max_tokens=20)
    sched.add(other)
    step(sched, model)
    if state == "waiting":
        x = make_seq("x", list(range(1, 20)), max_tokens=4)
        sched.add(x)
        assert x.status is SequenceStatus.WAITING
    elif state == "prefilling":
        x = make_seq("x", list(range(1, 20)), max_tokens=4)  # 19 tokens, 7 per step
        sched.add(x)
        step(sched, model)
        assert x.status is SequenceStatus.RUNNING and 0 < x.num_computed_tokens < x.num_prompt_tokens
    else:
        x = make_seq("x", [*range(30, 38), 99], max_tokens=20)  # shares two blocks with other
        sched.add(x)
        step(sched, model)
        step(sched, model)
        assert x.status is SequenceStatus.RUNNING and x.num_output_tokens == 2
    return x


@pytest.mark.parametrize("state", ["waiting", "prefilling", "decoding"])
def test_finish_frees_every_block_in_any_state(state):
    sched, model = make_scheduler(num_blocks=16, max_num_batched_tokens=8), FakeModel()
    x = _bring_to(state, sched, model)
    other = sched.requests["other"]
    seq = sched.finish("x", "abort")
    assert seq is x
    assert x.status is SequenceStatus.FINISHED and x.finish_reason == "abort"
    assert x not in sched.running and x not in sched.waiting and "x" not in sched.requests
    check_pool(sched)  # x's blocks are free; blocks it shared with other are still held by other
    assert sched.block_manager.num_free_blocks == 16 - len(other.block_table)
    assert sched.finish("x", "abort") is None  # idempotent: no double free
    assert x.finish_reason == "abort"
    steps = run(sched, model)
    assert all(c.seq is not x for chunks in steps for c in chunks)
    assert other.output_token_ids == reference_output(other.prompt_token_ids, 20)
    assert sched.block_manager.num_free_blocks == 16


def test_finish_of_a_finished_or_unknown_request_is_ignored():
    sched, model = make_scheduler(), FakeModel()
    seq = make_seq("a", [1, 2, 3], max_tokens=1)
    sched.add(seq)
    _, finished = step(sched, model)
    assert finished == [seq]
    assert sched.finish("a", "abort") is None
    assert seq.finish_reason == "length"  # not overwritten
    assert sched.finish("never-added", "abort") is None
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def scripted(sched: Scheduler, script: dict[str, list[int]]) -> list[Sequence]:
    """Step with the given sampled tokens (request id -> tokens in order) until every request ends."""
    finished = []
    for _ in range(100):
        if not len(sched):
            return finished
        chunks = sched.schedule()
        sampled = {c.seq.request_id: script[c.seq.request_id].pop(0) for c in chunks if c.samples}
        finished += update(sched, chunks, sampled)
    raise AssertionError("did not finish")


def test_stop_token_finishes_with_reason_stop():
    sched = make_scheduler()
    seq = make_seq("a", [1, 2, 3], max_tokens=10, stop=frozenset({STOP}))
    sched.add(seq)
    assert scripted(sched, {"a": [5, 6, STOP, 8]}) == [seq]
    assert seq.finish_reason == "stop"
    assert seq.output_token_ids == [5, 6, STOP]
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_stop_token_is_ignored_before_min_tokens():
    sched = make_scheduler()
    seq = make_seq("a", [1, 2, 3], max_tokens=10, min_tokens=3, stop=frozenset({STOP}))
    sched.add(seq)
    scripted(sched, {"a": [STOP, STOP, STOP, STOP]})
    assert seq.finish_reason == "stop"
    assert seq.output_token_ids == [STOP, STOP, STOP]  # the third output may stop, not earlier


def test_max_tokens_finishes_with_reason_length():
    sched = make_scheduler()
    seq = make_seq("a", [1, 2, 3], max_tokens=4, stop=frozenset({STOP}))
    sched.add(seq)
    scripted(sched, {"a": [5, 6, 5, 6, 5]})
    assert seq.finish_reason == "length"
    assert seq.output_token_ids == [5, 6, 5, 6]


def test_stop_token_on_the_last_allowed_token_reports_stop():
    sched = make_scheduler()
    seq = make_seq("a", [1, 2, 3], max_tokens=2, stop=frozenset({STOP}))
    sched.add(seq)
    scripted(sched, {"a": [5, STOP]})
    assert seq.finish_reason == "stop"


def test_max_model_len_finishes_with_reason_length():
    sched = make_scheduler(max_model_len=6)
    seq = make_seq("a", [1, 2, 3, 4], max_tokens=10)
    sched.add(seq)
    scripted(sched, {"a": [5, 6, 5, 6]})
    assert seq.finish_reason == "length"
    assert seq.num_tokens == 6


def test_each_request_stops_on_its_own_reason_in_a_shared_batch():
    sched = make_scheduler()
    a = make_seq("a", [1, 2], max_tokens=5, stop=frozenset({STOP}))
    b = make_seq("b", [3, 4], max_tokens=2, stop=frozenset({STOP}))
    c = make_seq("c", [5, 6], max_tokens=5, stop=frozenset({9}))  # STOP is not a stop token of c
    for seq in (a, b, c):
        sched.add(seq)
    finished = scripted(sched, {"a": [8, STOP], "b": [8, 8], "c": [STOP, STOP, 9]})
    assert [s.request_id for s in finished] == ["a", "b", "c"]
    assert [s.finish_reason for s in finished] == ["stop", "length", "stop"]
    assert c.output_token_ids == [STOP, STOP, 9]


def _random_workload(seed: int, pipelined: bool = False) -> tuple[int, int]:
    rng = random.Random(seed)
    block_size, num_blocks, max_num_seqs = rng.choice([1, 2, 3, 4, 8]), rng.randint(3, 40), rng.randint(1, 6)
    max_model_len = rng.randint(8, 80)
    sched = make_scheduler(
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_seqs + rng.randint(0, 20),
        max_model_len=max_model_len,
        enable_prefix_caching=rng.random() < 0.7,
        block_size=block_size,
    )
    model = FakeModel(block_size)
    prefixes = [[rng.randint(1, 50) for _ in range(rng.randint(0, 20))] for _ in range(3)]
    arrivals = []
    for i in range(rng.randint(1, 12)):
        prompt = [*rng.choice(prefixes), *(rng.randint(1, 50) for _ in range(rng.randint(1, 12)))]
        if len(prompt) >= max_model_len:
            continue
        max_tokens = rng.randint(1, min(15, max_model_len - len(prompt)))
        if sched.block_manager.blocks_needed(len(prompt) + max_tokens) > num_blocks:
            continue  # the engine rejects these at add_request
        min_tokens = rng.randint(0, max_tokens) if rng.random() < 0.3 else 0
        stop = frozenset(rng.sample(range(1000, 1997), 40)) if rng.random() < 0.5 else frozenset()
        arrivals.append((rng.randint(0, 10), make_seq(f"r{i}", prompt, max_tokens, min_tokens, stop)))
    pending, aborted, t, in_flight = sorted(arrivals, key=lambda a: a[0]), set(), 0, None
    while pending or len(sched):
        while pending and pending[0][0] <= t:
            sched.add(pending.pop(0)[1])
        if len(sched) and rng.random() < 0.05:
            aborted.add(sched.finish(rng.choice(list(sched.requests)), "abort").request_id)
        if pipelined:
            in_flight = pipelined_step(sched, model, in_flight)
        else:
            step(sched, model)
        t += 1
        assert t < 2000, f"seed {seed}: no progress"
    for _, seq in arrivals:
        outputs, reason = reference_run(seq, max_model_len)
        if seq.request_id in aborted:  # aborted while a step was in flight: that token never arrives
            got = [t for t in seq.output_token_ids if t != PENDING]
            assert (got, seq.finish_reason) == (outputs[: len(got)], "abort"), seed
        else:
            assert (seq.output_token_ids, seq.finish_reason) == (outputs, reason), seed
    assert sched.block_manager.num_free_blocks == num_blocks, seed
    return sched.num_preemptions, len(aborted)


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
def test_random_workloads_with_aborts_finish_token_exact_and_free_every_block(pipelined):
    # Arrivals over time, shared prefixes, stop tokens, min_tokens, aborts in any state and tiny pools
    # (so preemption); step() checks the limits every step. Pipelined: each step is launched before the
    # previous one's samples are read (PENDING tokens), as the engine runs.
    preemptions, aborts = zip(*(_random_workload(seed, pipelined) for seed in range(300)))
    assert sum(p > 0 for p in preemptions) > 20 and sum(aborts) > 20  # both paths were exercised


class ScriptedGrammar:
    """A grammar that allows ``allowed`` tokens and terminates once it has taken ``end``."""

    def __init__(self, allowed: set[int], end: int) -> None:
        self.allowed, self.end, self.taken = allowed, end, []

    def accept(self, token_id: int) -> bool:
        if token_id not in self.allowed:
            return False
        self.taken.append(token_id)
        return True

    @property
    def terminated(self) -> bool:
        return bool(self.taken) and self.taken[-1] == self.end


def test_a_grammar_takes_each_token_and_ends_the_request_when_it_terminates():
    sched = make_scheduler()
    seq = make_seq("a", [1, 2, 3], max_tokens=10)  # no stop tokens (ignore_eos): the grammar ends it
    seq.grammar = ScriptedGrammar({5, 6, 9}, end=9)
    sched.add(seq)
    assert sched.num_constrained == 1
    assert scripted(sched, {"a": [5, 6, 9, 5]}) == [seq]
    assert (seq.finish_reason, seq.output_token_ids, seq.grammar.taken) == ("stop", [5, 6, 9], [5, 6, 9])
    assert sched.num_constrained == 0


def test_a_token_the_grammar_refuses_fails_the_request():
    sched = make_scheduler()
    seq = make_seq("a", [1, 2, 3], max_tokens=10)
    seq.grammar = ScriptedGrammar({5}, end=9)
    sched.add(seq)
    scripted(sched, {"a": [5, 8, 5]})
    assert seq.finish_reason == "error" and "breaks the request's grammar" in seq.error
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_a_request_for_prompt_logprobs_skips_the_prefix_cache_until_they_are_computed():
    sched = make_scheduler()
    prompt = list(range(1, 14))  # three full blocks and one token
    first = make_seq("a", prompt, max_tokens=1)
    sched.add(first)
    scripted(sched, {"a": [5]})
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    seq = Sequence("b", prompt, params, max_tokens=1, sampling_seed=0, stop_token_ids=frozenset())
    sched.add(seq)
    assert sched.schedule()[0].num_new_tokens == len(prompt)  # all computed again: each position's logits
    seq.prompt_logprobs = [None] * len(prompt)  # what the runner fills in as the chunks run
    assert not seq.wants_prompt_logprobs
