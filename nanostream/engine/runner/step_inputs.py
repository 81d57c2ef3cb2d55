"""Packing a step's chunks into one varlen batch on the device: token ids, positions, attention metadata.

A chunk is what the scheduler hands the runner (``scheduler.ScheduledChunk`` is one): which tokens of
which sequence to compute. Host lists go up through pinned memory, one copy per dtype, so the step's
only host synchronisation is reading its samples back. That memory is an ``Uploads`` arena, owned by the
model runner (one per runner): every upload of its steps goes through it (``uploads=``); without one a
list goes up on its own (``torch.tensor``), as a test or a benchmark may send it.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Protocol

import torch

from nanostream.engine.runner.sampler import SamplerOutput
from nanostream.engine.sequence import PENDING, Sequence
from nanostream.engine.state_slots import ZERO, ChunkState
from nanostream.layers.attention_backend import AttentionMetadata
from nanostream.layers.cache_spec import StateMetadata
from nanostream.models.placeholder_embeds import PlaceholderEmbeds


class Chunk(Protocol):
    """What the runner reads of one scheduled chunk."""

    @property
    def seq(self) -> Sequence: ...
    @property
    def start(self) -> int: ...  # seq.num_computed_tokens when scheduled: the chunk's first token
    @property
    def num_new_tokens(self) -> int: ...
    @property
    def samples(self) -> bool: ...  # the chunk reaches the sequence's end: the step samples a token
    @property
    def state(self) -> ChunkState | None: ...  # a model with recurrent layers: where its state starts, snapshots


class PendingSource(Protocol):
    """The step in flight, whose samples are the values of this step's PENDING tokens."""

    rows: dict[str, int]  # request id -> row of its sample
    out: SamplerOutput | None  # its token_ids [B], on the device, hold the pending tokens' values


class StepInputs(NamedTuple):
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_rows: list[int]  # rows of the hidden states whose logits are sampled (chunks that reach the end)
    states: StateMetadata | None = None  # the recurrent layers' (``pack_states``), where the runner asks
    embeds: PlaceholderEmbeds | None = None  # image rows over their placeholder tokens (image_rows.py)


