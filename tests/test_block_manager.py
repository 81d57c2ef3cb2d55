"""Paged KV blocks: block tables grow with computed tokens, prefix-cache hits are exact, no block is lost."""

import pytest

from nanostream.engine.block_manager import BlockManager
from nanostream.engine.blocks import chain_hash
from nanostream.engine.sequence import Sequence
from nanostream.sampling_params import SamplingParams

BS = 4  # tokens per block in these tests


def make_seq(request_id: str, prompt: list[int], max_tokens: int = 16) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens)
    return Sequence(request_id, prompt, params, max_tokens=max_tokens, sampling_seed=0, stop_token_ids=frozenset())


def compute(bm: BlockManager, seq: Sequence, n: int) -> None:
    """What one step does for ``seq``: blocks for ``n`` more tokens, then they count as computed."""
    assert bm.allocate(seq, n)
    seq.num_computed_tokens += n
    bm.cache_full_blocks(seq)


def admit(bm: BlockManager, seq: Sequence) -> list[int]:
    """Admit ``seq`` with its prefix-cache hits and compute the rest of it; return the hits."""
    hits = bm.match_prefix(seq)
    n = seq.num_tokens - len(hits) * bm.block_size
    assert bm.allocate(seq, n, hits)
    seq.num_computed_tokens += n
    bm.cache_full_blocks(seq)
    return hits


def slot(bm: BlockManager, seq: Sequence, pos: int) -> int:
    return seq.block_table[pos // bm.block_size] * bm.block_size + pos % bm.block_size


def assert_pool_consistent(bm: BlockManager, live: list[Sequence]) -> None:
    """Each block's ref count is the number of live tables holding it; exactly the unheld ones are free."""
    holders = [0] * bm.num_blocks
    for seq in live:
        for block_id in seq.block_table:
            holders[block_id] += 1
    assert [b.ref_count for b in bm.blocks] == holders
    free = set(bm.free_empty) | set(bm.free_cached)
    assert free == {i for i, n in enumerate(holders) if n == 0}
    assert not set(bm.free_empty) & set(bm.free_cached)
    assert bm.num_free_blocks == holders.count(0)
    for block_hash, block_id in bm.hash_to_block.items():
        assert bm.blocks[block_id].block_hash == block_hash


def test_rejects_empty_pool_or_zero_block_size():
    with pytest.raises(ValueError, match="at least one block"):
        BlockManager(0, BS)
    with pytest.raises(ValueError, match="at least one block"):
        BlockManager(4, 0)


def test_block_table_grows_one_block_per_block_size_tokens():
    bm = BlockManager(8, BS)
    seq = make_seq("a", [1, 2, 3])
    compute(bm, seq, 3)
    assert len(seq.block_table) == 1
    sizes = []
    for token in range(10, 20):  # decode: one sampled token appended, then computed
        seq.append_token(token)
        compute(bm, seq, 1)
        sizes.append(len(seq.block_table))
    # 4 tokens fit in one block, the 5th opens the second, the 9th the third.
    assert sizes == [1, 2, 2, 2, 2, 3, 3, 3, 3, 4]
    assert len(seq.block_table) == bm.blocks_needed(seq.num_computed_tokens)
    assert bm.num_free_blocks == 8 - 4


def test_allocate_covers_a_whole_chunk_ahead_of_computing_it():
    bm = BlockManager(8, BS)
    seq = make_seq("a", list(range(11)))
    assert bm.allocate(seq, 11)
    assert len(seq.block_table) == 3
    assert seq.num_computed_tokens == 0  # allocating does not compute
    assert bm.num_free_blocks == 5


def test_slots_of_live_sequences_never_collide():
    bm = BlockManager(16, BS)
    seqs = [make_seq(str(i), list(range(100 * i, 100 * i + 3 + 2 * i))) for i in range(4)]
    for seq in seqs:
        compute(bm, seq, seq.num_tokens)
    for step in range(6):  # interleaved decodes, as the scheduler runs them
        for seq in seqs:
            seq.append_token(1000 + step)
            compute(bm, seq, 1)
    slots = [slot(bm, seq, pos) for seq in seqs for pos in range(seq.num_tokens)]
    assert len(slots) == len(set(slots))
    assert all(0 <= s < bm.num_blocks * BS for s in slots)
    assert_pool_consistent(bm, seqs)


def test_same_prefix_hits_in_a_second_sequence():
    bm = BlockManager(16, BS)
    prompt = list(range(1, 11))  # 10 tokens: blocks 0 and 1 full, block 2 partial
    a = make_seq("a", prompt)
    admit(bm, a)
    b = make_seq("b", [*prompt[:8], 77, 78, 79])
    hits = bm.match_prefix(b)
    assert hits == a.block_table[:2]
    assert bm.allocate(b, b.num_tokens - 8, hits)
    assert b.num_computed_tokens == 8  # the shared tokens count as computed
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] not in a.block_table
    assert [bm.blocks[i].ref_count for i in a.block_table[:2]] == [2, 2]
    assert_pool_consistent(bm, [a, b])


