"""Paged KV-cache blocks with prefix caching.

A sequence owns a block table; token ``i`` of a sequence lives in slot
``block_table[i // block_size] * block_size + i % block_size`` of the KV pool.

Prefix caching: once every token of a full block has been computed, the block is registered under
a hash chained over all tokens up to and including it (xxhash of the previous block's hash and this
block's token ids). A new sequence reuses the leading blocks whose hash *and* token ids match.
A freed block keeps its hash and contents until the block is handed out again; free blocks are
handed out least-recently-freed first, so the most recently used prefixes survive longest.

A model whose every attention layer has a sliding window (``window``) reads only a sequence's last ``window``
tokens' KV: the blocks behind it go back to the pool as the sequence advances (their ids stay in its table, never
read again), cached as a finished sequence's are.

A model with recurrent layers (``states``: engine/state_slots.py) also gives each running sequence a live state
slot, and a cached prefix is reused only up to its last block that holds a snapshot of the state there: a
block's snapshot goes with it when it is handed out again.
"""

from __future__ import annotations

from array import array

import xxhash

from nanostream.engine.sequence import Sequence
from nanostream.engine.state_slots import ZERO, ChunkState, StateSlots


def chain_hash(prev_hash: int, token_ids: list[int]) -> int:
    """Hash of a full block, chained over every token before it through ``prev_hash``."""
    data = prev_hash.to_bytes(8, "little") + array("q", token_ids).tobytes()
    return xxhash.xxh3_64_intdigest(data)