class Uploads:
    """Host memory for one runner's copies up to its device, reused step after step, so that a step's
    uploads cost a fill (numpy's, ~4x faster than ``torch.tensor`` from a list) and a copy, not a pinned
    allocation each. Two halves: a step's uploads come from one (``new_step`` switches), and a half is
    filled again only once the device is past every copy from it (an event recorded at the switch).
    Pinned on CUDA, where the copies are asynchronous; plain on the CPU, where they are not.

    One runner's steps run one after another on one thread; two runners (two engines in a process) each
    have their own, so neither waits on the other's device work::

        uploads = Uploads(device)
        uploads.new_step()
        ids = to_device(token_ids, torch.int64, device, uploads)"""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self.halves = [self._memory(1 << 20), self._memory(1 << 20)]
        self.done = [torch.cuda.Event() if self.pinned else None for _ in range(2)]
        self.half = self.offset = self.wanted = 0

    def _memory(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)

    def new_step(self) -> None:
        """A step starts: its uploads go to the half that the device is done with."""
        if self.pinned:
            self.done[self.half].record()  # after every copy queued from this half
        self.half ^= 1
        if self.pinned:
            self.done[self.half].synchronize()  # the device is past the copies from the other one
        if self.wanted > self.halves[self.half].numel():  # a step did not fit: grow this half, now idle
            self.halves[self.half] = self._memory(1 << (self.wanted - 1).bit_length())
        self.offset = self.wanted = 0

    def upload(self, data: list, dtype: torch.dtype) -> torch.Tensor | None:
        """``data`` (flat) on the device; None if it does not fit in this step's half."""
        start = -(-self.offset // 64) * 64
        end = start + len(data) * dtype.itemsize
        self.wanted = max(self.wanted, end)
        memory = self.halves[self.half]
        if end > memory.numel():
            return None
        host = memory[start:end].view(dtype)
        host.numpy()[:] = data
        self.offset = end
        return torch.empty(len(data), dtype=dtype, device=self.device).copy_(host, non_blocking=self.pinned)


def to_device(data: list, dtype: torch.dtype, device: torch.device, uploads: Uploads | None = None) -> torch.Tensor:
    """A host list as a device tensor, through ``uploads`` (the runner's, for ``device``) where it fits. On
    CUDA the copy is asynchronous: the step's only host synchronisation is reading its samples."""
    flat = not data or not isinstance(data[0], list)
    fits = uploads is not None and flat and dtype in _NUMPY_DTYPES
    uploaded = uploads.upload(data, dtype) if fits else None
    if uploaded is None:  # nested, another dtype, or more than this step's half holds (it grows by the next step)
        uploaded = torch.tensor(data, dtype=dtype, pin_memory=device.type == "cuda").to(device, non_blocking=True)
    return uploaded


_NUMPY_DTYPES = (torch.int64, torch.int32, torch.float32)


def to_device_packed(
    device: torch.device, dtype: torch.dtype, *parts: list, uploads: Uploads | None = None
) -> list[torch.Tensor]:
    """Flat host lists as device tensors of one dtype, sent in one copy (through ``uploads``, as ``to_device``);
    each a view of it that starts on a 16-element boundary (64 bytes or more), as kernels that assume aligned
    pointers need."""
    flat: list = []
    sizes = []
    for part in parts:
        sizes.append(len(part))
        flat += part
        flat += [0] * (-len(part) % 16)
    buffer = to_device(flat, dtype, device, uploads)
    views, offset = [], 0
    for n in sizes:
        views.append(buffer[offset : offset + n])
        offset += n + (-n % 16)
    return views


def pack_step(
    chunks: list[Chunk],
    block_size: int,
    device: torch.device,
    prev: PendingSource | None = None,
    uploads: Uploads | None = None,
    num_groups: int = 1,
) -> StepInputs:
    """Pack the chunks into one varlen batch (uploaded through ``uploads``, the runner's). A PENDING input token
    is read from ``prev``'s samples. ``num_groups``: the model's KV groups, a block table each (a sequence with one
    table uses it for every group): group 0's slots and tables in ``meta``, the others' in ``meta.kv_groups``."""
    bs = block_size
    pending: list[tuple[int, int]] = []  # (row of input_ids, row of prev's samples)
    input_ids: list[int] = []
    positions: list[int] = []
    cu_q, seq_lens, sample_rows = [0], [], []
    for chunk in chunks:
        seq, start = chunk.seq, chunk.start
        if chunk.num_new_tokens == 1:  # a decode row (most of a step's chunks): one of each, no ranges
            token = seq.token_ids[start]
            if token == PENDING:
                assert prev is not None, f"{seq} has a pending token but no step is in flight"
                pending.append((len(input_ids), prev.rows[seq.request_id]))
            input_ids.append(token)
            positions.append(start)
            cu_q.append(cu_q[-1] + 1)
            seq_lens.append(start + 1)
            if chunk.samples:
                sample_rows.append(cu_q[-1] - 1)
            continue
        end = start + chunk.num_new_tokens
        for i in range(max(start, end - 2), end):  # only a sequence's last two tokens can be pending
            if seq.token_ids[i] == PENDING:
                assert prev is not None, f"{seq} has a pending token but no step is in flight"
                pending.append((len(input_ids) + i - start, prev.rows[seq.request_id]))
        input_ids += seq.token_ids[start:end]
        positions += range(start, end)
        cu_q.append(cu_q[-1] + chunk.num_new_tokens)
        seq_lens.append(end)
        if chunk.samples:
            sample_rows.append(cu_q[-1] - 1)
    width = max(len(c.seq.block_tables[0]) for c in chunks)
    slots, tables = zip(*(_slots_and_tables(chunks, g, bs, width) for g in range(num_groups)), strict=True)
    for row, _ in pending:
        input_ids[row] = 0  # a placeholder id; the device copy below overwrites it
    rows, prev_rows = (list(x) for x in zip(*pending)) if pending else ([], [])
    # Two copies up, one per dtype, instead of one per tensor.
    ids, pos, rows_t, prev_rows_t, *slot_mappings = to_device_packed(
        device, torch.int64, input_ids, positions, rows, prev_rows, *slots, uploads=uploads
    )
    cu_seqlens_q, seq_lens_t, *block_tables = to_device_packed(
        device, torch.int32, cu_q, seq_lens, *tables, uploads=uploads
    )
    metas = [
        AttentionMetadata(
            slot_mapping=slot_mapping,
            cu_seqlens_q=cu_seqlens_q,
            seq_lens=seq_lens_t,
            block_tables=table.view(len(chunks), width),
            max_seqlen_q=max(c.num_new_tokens for c in chunks),
            max_seqlen_k=max(seq_lens),
            cu_seqlens_q_host=cu_q,
            seq_lens_host=seq_lens,
        )
        for slot_mapping, table in zip(slot_mappings, block_tables, strict=True)
    ]
    meta = dataclasses.replace(metas[0], kv_groups=tuple(metas[1:])) if num_groups > 1 else metas[0]
    if pending:  # on the device, after the step in flight has sampled them: no host round trip
        ids[rows_t] = prev.out.token_ids[prev_rows_t]
    return StepInputs(ids, pos, meta, sample_rows)


def _slots_and_tables(chunks: list[Chunk], group: int, bs: int, width: int) -> tuple[list[int], list[int]]:
    """KV group ``group``'s slot of each new token, and its block tables [B, width] flat (padded with 0)."""
    slots: list[int] = []
    tables: list[int] = []
    for chunk in chunks:
        seq_tables = chunk.seq.block_tables
        table = seq_tables[group] if len(seq_tables) > 1 else seq_tables[0]
        start, end = chunk.start, chunk.start + chunk.num_new_tokens
        if end - start == 1:
            slots.append(table[start // bs] * bs + start % bs)
        else:
            for b in range(start // bs, (end - 1) // bs + 1):  # slots, one block range at a time
                base = table[b] * bs - b * bs
                slots += range(base + max(start, b * bs), base + min(end, (b + 1) * bs))
        tables += table
        if len(table) < width:
            tables += [0] * (width - len(table))
    return slots, tables


def pack_states(chunks: list[Chunk], device: torch.device, uploads: Uploads | None = None) -> StateMetadata:
    """The recurrent layers' part of a step: each chunk's live slot, its snapshots, and the slots to zero or
    restore first. A chunk without a ``state`` (a warm-up step's) runs in slot 0 from zeros."""
    slots, snapshots, zero, restore = [], [], [], []
    for b, chunk in enumerate(chunks):
        state = chunk.state
        if state is None:
            slots.append(0)
            zero.append(0)
            continue
        slots.append(state.slot)
        if state.init == ZERO:
            zero.append(state.slot)
        elif state.init is not None:
            restore.append((state.slot, state.init))
        snapshots += [(b, n, slot) for n, slot in state.snapshots]
    return StateMetadata(to_device(slots, torch.int64, device, uploads), slots, snapshots, zero, restore)
