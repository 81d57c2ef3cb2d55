"""What rank 0 tells its workers: the engine's setup once, then what changes in each step.

A worker holds no scheduler and no ``Sequence``: it mirrors only what its model needs. For each chunk of a
step rank 0 sends the chunk's own token ids (``PENDING`` where the step in flight samples one: every rank
reads that value from rank 0's broadcast samples, on the device), where it starts, whether it samples, and
the KV blocks its sequence gained since the worker last heard of it. Block tables only grow, except when
the block manager frees a sequence (preemption, finish), which gives it new lists: then the whole table is
sent again (a model with several KV groups has a table per group, all as long: each is sent alike). A chunk of a
sequence with images also carries its M-RoPE positions and which of its rows are image tokens, whose embeddings
rank 0 (which alone holds the vision encoder) broadcasts in the step. Sequences are numbered (``handle``), so a step
names each with a small integer. Frames are msgspec structs (never pickles: they travel over sockets).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from nanostream.config import EngineConfig
from nanostream.engine.runner.image_rows import chunk_image_rows, chunk_rope
from nanostream.engine.runner.step_inputs import Chunk
from nanostream.engine.sequence import Sequence
from nanostream.engine.state_slots import ChunkState
from nanostream.models.decoder import DecoderSpec


class Setup(msgspec.Struct, array_like=True):
    """Rank 0's resolved config and the model's shape: a worker takes every setting from here, none of its own."""

    config: EngineConfig
    spec: DecoderSpec
    image_levels: int | None = None  # a model that takes images: the DeepStack levels that follow each step's rows
    images_both_ways: str | None = None  # where its image tokens see their whole image (VisionTower.both_ways)


class ChunkUpdate(msgspec.Struct, array_like=True):
    handle: int  # the sequence
    start: int  # its first token's position
    token_ids: list[int]  # the chunk's tokens, PENDING where the step in flight samples them
    samples: bool
    table_start: int  # the sequence's block table from this index on is ...
    blocks: list[int]  # ... these blocks (0: a new table)
    state: ChunkState | None = None  # a model with recurrent layers: the chunk's state slot, start, snapshots
    group_blocks: list[list[int]] = []  # KV groups 1, 2, ...: their tables' blocks from table_start on
    rope: list[int] = []  # its M-RoPE positions (a sequence with images: image_rows.chunk_rope)
    image_rows: list[int] = []  # its rows that are image tokens, whose embeddings rank 0 broadcasts


class Step(msgspec.Struct, tag="step", array_like=True):
    chunks: list[ChunkUpdate]
    forget: list[int]  # handles of sequences that finished: drop their tables


class Stop(msgspec.Struct, tag="stop", array_like=True):
    reason: str


Message = Step | Stop
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_setup_decoder = msgspec.msgpack.Decoder(Setup)


def encode(message: Setup | Step | Stop) -> bytes:
    return _encoder.encode(message)


def decode(frame: bytes) -> Step | Stop:
    return _decoder.decode(frame)


def decode_setup(frame: bytes) -> Setup:
    return _setup_decoder.decode(frame)


@dataclass
class _Mirrored:
    seq: Sequence
    handle: int
    table: list[int]  # the very list object the workers' copy was taken from (KV group 0's)
    sent: int  # how many of its blocks the workers have


class StepWriter:
    """Rank 0: the ``Step`` message of each launched step."""

    def __init__(self) -> None:
        self._known: dict[str, _Mirrored] = {}
        self._next_handle = 0

    def step(self, chunks: list[Chunk]) -> Step:
        updates, forget = [], []
        for chunk in chunks:
            seq = chunk.seq
            m = self._known.get(seq.request_id)
            if m is None or m.seq is not seq:  # new (or a request id used again by a new sequence)
                if m is not None:
                    forget.append(m.handle)
                m = self._known[seq.request_id] = _Mirrored(seq, self._next_handle, seq.block_table, 0)
                self._next_handle += 1
            if m.table is not seq.block_table:  # freed and given a new table: send all of it
                m.table, m.sent = seq.block_table, 0
            start, end = chunk.start, chunk.start + chunk.num_new_tokens
            groups = [table[m.sent :] for table in seq.block_tables[1:]]
            tokens, blocks = seq.token_ids[start:end], m.table[m.sent :]
            images = () if seq.images is None else (chunk_rope(chunk), chunk_image_rows(chunk))
            updates.append(
                ChunkUpdate(m.handle, start, tokens, chunk.samples, m.sent, blocks, chunk.state, groups, *images)
            )
            m.sent = len(m.table)
        if len(self._known) > len(updates):  # someone is not in this step: perhaps finished
            for rid in [rid for rid, m in self._known.items() if m.seq.is_finished]:
                forget.append(self._known.pop(rid).handle)
        return Step(updates, forget)


class _Window:
    """The token ids a worker knows of a sequence: the chunk's own, indexed by their positions."""

    __slots__ = ("start", "tokens")

    def __init__(self, start: int, tokens: list[int]) -> None:
        self.start, self.tokens = start, tokens

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            return self.tokens[index.start - self.start : index.stop - self.start]
        return self.tokens[index - self.start]


@dataclass(slots=True)
class MirroredSeq:
    """What ``step_inputs.pack_step`` reads of a sequence, on a worker."""

    request_id: int  # the handle
    token_ids: _Window
    block_tables: list[list[int]]  # one per KV group


@dataclass(slots=True)
class MirroredChunk:
    seq: MirroredSeq
    start: int
    num_new_tokens: int
    samples: bool
    state: ChunkState | None = None
    rope: list[int] = field(default_factory=list)  # (ChunkUpdate's)
    image_rows: list[int] = field(default_factory=list)


class StepReader:
    """A worker: the chunks of each ``Step``, with the block tables it has been told of so far."""

    def __init__(self) -> None:
        self._tables: dict[int, list[list[int]]] = {}

    def chunks(self, step: Step) -> list[MirroredChunk]:
        for handle in step.forget:
            self._tables.pop(handle, None)
        chunks = []
        for u in step.chunks:
            if u.table_start == 0:
                tables = self._tables[u.handle] = [u.blocks, *u.group_blocks]
            else:
                tables = self._tables[u.handle]
                assert len(tables[0]) == u.table_start, (
                    f"sequence {u.handle}: {len(tables[0])} blocks known, {u.table_start} sent"
                )
                for table, blocks in zip(tables, [u.blocks, *u.group_blocks], strict=True):
                    table += blocks
            seq = MirroredSeq(u.handle, _Window(u.start, u.token_ids), tables)
            chunks.append(MirroredChunk(seq, u.start, len(u.token_ids), u.samples, u.state, u.rope, u.image_rows))
        return chunks
