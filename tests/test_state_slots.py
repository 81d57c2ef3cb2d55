"""The state slots of a model with recurrent layers, in the block manager and the scheduler (plain Python, no model):
each running sequence holds a live slot; the prefix cache keeps snapshots of the state at block ends (interval
multiples, the prompt's last full block, the last block a decode completed) with their blocks, restores the last
one a new prompt's cached prefix reaches, and never loses or double-books a slot."""

from __future__ import annotations

import pytest

from nanostream import SamplingParams
from nanostream.engine.block_manager import BlockManager
from nanostream.engine.scheduler import Scheduler
from nanostream.engine.sequence import Sequence
from nanostream.engine.state_slots import ZERO, StateSlots

BS = 4


def seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, tokens, SamplingParams(max_tokens=64), max_tokens=64, sampling_seed=0,
                    stop_token_ids=frozenset())  # fmt: skip


def manager(num_blocks: int = 32, live: int = 4, snapshots: int = 8, interval: int = 4 * BS) -> BlockManager:
    return BlockManager(num_blocks, BS, True, StateSlots(live, snapshots), interval)


def run(bm: BlockManager, s: Sequence, n: int, hits: list[int] = ()):
    """Schedule ``n`` more tokens of ``s`` as one chunk, compute them and cache its full blocks: the chunk's plan."""
    assert bm.allocate(s, n, hits)
    plan = bm.plan_state(s, s.num_computed_tokens, n)
    s.num_computed_tokens += n
    bm.cache_full_blocks(s)
    return plan


def accounted(bm: BlockManager, running: list[Sequence]) -> None:
    """Every slot is exactly one of: free, live for a running sequence, held by a block, pending for a step."""
    st = bm.states
    live = [s.state_slot for s in running]
    pending = [slot for s in running for slot in s.pending_snapshots.values()]
    held = [b.snapshot for b in bm.blocks if b.snapshot is not None]
    assert sorted(st.free_live + live) == list(range(st.num_live))
    assert sorted(st.free_snapshots + held + pending) == list(range(st.num_live, st.num_slots))
    assert sorted(st.held) == sorted(held)


def test_a_fresh_sequence_starts_from_zeros_and_goes_on_from_its_own_state():
    bm = manager()
    s = seq(list(range(10, 31)))  # 21 tokens: 5 full blocks
    first = run(bm, s, 8)
    assert first.init == ZERO and first.slot == s.state_slot == 0
    second = run(bm, s, 13)
    assert second.init is None and second.slot == 0
    accounted(bm, [s])
    bm.free(s)
    assert s.state_slot is None
    accounted(bm, [])


def test_snapshots_at_interval_multiples_the_prompt_end_and_each_decode_tail():
    bm = manager()
    s = seq(list(range(10, 33)))  # 23 tokens: the prompt's last full block ends at 20
    plan = run(bm, s, 23)
    assert [n for n, _ in plan.snapshots] == [16, 20]  # the interval (16) and the prompt's last full block
    for _ in range(9):  # decode: tokens 23 .. 31; blocks end at 24 and 28 and 32
        s.append_token(7)
        run(bm, s, 1)
    tails = [b.snapshot is not None for b in bm.blocks[:8]]
    # kept: 16 (interval), 20 (prompt end), 32 (interval); the decode tails at 24 and 28 each replaced by the next
    ends = [(i + 1) * BS for i, kept in enumerate(tails) if kept and bm.blocks[i].ref_count]
    assert ends == [16, 20, 32]
    accounted(bm, [s])


def test_a_repeated_prefix_restores_the_last_snapshot_it_reaches():
    bm = manager()
    a = seq(list(range(10, 33)), "a")
    run(bm, a, 23)
    bm.free(a)
    b = seq([*range(10, 33), 99, 98], "b")  # the same 23 tokens and two more
    hits = bm.match_prefix(b)
    assert len(hits) == 5  # blocks up to 20, whose end has a snapshot (a dense model's hits are the same here)
    plan = run(bm, b, b.num_tokens - 5 * BS, hits)
    assert b.num_cached_tokens == 0 and plan.init == bm.blocks[hits[-1]].snapshot
    assert plan.init != ZERO and plan.slot == b.state_slot
    accounted(bm, [b])


def test_cached_blocks_past_the_last_snapshot_are_not_hits():
    bm = manager(interval=100 * BS)  # no interval snapshots: only the prompt's end
    a = seq(list(range(10, 31)), "a")  # 21 tokens: snapshot at 20
    run(bm, a, 21)
    b = seq([*range(10, 26), 1, 2, 3, 4, 5, 6], "b")  # shares 16 tokens: 4 cached blocks, none with a snapshot
    assert bm.match_prefix(b) == []
    c = seq([*range(10, 31), 5], "c")  # shares all 21
    assert len(bm.match_prefix(c)) == 5


