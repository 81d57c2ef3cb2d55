"""Paged KV-cache blocks with prefix caching.

A sequence owns a block table; token ``i`` of a sequence lives in slot
``block_table[i // block_size] * block_size + i % block_size`` of the KV pool.

Prefix caching: once every token of a full block has been computed, the block is registered under
a hash chained over all tokens up to and including it (xxhash of the previous block's hash and this
block's token ids). A new sequence reuses the leading blocks whose hash *and* token ids match.
A freed block keeps its hash and contents until the block is handed out again; free blocks are
handed out least-recently-freed first, so the most recently used prefixes survive longest.

A layer with a sliding window or an attention chunk reads only a sequence's last ``window`` tokens' KV at most
(its reach): the blocks behind it go back to the pool as the sequence advances (their ids stay in its table, never
read again), cached as a finished sequence's are. Where the layers reach back differently (Llama 4's chunked and
global layers, Gemma 3's or gpt-oss's sliding and full ones), they are in KV groups (``groups``: each group's reach,
engine/runner/cache_pool.py's ``CacheLayout`` makes them): a sequence has a block table per group, all as long, and
a block id names one group's storage (its layers' slots), so a group gives its blocks back by its own reach while a
full-attention group keeps its. Each group caches its own blocks under the same chained hashes; a prefix hit is
taken up to where every group still has the blocks that the remaining queries read (a windowed group: those within
reach of the first of them).

A model with recurrent layers (``states``: engine/state_slots.py) also gives each running sequence a live state
slot, and a cached prefix is reused only up to its last block that holds a snapshot of the state there: a
block's snapshot goes with it when it is handed out again.
"""

from __future__ import annotations

from itertools import accumulate

from nanostream.engine.blocks import Block, chain_hash
from nanostream.engine.sequence import Sequence
from nanostream.engine.state_plans import StatePlans
from nanostream.engine.state_slots import StateSlots