def test_different_token_in_block_zero_misses_every_later_block():
    bm = BlockManager(16, BS)
    prompt = list(range(1, 14))
    admit(bm, make_seq("a", prompt))
    changed = [999, *prompt[1:]]  # blocks 1 and 2 hold the same tokens, but after a different prefix
    assert bm.match_prefix(make_seq("b", changed)) == []
    changed_block_one = [*prompt[:5], 999, *prompt[6:]]
    assert len(bm.match_prefix(make_seq("c", changed_block_one))) == 1


def test_a_block_after_a_different_prefix_is_not_a_hit():
    bm = BlockManager(16, BS)
    x, y, z = [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]
    a, b = make_seq("a", [*x, *y, 0]), make_seq("b", [*z, *y, 0])
    admit(bm, a)
    admit(bm, b)
    # b's second block holds the same tokens as a's, but its K/V was computed after z, not x.
    assert bm.match_prefix(make_seq("c", [*z, *y, 0])) == b.block_table[:2]
    assert bm.match_prefix(make_seq("d", [*x, *y, 0])) == a.block_table[:2]


def test_an_evicted_prefix_can_be_cached_again():
    bm = BlockManager(2, BS)
    prompt = list(range(1, 9))
    a = make_seq("a", prompt)
    admit(bm, a)
    bm.free(a)
    hog = make_seq("hog", list(range(50, 58)))
    admit(bm, hog)  # takes, and so evicts, both of a's blocks
    assert_pool_consistent(bm, [hog])
    bm.free(hog)
    again = make_seq("again", prompt)
    assert admit(bm, again) == []  # evicted: computed from scratch ...
    bm.free(again)
    assert len(bm.match_prefix(make_seq("c", [*prompt, 0]))) == 2  # ... and cached once more


def test_hash_match_with_different_token_ids_is_not_a_hit():
    bm = BlockManager(8, BS)
    a = make_seq("a", [1, 2, 3, 4, 5])
    admit(bm, a)
    other = [9, 9, 9, 9]
    # A hash collision: the entry for ``other`` points to a block that holds a's tokens.
    bm.hash_to_block[chain_hash(0, other)] = a.block_table[0]
    assert bm.match_prefix(make_seq("b", [*other, 5])) == []
    assert bm.match_prefix(make_seq("c", [1, 2, 3, 4, 5])) == [a.block_table[0]]


def test_only_fully_computed_blocks_are_hits():
    bm = BlockManager(16, BS)
    prompt = list(range(1, 14))
    a = make_seq("a", prompt)
    assert bm.allocate(a, len(prompt))  # blocks allocated for the whole prompt, nothing computed yet
    assert bm.match_prefix(make_seq("b", prompt)) == []
    a.num_computed_tokens = 6  # first chunk: block 0 full, block 1 half written
    bm.cache_full_blocks(a)
    assert bm.match_prefix(make_seq("c", prompt)) == a.block_table[:1]
    a.num_computed_tokens = 13
    bm.cache_full_blocks(a)
    assert bm.match_prefix(make_seq("d", prompt)) == a.block_table[:3]


def test_no_hits_with_prefix_caching_disabled():
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    prompt = list(range(1, 14))
    admit(bm, make_seq("a", prompt))
    assert bm.hash_to_block == {}
    assert bm.match_prefix(make_seq("b", prompt)) == []


