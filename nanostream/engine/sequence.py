"""One request inside the engine: its tokens, its KV blocks and how far it has been computed."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Protocol

from nanostream.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanostream.engine.images import PromptImages

PENDING = -1
"""Placeholder for a token that the step in flight is sampling: its value is still on the device."""


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Grammar(Protocol):
    """What the scheduler reads of a constrained request's grammar (engine/grammar.py's RequestGrammar)."""

    def accept(self, token_id: int) -> bool: ...  # False: the grammar does not allow the token
    @property
    def terminated(self) -> bool: ...  # it took a stop token: the output is complete


class Sequence:
    """A request's state. Plain Python: the scheduler and block manager never touch torch.

    ``token_ids`` holds prompt + output. ``num_computed_tokens`` counts the leading tokens whose K/V
    are in the cache (or being written by the step in flight); the next step computes
    ``token_ids[num_computed_tokens:]`` (or a chunk of it). The last token may be ``PENDING``.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        max_tokens: int,
        sampling_seed: int,
        stop_token_ids: frozenset[int],
    ) -> None:
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens  # params.max_tokens with None resolved against max_model_len
        self.sampling_seed = sampling_seed  # params.seed, or one the engine drew for this request
        self.stop_token_ids = stop_token_ids  # EOS ids (unless ignore_eos) + params.stop_token_ids
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at first admission
        # One block table per KV group (engine/block_manager.py; most models have one), all as long; one table
        # alone (a warm-up's, a test's) serves every group. ``released``: per group, the leading blocks given back,
        # behind every window of its layers (ids stale, unread).
        self.block_tables: list[list[int]] = [[]]
        self.released: list[int] = [0]
        self.block_hashes: list[int] = []  # chained hashes of the leading full, computed blocks
        self.logprobs: list[dict[int, float]] = []
        self.admitted = False
        self.arrived = time.monotonic()  # when the engine took the request
        self.admitted_at = 0.0  # when the scheduler first gave it a step (time.monotonic())
        self.reported = False  # the engine has returned a delta for it (the first carries usage)
        self.queued_tokens = 0  # what it adds to the scheduler's num_waiting_tokens while it waits
        self.stopping = False  # its pending token reaches max_tokens or max_model_len: not scheduled again
        self.grammar: Grammar | None = None  # structured outputs: set before the scheduler sees it
        self.error: str | None = None  # why, when it finished with "error"
        self.prompt_logprobs: list[dict[int, float] | None] = []  # per prompt position computed so far
        self.embedding: bytes | None = None  # params.embed: the prompt's pooled hidden state (float32), once computed
        self.sampling_row: tuple | None = None  # its params as one step's sampling reads them (sampling_batch.py)
        # A model with recurrent layers (engine/state_slots.py): its live state slot, a snapshot to start from
        # (a prefix hit), the snapshots taken for blocks not yet cached (block end -> slot), its decode tail's
        self.state_slot: int | None = None
        self.state_restore: int | None = None
        self.pending_snapshots: dict[int, int] = {}
        self.tail_snapshot: tuple[int, int] | None = None
        self.images: PromptImages | None = None  # a vision-language model's prompt images (engine/images.py)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )

    @property
    def block_table(self) -> list[int]:
        """KV group 0's block table (a full-attention group's, where the model has one)."""
        return self.block_tables[0]

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.block_tables, self.released = [table], [0]

    @property
    def released_blocks(self) -> int:
        return self.released[0]

    def block_key(self, i: int, block_size: int) -> list[int]:
        """What block i's prefix-cache hash covers: its token ids, and the images it overlaps (engine/images.py)."""
        start = i * block_size
        tokens = self.token_ids[start : start + block_size]
        return tokens if self.images is None else tokens + self.images.block_words(start, start + block_size)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def next_chunk(self, start: int, budget: int) -> int:
        """How many of its tokens from ``start`` a step computes within ``budget``: all it can, never ending inside
        an image whose tokens attend to each other both ways (``PromptImages.chunk_end``; then maybe 0)."""
        end = min(len(self.token_ids), start + budget)
        return end - start if self.images is None else self.images.chunk_end(start, end) - start

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """It asked for prompt logprobs and some prompt position is not computed yet (so nothing of its
        prompt may come from the prefix cache)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def check_stop(self, max_model_len: int, index: int | None = None) -> str | None:
        """The finish reason once the token at ``index`` (default: the last) is known, or None."""
        index = self.num_tokens - 1 if index is None else index
        num_output = index + 1 - self.num_prompt_tokens
        if num_output >= self.params.min_tokens and self.token_ids[index] in self.stop_token_ids:
            return "stop"
        if self.grammar is not None and self.grammar.terminated:  # a stop token the grammar ends on (ignore_eos)
            return "stop"
        if num_output >= self.max_tokens or index + 1 >= max_model_len:
            return "length"
        return None

    def reaches_length_limit(self, max_model_len: int) -> bool:
        return self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len
