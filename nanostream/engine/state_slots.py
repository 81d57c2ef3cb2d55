"""The state pool's slots, for models with recurrent layers (Gated DeltaNet): plain Python, as the block manager.

A recurrent layer keeps a fixed-size state per sequence in a slot of the state pool (engine/runner/cache_pool.py),
the same slot id in every such layer. Slots 0 .. num_live - 1 are live: a running sequence holds one from
admission to its finish or preemption. The others are snapshots: a copy of a sequence's state at the end of a
block, kept by the prefix cache with that block (``Block.snapshot``). A prompt that starts with cached blocks is
computed from the last of them that has a snapshot, the snapshot copied into its live slot.

Snapshots are taken (``ChunkState.snapshots``) at every multiple of the snapshot interval, at the end of the
prompt's last full block, and at the end of each block a sequence completes while decoding (replacing the one
before: a finished request leaves its last full block's state, which the next turn of its conversation starts
from). One is freed with its block, or when snapshots run out, least recently used first (a block no running
sequence holds before one that some does).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from nanostream.config import EngineConfig

log = logging.getLogger(__name__)

ZERO = -1
"""``ChunkState.init`` of a fresh sequence: its live slot is zeroed before the chunk."""


@dataclass(frozen=True)
class ChunkState:
    """What one scheduled chunk does with its sequence's state."""

    slot: int  # the sequence's live slot
    init: int | None  # before the chunk: ZERO, a snapshot slot to copy from (a prefix hit), or None (go on)
    snapshots: tuple[tuple[int, int], ...] = ()  # (n, slot): after the chunk's first n tokens, copy into slot


class StateSlots:
    """Free live slots, free snapshot slots, and the snapshots the prefix cache holds by block."""

    def __init__(self, num_live: int, num_snapshots: int) -> None:
        if num_live < 1 or num_snapshots < 0:
            raise ValueError(f"need a live state slot at least, got {num_live} live and {num_snapshots} snapshots")
        self.num_live, self.num_snapshots = num_live, num_snapshots
        self.free_live = list(range(num_live - 1, -1, -1))  # a stack: slot 0 first
        self.free_snapshots = list(range(num_live + num_snapshots - 1, num_live - 1, -1))
        self.held: dict[int, int] = {}  # snapshot slot -> its block id, least recently used first

    @classmethod
    def of_model(cls, config: EngineConfig, num_snapshots: int, slot_bytes: int) -> StateSlots | None:
        """The slots of a model whose recurrent layers keep ``slot_bytes`` a sequence (None: it has none), logged:
        max_num_seqs live ones and ``num_snapshots``."""
        if not slot_bytes:
            return None
        log.info(
            "recurrent state: %d sequences' live states and %d prefix-cache snapshots (one every %d tokens, at "
            "prompt ends and decode tails), %.2f MiB each",
            config.max_num_seqs, num_snapshots, config.state_snapshot_interval, slot_bytes / 2**20,
        )  # fmt: skip
        return cls(config.max_num_seqs, num_snapshots)

    @property
    def num_slots(self) -> int:
        return self.num_live + self.num_snapshots

    def take_live(self) -> int:
        assert self.free_live, "more running sequences than live state slots"
        return self.free_live.pop()

    def release_live(self, slot: int) -> None:
        assert slot < self.num_live and slot not in self.free_live, slot
        self.free_live.append(slot)

    def take_snapshot(self, in_use: Callable[[int], bool]) -> tuple[int, int | None] | None:
        """A snapshot slot for a new copy, and the block whose snapshot it was (None: it was free); None when
        every snapshot slot waits for its step. ``in_use(block_id)``: a running sequence holds the block."""
        if self.free_snapshots:
            return self.free_snapshots.pop(), None
        if not self.held:
            return None
        slot = next((s for s, b in self.held.items() if not in_use(b)), next(iter(self.held)))
        return slot, self.held.pop(slot)

    def hold(self, slot: int, block_id: int) -> None:
        """The prefix cache keeps snapshot ``slot`` with block ``block_id``."""
        self.held[slot] = block_id

    def touch(self, slot: int) -> None:
        """A hit read it: it is the most recently used."""
        self.held[slot] = self.held.pop(slot)

    def release(self, slot: int) -> int | None:
        """Snapshot ``slot`` is free again; the block that held it, if one did."""
        block = self.held.pop(slot, None)
        assert slot >= self.num_live and slot not in self.free_snapshots, slot
        self.free_snapshots.append(slot)
        return block