@pytest.mark.parametrize(("prompt_len", "expected_hits"), [(4, 0), (8, 1), (9, 2), (12, 2), (13, 3)])
def test_full_cache_hit_still_leaves_a_token_to_compute(prompt_len, expected_hits):
    bm = BlockManager(16, BS)
    prompt = list(range(1, prompt_len + 1))
    admit(bm, make_seq("a", prompt))
    assert len(bm.hash_to_block) == prompt_len // BS  # every full block of a is cached
    # The step must compute at least the last prompt token to get logits for the next one, so a
    # prompt that is an exact multiple of block_size recomputes its whole last block.
    hits = bm.match_prefix(make_seq("b", prompt))
    assert len(hits) == expected_hits
    assert 1 <= prompt_len - len(hits) * BS <= BS


def test_shared_blocks_are_reference_counted_and_outlive_one_owner():
    bm = BlockManager(8, BS)
    prompt = list(range(1, 10))
    a, b = make_seq("a", prompt), make_seq("b", prompt)
    admit(bm, a)
    admit(bm, b)
    shared = a.block_table[:2]
    assert b.block_table[:2] == shared
    assert bm.num_free_blocks == 8 - 4  # 2 shared + a's and b's own last blocks
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in shared] == [1, 1]
    assert not set(shared) & (set(bm.free_empty) | set(bm.free_cached))
    assert bm.num_free_blocks == 8 - 3
    assert_pool_consistent(bm, [b])
    bm.free(b)
    assert bm.num_free_blocks == 8
    assert_pool_consistent(bm, [])


def test_freed_blocks_keep_their_hash_and_are_revived():
    bm = BlockManager(8, BS)
    prompt = list(range(1, 10))
    a = make_seq("a", prompt)
    admit(bm, a)
    cached = a.block_table[:2]
    bm.free(a)
    assert bm.num_free_blocks == 8
    assert set(cached) <= set(bm.free_cached)
    b = make_seq("b", [*prompt[:8], 50, 51, 52, 53, 54])  # 13 tokens: 2 revived + 2 fresh blocks
    hits = bm.match_prefix(b)
    assert hits == cached
    assert bm.allocate(b, b.num_tokens - 8, hits)
    assert b.block_table[:2] == cached
    assert bm.num_free_blocks == 8 - 4
    assert [bm.blocks[i].ref_count for i in cached] == [1, 1]
    assert_pool_consistent(bm, [b])


def test_blocks_without_hash_are_handed_out_before_cached_ones():
    bm = BlockManager(4, BS)
    a = make_seq("a", list(range(1, 9)))
    admit(bm, a)  # 2 cached blocks
    cached = list(a.block_table)
    bm.free(a)
    b = make_seq("b", list(range(100, 108)))
    assert bm.allocate(b, 8)  # 2 blocks: must come from the 2 never-used ones
    assert not set(b.block_table) & set(cached)
    assert bm.match_prefix(make_seq("c", list(range(1, 10)))) == cached


def test_cached_blocks_are_evicted_least_recently_freed_first():
    bm = BlockManager(6, BS)
    old, new = make_seq("old", list(range(1, 9))), make_seq("new", list(range(101, 109)))
    scratch = make_seq("scratch", [7, 7, 7, 7, 7, 7])
    admit(bm, old)  # 2 cached blocks
    admit(bm, new)  # 2 cached blocks
    assert bm.allocate(scratch, 6)  # 2 blocks, never computed: no hash
    old_table, new_table, scratch_table = list(old.block_table), list(new.block_table), list(scratch.block_table)
    bm.free(old)
    bm.free(scratch)
    bm.free(new)
    taker = make_seq("taker", list(range(500, 524)))
    for _ in range(bm.num_blocks):
        compute(bm, taker, BS)
    # scratch's blocks (no hash) first although freed later; then old's (freed first) before new's;
    # within a sequence the tail block goes before the prefix it extends.
    assert taker.block_table == [*reversed(scratch_table), *reversed(old_table), *reversed(new_table)]
    # Handing a cached block out forgets its hash: neither prefix can be hit any more.
    assert bm.match_prefix(make_seq("old2", list(range(1, 10)))) == []
    assert bm.match_prefix(make_seq("new2", list(range(101, 110)))) == []
    assert bm.num_free_blocks == 0