def test_a_block_handed_out_again_frees_its_snapshot_and_a_full_pool_evicts_the_least_recently_used():
    bm = manager(num_blocks=8, snapshots=2, interval=100 * BS)
    a = seq(list(range(10, 19)), "a")  # 9 tokens: snapshot at 8
    run(bm, a, 9)
    bm.free(a)
    b = seq(list(range(40, 53)), "b")  # 13 tokens: snapshot at 12; the pool's 8 blocks: a's cached ones go
    run(bm, b, 13)
    c = seq(list(range(60, 73)), "c")
    bm.free(b)
    run(bm, c, 13)  # takes the free snapshot slot or evicts: never more than 2 held
    assert sum(blk.snapshot is not None for blk in bm.blocks) <= 2
    accounted(bm, [c])


def test_preemption_returns_the_live_slot_and_the_pending_snapshots():
    bm = manager()
    s = seq(list(range(10, 40)))
    assert bm.allocate(s, 20)
    plan = bm.plan_state(s, 0, 20)
    assert plan.snapshots  # taken for the step, not yet cached
    bm.free(s)  # preempted before its step resolved
    accounted(bm, [])
    assert len(bm.states.free_snapshots) == bm.states.num_snapshots


def test_without_snapshot_slots_or_prefix_caching_nothing_is_kept_and_nothing_hits():
    bm = BlockManager(16, BS, False, StateSlots(2, 4), 4 * BS)
    s = seq(list(range(10, 31)))
    assert run(bm, s, 21).snapshots == ()
    none = manager(snapshots=0)
    t = seq(list(range(10, 31)))
    assert run(none, t, 21).snapshots == ()
    assert none.match_prefix(seq([*range(10, 31), 1], "u")) == []


def test_the_scheduler_plans_every_chunk_through_chunked_prefill_and_preemption():
    bm = manager(num_blocks=12, live=3, snapshots=6)
    sched = Scheduler(bm, max_num_seqs=3, max_num_batched_tokens=10, max_model_len=64)
    for i in range(3):
        sched.add(seq([10 + i] * 17, f"r{i}"))
    for _ in range(40):
        chunks = sched.schedule()
        if not chunks:
            break
        for c in chunks:
            assert c.state is not None and c.state.slot == c.seq.state_slot
            assert (c.state.init == ZERO) == (c.start == 0)
            assert all(0 < n <= c.num_new_tokens for n, _ in c.state.snapshots)
        sched.launched(chunks)
        sched.resolve(chunks, {c.seq.request_id: 5 for c in chunks if c.samples})
        accounted(bm, sched.running)
    assert sched.num_preemptions > 0


@pytest.mark.parametrize(("live", "snapshots"), [(0, 1), (1, -1)])
def test_state_slots_need_a_live_slot(live, snapshots):
    with pytest.raises(ValueError, match="live state slot"):
        StateSlots(live, snapshots)


def test_random_traffic_with_aborts_hits_and_preemption_never_loses_a_slot():
    # Prompts sharing prefixes, a small pool (preemption), aborts at any point (a request ended mid-prefill, mid-
    # decode or while waiting), snapshot slots running out (eviction): after every step each slot is in one place.
    import random

    rng = random.Random(3)
    bm = manager(num_blocks=26, live=4, snapshots=5)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=12, max_model_len=64)
    prefixes = [[rng.randrange(3, 50) for _ in range(rng.randrange(16, 30))] for _ in range(3)]
    for step in range(300):
        if rng.random() < 0.3 and len(sched.requests) < 8:
            tail = [rng.randrange(3, 50) for _ in range(rng.randrange(1, 10))]
            sched.add(seq(rng.choice(prefixes) + tail, f"r{step}"))
        if sched.requests and rng.random() < 0.05:
            sched.finish(rng.choice(list(sched.requests)), "abort")
        chunks = sched.schedule()
        for c in chunks:
            assert c.state.slot == c.seq.state_slot and (c.state.init == ZERO) == (c.start == 0)
        sched.launched(chunks)
        sched.resolve(chunks, {c.seq.request_id: rng.randrange(3, 50) for c in chunks if c.samples})
        accounted(bm, sched.running)
        assert all(s.state_slot is None and not s.pending_snapshots for s in sched.waiting)
    assert sched.num_preemptions > 10 and sched.num_prefix_hits > 100
