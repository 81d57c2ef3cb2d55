"""A KV pool block's record and the chained hash that names a full block's tokens (engine/block_manager.py)."""

from __future__ import annotations

from array import array

import xxhash


def chain_hash(prev_hash: int, token_ids: list[int]) -> int:
    """Hash of a full block, chained over every token before it through ``prev_hash``."""
    data = prev_hash.to_bytes(8, "little") + array("q", token_ids).tobytes()
    return xxhash.xxh3_64_intdigest(data)


class Block:
    __slots__ = ("block_hash", "block_id", "group", "ref_count", "snapshot", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.group = 0  # the KV group whose cache holds its hash
        self.ref_count = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] = ()
        self.snapshot: int | None = None  # the state slot holding the recurrent layers' state at its end