class Block:
    __slots__ = ("block_hash", "block_id", "ref_count", "snapshot", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] = ()
        self.snapshot: int | None = None  # the state slot holding the recurrent layers' state at its end


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        states: StateSlots | None = None,
        snapshot_interval: int = 0,
        window: int | None = None,
        max_chunk: int = 1,
    ) -> None:
        """``states``: the state slots of a model with recurrent layers; ``snapshot_interval``: the tokens between
        its snapshots (a multiple of ``block_size``); ``window``: every attention layer's sliding window is at
        most this (None: some layer attends to the whole context); ``max_chunk``: the most tokens of a step."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.states = states
        self.snapshot_interval = snapshot_interval or 4 * block_size
        self.window, self.max_chunk = window, max_chunk
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block: dict[int, int] = {}
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
        """The most blocks a sequence of ``num_tokens`` holds at once: all of them, or with a window, those of the
        window and of two chunks (one scheduled while the one before is still on the device)."""
        if self.window is None:
            return self.blocks_needed(num_tokens)
        return min(self.blocks_needed(num_tokens), (self.window - 1 + 2 * self.max_chunk) // self.block_size + 2)

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Ids of the leading cached blocks that hold exactly this sequence's tokens.

        At least one token is always left to compute, so the step produces logits for the sequence.
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        prev = 0
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
            prev = chain_hash(prev, tokens)
            block_id = self.hash_to_block.get(prev)
            if block_id is None or self.blocks[block_id].token_ids != tuple(tokens):
                break
            hits.append(block_id)
        if self.states is not None:  # the state is restored from the last hit's snapshot: none, no hit there
            while hits and self.blocks[hits[-1]].snapshot is None:
                hits.pop()
        return hits

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix_hits: list[int] = ()) -> bool:
        """Give ``seq`` the blocks to hold ``num_new_tokens`` more computed tokens.

        ``prefix_hits`` (from ``match_prefix``, only for a sequence with no blocks yet) are shared
        instead of recomputed. Returns False, changing nothing, when too few blocks are free.
        """
        if not prefix_hits and seq.num_computed_tokens + num_new_tokens <= len(seq.block_table) * self.block_size:
            return True  # the common case, a decode row inside its last block: nothing to allocate
        if prefix_hits:
            assert not seq.block_table and seq.num_computed_tokens == 0
        have = len(seq.block_table) + len(prefix_hits)
        computed = seq.num_computed_tokens + len(prefix_hits) * self.block_size
        behind = self._behind_window(computed) if prefix_hits else 0  # hits no query of it reads: not taken
        revived = sum(1 for b in prefix_hits[behind:] if self.blocks[b].ref_count == 0)
        fresh = max(0, self.blocks_needed(computed + num_new_tokens) - have)
        if revived + fresh > self.num_free_blocks:
            return False
        if behind:
            seq.block_table.extend(prefix_hits[:behind])
            seq.block_hashes.extend(self.blocks[b].block_hash for b in prefix_hits[:behind])
            seq.released_blocks = behind
        for block_id in prefix_hits[behind:]:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_cached[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            seq.block_hashes.append(block.block_hash)
        seq.num_computed_tokens = computed
        for _ in range(fresh):
            seq.block_table.append(self._take_free_block())
        if self.states is not None and seq.state_slot is None:
            seq.state_slot = self.states.take_live()
            if prefix_hits:
                seq.state_restore = self.blocks[prefix_hits[-1]].snapshot
                self.states.touch(seq.state_restore)
        return True

    def _take_free_block(self) -> int:
        pool = self.free_empty or self.free_cached
        block_id = next(iter(pool))
        del pool[block_id]
        block = self.blocks[block_id]
        if block.block_hash is not None and self.hash_to_block.get(block.block_hash) == block_id:
            del self.hash_to_block[block.block_hash]
        block.block_hash, block.token_ids, block.ref_count = None, (), 1
        if block.snapshot is not None:
            self.states.release(block.snapshot)
            block.snapshot = None
        return block_id

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks of ``seq`` that became full and computed since the last call."""
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= len(seq.block_hashes) or not self.enable_prefix_caching:  # (most steps of a decode row)
            return
        for i in range(len(seq.block_hashes), num_full):
            tokens = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
            block_hash = chain_hash(seq.block_hashes[-1] if seq.block_hashes else 0, tokens)
            seq.block_hashes.append(block_hash)
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None and block_hash not in self.hash_to_block:
                block.block_hash, block.token_ids = block_hash, tuple(tokens)
                self.hash_to_block[block_hash] = block.block_id
            slot = seq.pending_snapshots.pop((i + 1) * self.block_size, None)
            if slot is not None:  # the state at this block's end: kept with the block that holds its hash
                self._keep_snapshot(slot, self.hash_to_block.get(block_hash))

    def _keep_snapshot(self, slot: int, block_id: int | None) -> None:
        block = None if block_id is None else self.blocks[block_id]
        if block is None or block.snapshot is not None:  # not cached, or it has one already
            self.states.release(slot)
        else:
            block.snapshot = slot
            self.states.hold(slot, block.block_id)

    def release_behind_window(self, seq: Sequence) -> None:
        """Give back the blocks of ``seq`` that hold only tokens before every window of its next queries (after
        ``cache_full_blocks``: they are cached first). A step still on the device that reads one runs before any
        step that writes it again."""
        behind = self._behind_window(seq.num_computed_tokens)
        for block_id in seq.block_table[seq.released_blocks : behind]:
            self._release(block_id)
        seq.released_blocks = max(seq.released_blocks, behind)

    def _behind_window(self, num_computed: int) -> int:
        """The leading blocks that no query from position ``num_computed`` on reads (it sees keys after its
        position - window); 0 without a window."""
        return 0 if self.window is None else max(0, num_computed - self.window + 1) // self.block_size

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq``; its computed state is forgotten."""
        # Tail blocks first, so a shared prefix outlives the blocks that extend it.
        for block_id in reversed(seq.block_table[seq.released_blocks :]):
            self._release(block_id)
        seq.block_table = []  # a new list, not cleared: a tensor-parallel mirror of the old one sees it replaced
        seq.released_blocks = 0
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

    def plan_state(self, seq: Sequence, start: int, num_new_tokens: int) -> ChunkState | None:
        """What the chunk of ``seq``'s tokens [start, start + num_new_tokens) does with its state (after
        ``allocate``): where it starts from, and the snapshots it takes for the prefix cache; None for a model
        without recurrent layers."""
        if self.states is None:
            return None
        init = ZERO if start == 0 else seq.state_restore
        seq.state_restore = None
        end = start + num_new_tokens
        snapshots = []
        if self.enable_prefix_caching:
            for boundary, tail in self._boundaries(seq, start, end):
                slot = self._take_snapshot(seq, boundary, tail)
                if slot is not None:  # (a slot taken back from an earlier boundary of this chunk: the later copy)
                    snapshots = [(n, s) for n, s in snapshots if s != slot] + [(boundary - start, slot)]
        return ChunkState(seq.state_slot, init, tuple(snapshots))

    def _boundaries(self, seq: Sequence, start: int, end: int) -> list[tuple[int, bool]]:
        """The block ends in (start, end] whose state the prefix cache keeps, each with whether it is a decode
        tail (one per sequence: the next replaces it)."""
        bs, interval = self.block_size, self.snapshot_interval
        ends = set(range((start // interval + 1) * interval, end + 1, interval))
        prompt_end = seq.num_prompt_tokens // bs * bs  # the prompt's last full block
        if start < prompt_end <= end:
            ends.add(prompt_end)
        out = [(b, False) for b in sorted(ends)]
        if end > seq.num_prompt_tokens and end % bs == 0 and end not in ends:
            out.append((end, True))
        return out

    def _take_snapshot(self, seq: Sequence, boundary: int, tail: bool) -> int | None:
        in_use = lambda b: self.blocks[b].ref_count > 0
        taken = self.states.take_snapshot(in_use)
        if taken is None and (tail or boundary == seq.num_prompt_tokens // self.block_size * self.block_size):
            # Every slot waits for its step. The prompt's end (what the conversation's next turn hits) and a decode
            # tail go before this sequence's own latest snapshot still waiting: a step copies into the slot
            # after the earlier step's copy, and the earlier boundary is never cached.
            last_tail = seq.tail_snapshot[0] if seq.tail_snapshot else None
            own = max((b for b in seq.pending_snapshots if b < boundary and b != last_tail), default=None)
            if own is not None:
                self.states.release(seq.pending_snapshots.pop(own))
                taken = self.states.take_snapshot(in_use)
        if taken is None:
            return None
        slot, evicted = taken
        if evicted is not None:
            self.blocks[evicted].snapshot = None
        if boundary > seq.num_prompt_tokens and seq.tail_snapshot is not None:  # its decode tail: superseded
            self._drop_snapshot(seq, *seq.tail_snapshot)
            seq.tail_snapshot = None
        if tail:
            seq.tail_snapshot = (boundary, slot)
        seq.pending_snapshots[boundary] = slot
        return slot

    def _drop_snapshot(self, seq: Sequence, boundary: int, slot: int) -> None:
        if seq.pending_snapshots.get(boundary) == slot:  # its step has not been cached yet
            del seq.pending_snapshots[boundary]
            self.states.release(slot)
            return
        index = boundary // self.block_size - 1
        block = self.blocks[seq.block_table[index]] if index < len(seq.block_table) else None
        if block is not None and block.snapshot == slot:  # still kept with the sequence's own block
            block.snapshot = None
            self.states.release(slot)