class BlockManager(StatePlans):
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        states: StateSlots | None = None,
        snapshot_interval: int = 0,
        window: int | None = None,
        max_chunk: int = 1,
        groups: tuple[int | None, ...] | None = None,
    ) -> None:
        """``states``: the state slots of a model with recurrent layers; ``snapshot_interval``: the tokens between
        its snapshots (a multiple of ``block_size``); ``window``: every attention layer's sliding window is at
        most this (None: some layer attends to the whole context); ``max_chunk``: the most tokens of a step;
        ``groups``: instead of ``window``, each KV group's reach (None: full attention), group 0's first."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.states = states
        self.snapshot_interval = snapshot_interval or 4 * block_size
        self.reaches = (window,) if groups is None else tuple(groups)
        self.window = None if None in self.reaches else max(self.reaches)  # the longest reach, if every group has one
        self.max_chunk = max_chunk
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.cached: list[dict[int, int]] = [{} for _ in self.reaches]  # per group: block hash -> block id
        self.hash_to_block = self.cached[0]
        # Free blocks as ordered sets (dicts) with O(1) removal. Blocks holding nothing reusable are
        # handed out first; cached ones after, least recently freed first.
        self.free_empty: dict[int, None] = dict.fromkeys(range(num_blocks))
        self.free_cached: dict[int, None] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_empty) + len(self.free_cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def most_blocks_held(self, num_tokens: int) -> int:
        """The most blocks a sequence of ``num_tokens`` holds at once, over its groups: all of them, or with a
        reach, those of the reach and of two chunks (one scheduled while the one before is still on the device)."""
        n, bs = self.blocks_needed(num_tokens), self.block_size
        return sum(n if r is None else min(n, (r - 1 + 2 * self.max_chunk) // bs + 2) for r in self.reaches)

    def match_prefix(self, seq: Sequence) -> list[int] | list[tuple[int | None, ...]]:
        """The leading cached blocks that hold exactly this sequence's tokens: their ids (with several KV groups, a
        tuple of each group's), None where a group's queries from the hit's end on read none of that block.

        At least one token is always left to compute, so the step produces logits for the sequence.
        """
        if not self.enable_prefix_caching:
            return []
        bs, found = self.block_size, [[] for _ in self.reaches]  # per group: each block's cached id or None
        full = [g for g, r in enumerate(self.reaches) if r is None]
        prev = 0
        for i in range((seq.num_tokens - 1) // bs):
            tokens = seq.block_key(i, bs)
            prev = chain_hash(prev, tokens)
            for g, cache in enumerate(self.cached):
                block_id = cache.get(prev)
                same = block_id is not None and self.blocks[block_id].token_ids == tuple(tokens)
                found[g].append(block_id if same else None)
            if any(found[g][i] is None for g in full):  # no hit past a full group's first miss
                break
        misses = [list(accumulate((b is None for b in f), initial=0)) for f in found]  # misses[g][i]: in blocks < i
        k = len(found[0])
        while k and not self._hit(k, misses, found[0][k - 1]):
            k -= 1
        hits = [[None if i < self._behind(g, k * bs) else f[i] for i in range(k)] for g, f in enumerate(found)]
        return hits[0] if len(hits) == 1 else list(zip(*hits))

    def _hit(self, k: int, misses: list[list[int]], last: int | None) -> bool:
        """Every group has the blocks < k that a query at k * block_size reads, and a recurrent model's state there."""
        ok = all(m[k] == m[self._behind(g, k * self.block_size)] for g, m in enumerate(misses))
        return ok and (self.states is None or (last is not None and self.blocks[last].snapshot is not None))

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix_hits: list = ()) -> bool:
        """Give ``seq`` the blocks to hold ``num_new_tokens`` more computed tokens.

        ``prefix_hits`` (from ``match_prefix``, only for a sequence with no blocks yet) are shared
        instead of recomputed. Returns False, changing nothing, when too few blocks are free.
        """
        tables = seq.block_tables
        if not prefix_hits and seq.num_computed_tokens + num_new_tokens <= len(tables[0]) * self.block_size:
            return True  # the common case, a decode row inside its last block: nothing to allocate
        num_groups = len(self.reaches)
        if not tables[0] and len(tables) != num_groups:  # a new sequence (or a freed one): a table per group
            tables = [[] for _ in self.reaches]
        if prefix_hits:
            assert not tables[0] and seq.num_computed_tokens == 0
        hits = [list(prefix_hits)] if num_groups == 1 else [list(h) for h in zip(*prefix_hits)]
        have = len(tables[0]) + len(prefix_hits)
        computed = seq.num_computed_tokens + len(prefix_hits) * self.block_size
        # the hits no query of a group reads are not taken (their ids, if any, stay in its table: stale, unread)
        behind = [self._behind(g, computed) if prefix_hits else 0 for g in range(num_groups)]
        revived = sum(self.blocks[b].ref_count == 0 for g, h in enumerate(hits) for b in h[behind[g] :])
        fresh = max(0, self.blocks_needed(computed + num_new_tokens) - have)
        if revived + fresh * num_groups > self.num_free_blocks:
            return False
        if tables is not seq.block_tables:
            seq.block_tables, seq.released = tables, behind
        if prefix_hits:
            seq.released = behind
            seq.block_hashes = self._chained_hashes(seq, len(prefix_hits))
        for g, table in enumerate(tables):
            for i, block_id in enumerate(hits[g] if prefix_hits else ()):
                if i < behind[g]:
                    table.append(0 if block_id is None else block_id)
                    continue
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self.free_cached[block_id]
                block.ref_count += 1
                table.append(block_id)
        for table in tables:  # (after every group's hits are out of the free blocks)
            table.extend(self._take_free_block() for _ in range(fresh))
        seq.num_computed_tokens = computed
        if self.states is not None and seq.state_slot is None:
            seq.state_slot = self.states.take_live()
            if prefix_hits:
                seq.state_restore = self.blocks[hits[0][-1]].snapshot
                self.states.touch(seq.state_restore)
        return True

    def _chained_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        hashes, prev, bs = [], 0, self.block_size
        for i in range(num_blocks):
            prev = chain_hash(prev, seq.block_key(i, bs))
            hashes.append(prev)
        return hashes

    def _take_free_block(self) -> int:
        pool = self.free_empty or self.free_cached
        block_id = next(iter(pool))
        del pool[block_id]
        block = self.blocks[block_id]
        cache = self.cached[block.group]
        if block.block_hash is not None and cache.get(block.block_hash) == block_id:
            del cache[block.block_hash]
        block.block_hash, block.token_ids, block.ref_count = None, (), 1
        if block.snapshot is not None:
            self.states.release(block.snapshot)
            block.snapshot = None
        return block_id

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks of ``seq`` that became full and computed since the last call, in each group."""
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= len(seq.block_hashes) or not self.enable_prefix_caching:  # (most steps of a decode row)
            return
        for i in range(len(seq.block_hashes), num_full):
            tokens = seq.block_key(i, self.block_size)
            block_hash = chain_hash(seq.block_hashes[-1] if seq.block_hashes else 0, tokens)
            seq.block_hashes.append(block_hash)
            for g, cache in enumerate(self.cached):
                block = self.blocks[seq.block_tables[g][i]]
                if i >= seq.released[g] and block.block_hash is None and block_hash not in cache:
                    block.block_hash, block.token_ids, block.group = block_hash, tuple(tokens), g
                    cache[block_hash] = block.block_id
            slot = seq.pending_snapshots.pop((i + 1) * self.block_size, None)
            if slot is not None:  # the state at this block's end: kept with group 0's block that holds its hash
                self._keep_snapshot(slot, self.hash_to_block.get(block_hash))

    def release_behind_window(self, seq: Sequence) -> None:
        """Give back the blocks of ``seq`` that hold only tokens before every window of its next queries, in each
        group (after ``cache_full_blocks``: they are cached first). A step still on the device that reads one runs
        before any step that writes it again."""
        for g, table in enumerate(seq.block_tables):
            behind = self._behind(g, seq.num_computed_tokens)
            for block_id in table[seq.released[g] : behind]:
                self._release(block_id)
            seq.released[g] = max(seq.released[g], behind)

    def _behind(self, group: int, num_computed: int) -> int:
        """The leading blocks of ``group`` that no query from position ``num_computed`` on reads (it sees keys
        after its position - reach); 0 for full attention."""
        reach = self.reaches[group]
        return 0 if reach is None else max(0, num_computed - reach + 1) // self.block_size

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq``; its computed state is forgotten."""
        # Tail blocks first, so a shared prefix outlives the blocks that extend it.
        for table, released in zip(seq.block_tables, seq.released, strict=True):
            for block_id in reversed(table[released:]):
                self._release(block_id)
        # new lists, not cleared: a tensor-parallel mirror of the old ones sees them replaced
        seq.block_tables, seq.released = [[] for _ in self.reaches], [0] * len(self.reaches)
        seq.block_hashes.clear()
        seq.num_computed_tokens = 0
        if seq.state_slot is not None:
            self.states.release_live(seq.state_slot)
            for slot in seq.pending_snapshots.values():  # taken for a step that will not be cached now
                self.states.release(slot)
            seq.state_slot, seq.state_restore, seq.tail_snapshot = None, None, None
            seq.pending_snapshots.clear()

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            (self.free_empty if block.block_hash is None else self.free_cached)[block_id] = None
