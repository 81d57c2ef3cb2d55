"""The block manager's recurrent-state snapshots (engine/block_manager.py): a model with recurrent layers keeps
copies of a sequence's state at cached block boundaries, each with group 0's block that ends there, and a prefix hit
restores one instead of recomputing the prefix (engine/state_slots.py holds the slots)."""

from __future__ import annotations

from nanostream.engine.blocks import Block
from nanostream.engine.sequence import Sequence
from nanostream.engine.state_slots import ZERO, ChunkState, StateSlots


class StatePlans:
    """What ``BlockManager`` does with the state slots of a model with recurrent layers (``states``: None for
    any other): which snapshots a chunk takes (``plan_state``), and which block keeps each."""

    blocks: list[Block]
    block_size: int
    enable_prefix_caching: bool
    snapshot_interval: int
    states: StateSlots | None

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
            # tail take over the slot of this sequence's own latest snapshot still waiting: this copy lands after
            # the earlier one (a later step, or later in this chunk), and the earlier boundary is never cached.
            last_tail = seq.tail_snapshot[0] if seq.tail_snapshot else None
            own = max((b for b in seq.pending_snapshots if b < boundary and b != last_tail), default=None)
            if own is not None:
                taken = seq.pending_snapshots.pop(own), None
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

    def _keep_snapshot(self, slot: int, block_id: int | None) -> None:
        block = None if block_id is None else self.blocks[block_id]
        if block is None or block.snapshot is not None:  # not cached, or it has one already
            self.states.release(slot)
        else:
            block.snapshot = slot
            self.states.hold(slot, block.block_id)