def test_most_recently_freed_prefix_survives_eviction():
    bm = BlockManager(4, BS)
    old_prompt, new_prompt = list(range(1, 9)), list(range(101, 109))
    old, new = make_seq("old", old_prompt), make_seq("new", new_prompt)
    admit(bm, old)
    admit(bm, new)
    bm.free(old)
    bm.free(new)
    assert bm.num_free_blocks == 4 and not bm.free_empty
    compute(bm, make_seq("taker", [500, 501, 502]), 3)  # one block: old's tail is evicted
    assert len(bm.match_prefix(make_seq("new2", [*new_prompt, 0]))) == 2
    assert len(bm.match_prefix(make_seq("old2", [*old_prompt, 0]))) == 1


def test_reviving_a_prefix_makes_it_the_most_recent():
    bm = BlockManager(5, BS)
    old_prompt, new_prompt = list(range(1, 9)), list(range(101, 109))
    old, new = make_seq("old", old_prompt), make_seq("new", new_prompt)
    admit(bm, old)
    admit(bm, new)
    bm.free(old)
    bm.free(new)  # new is now the more recently freed prefix
    again = make_seq("again", [*old_prompt, 0])
    assert len(admit(bm, again)) == 2  # revives old's blocks
    bm.free(again)  # ... and frees them after new's
    compute(bm, make_seq("taker", list(range(500, 508))), 8)  # two blocks: the unhashed one, then new's tail
    assert len(bm.match_prefix(make_seq("old2", [*old_prompt, 0]))) == 2
    assert len(bm.match_prefix(make_seq("new2", [*new_prompt, 0]))) == 1


def test_allocate_without_room_returns_false_and_changes_nothing():
    bm = BlockManager(3, BS)
    a = make_seq("a", list(range(1, 9)))
    admit(bm, a)  # 2 blocks, both cached
    b = make_seq("b", list(range(100, 109)))
    assert not bm.allocate(b, 9)  # needs 3, 1 free
    assert b.block_table == [] and b.num_computed_tokens == 0 and b.block_hashes == []
    assert bm.num_free_blocks == 1
    assert_pool_consistent(bm, [a])
    # Growing a sequence that already holds blocks fails the same way: 13 tokens need 2 more blocks.
    assert not bm.allocate(a, 5)
    assert len(a.block_table) == 2 and a.num_computed_tokens == 8
    assert_pool_consistent(bm, [a])


def test_failed_allocate_with_prefix_hits_does_not_revive_them():
    bm = BlockManager(3, BS)
    prompt = list(range(1, 9))
    a = make_seq("a", prompt)
    admit(bm, a)
    cached = list(a.block_table)
    bm.free(a)
    hog = make_seq("hog", [5])
    assert bm.allocate(hog, 1)  # takes the never-used block; a's 2 cached blocks stay free
    b = make_seq("b", [*prompt, 20, 21, 22, 23, 24])  # 13 tokens: 2 hits + 2 fresh blocks, only 2 free
    hits = bm.match_prefix(b)
    assert hits == cached
    assert not bm.allocate(b, b.num_tokens - 8, hits)
    assert b.block_table == [] and b.num_computed_tokens == 0 and b.block_hashes == []
    assert bm.num_free_blocks == 2
    assert all(bm.blocks[i].ref_count == 0 for i in hits)
    assert bm.match_prefix(make_seq("c", b.token_ids)) == hits  # still cached
    assert_pool_consistent(bm, [hog])


def test_every_block_returns_after_all_sequences_are_freed():
    bm = BlockManager(64, BS)
    live = []
    base = list(range(1, 20))
    for i in range(8):  # shared prefixes of varying length, some partial blocks
        seq = make_seq(str(i), base[: 3 + 2 * i] + [1000 + i] * (i % 3))
        admit(bm, seq)
        for t in range(i):
            seq.append_token(2000 + t)
            compute(bm, seq, 1)
        live.append(seq)
        assert_pool_consistent(bm, live)
    for seq in live[::2] + live[1::2]:
        bm.free(seq)
        assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert_pool_consistent(bm, [])


def test_freeing_twice_is_caught():
    bm = BlockManager(4, BS)
    a = make_seq("a", [1, 2, 3])
    compute(bm, a, 3)
    table = list(a.block_table)
    bm.free(a)
    a.block_table = table  # a stale table, as a double free would present it
    with pytest.raises(AssertionError, match="freed twice"):
        bm.free(a)
