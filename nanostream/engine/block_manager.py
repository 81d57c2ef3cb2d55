"""Paged KV-cache blocks with prefix caching.

A sequence owns a block table; token ``i`` of a sequence lives in slot
``block_table[i // block_size] * block_size + i % block_size`` of the KV pool.

Prefix caching: once every token of a full block has been computed, the block is registered under
a hash chained over all tokens up to and including it (xxhash of the previous block's hash and this
block's token ids). A new sequence reuses the leading blocks whose hash *and* token ids match.
A freed block keeps its hash and contents until the block is handed out again; free blocks are
handed out least-recently-freed first, so the most recently used prefixes survive longest.
"""

from __future__ import annotations

from array import array

import xxhash

from nanostream.engine.sequence import Sequence


def chain_hash(prev_hash: int, token_ids: list[int]) -> int:
    """Hash of a full block, chained over every token before it through ``prev_hash``."""
    data = prev_hash.to_bytes(8, "little") + array("q", token_ids).tobytes()
    return xxhash.xxh3_64_intdigest(data)


class Block:
    __slots__ = ("block_hash", "block_id", "ref_count", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
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
        revived = sum(1 for b in prefix_hits if self.blocks[b].ref_count == 0)
        have = len(seq.block_table) + len(prefix_hits)
        computed = seq.num_computed_tokens + len(prefix_hits) * self.block_size
        fresh = max(0, self.blocks_needed(computed + num_new_tokens) - have)
        if revived + fresh > self.num_free_blocks:
            return False
        for block_id in prefix_hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_cached[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            seq.block_hashes.append(block.block_hash)
        seq.num_computed_tokens = computed
        for _ in range(fresh):
            seq.block_table.append(self._take_free_block())
        return True

    def _take_free_block(self) -> int:
        pool = self.free_empty or self.free_cached
        block_id = next(iter(pool))
        del pool[block_id]
        block = self.blocks[block_id]
        if block.block_hash is not None and self.hash_to_block.get(block.block_hash) == block_id:
            del self.hash_to_block[block.block_hash]
        block.block_hash, block.token_ids, block.ref_count = None, (), 1
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

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq``; its computed state is forgotten."""
        # Tail blocks first, so a shared prefix outlives the blocks that extend it.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                (self.free_empty if block.block_hash is None else self.free_cached)[block_id] = None
        seq.block_table = []  # a new list, not cleared: a tensor-parallel mirror of the old one sees it replaced
        seq.block_hashes.clear()
        seq.num_computed_tokens = 0
