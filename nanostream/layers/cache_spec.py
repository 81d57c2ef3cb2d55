"""What a layer keeps between steps, by kind: the cache spec each token-mixing layer declares, and the views of
the engine's pools that it gets back.

- ``PagedKV``: softmax attention. Each token's K and V in pages of ``block_size`` tokens (the KV pool,
  engine/runner/kv_pool.py); the layer reads them through a sequence's block table (``AttentionMetadata``).
- ``SharedKV``: an attention layer that reads another layer's pages and writes none (Gemma 4's KV-shared layers): it
  costs no KV; its view is its source layer's ``KVCache``.
- ``PagedLatent``: multi-head latent attention (DeepSeek's MLA). One entry a token, the compressed latent and the
  shared rope key ``[kv_lora_rank | qk_rope_head_dim]``, in pages of the same blocks and block table as KV; the
  layer's view is a ``LatentCache`` (layers/latent_attention.py expands or absorbs it).
- ``RecurrentState``: a linear-attention or convolution layer (Gated DeltaNet). A fixed-size state per sequence
  whatever its length, in a slot of the state pool: ``StateCache`` holds the layer's tensors, one row a slot.
  The engine gives each running sequence a live slot; prefix caching keeps copies of a state at cached block
  boundaries in other slots (snapshots) and restores one into a live slot instead of recomputing the prefix.

A step's state bookkeeping (``StateMetadata``) comes in ``ForwardContext.states``: each chunk's live slot, and
where to copy a chunk's state midway or at its end (the snapshots). Restoring a snapshot or zeroing a fresh
sequence's slot happens before the forward (the model runner's), so a layer only reads, advances and copies::

    cache = ctx.kv_caches[layer_idx]       # a StateCache: cache.tensors[0] [slots, ...], ...
    rows = ctx.states.slots                # [B] int64, chunk b's live slot
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class PagedKV:
    """A softmax-attention layer's cache: K and V of ``num_kv_heads`` heads (this rank's) of ``head_dim`` a token.
    ``reach``: how many of its last tokens a query reads (its sliding window or attention chunk; None: all), which
    says when a block goes back to the pool (engine/block_manager.py's KV groups)."""

    num_kv_heads: int
    head_dim: int
    reach: int | None = None


@dataclass(frozen=True)
class SharedKV:
    """An attention layer's cache that is layer ``source``'s pages (a ``PagedKV`` layer before it): read, not
    written."""

    source: int


@dataclass(frozen=True)
class PagedLatent:
    """A latent-attention layer's cache: one entry of ``width`` values a token (kv_lora_rank + qk_rope_head_dim),
    whole on every tensor-parallel rank (the heads are split, the latent is not)."""

    width: int


@dataclass
class LatentCache:
    """A latent-attention layer's view of its pages: [num_blocks, block_size, width] (float8 e4m3 with an FP8 KV
    cache: each value stored as x / k_scale)."""

    latent: torch.Tensor

    @property
    def block_size(self) -> int:
        return self.latent.shape[1]


@dataclass(frozen=True)
class StateTensor:
    """One tensor of a recurrent layer's per-sequence state: its shape (without the slot dim) and dtype (None:
    the model's)."""

    shape: tuple[int, ...]
    dtype: torch.dtype | None = None

    def nbytes(self, model_dtype: torch.dtype) -> int:
        return (self.dtype or model_dtype).itemsize * _numel(self.shape)


@dataclass(frozen=True)
class RecurrentState:
    """A recurrent layer's cache: a fixed-size state per sequence, its tensors in order."""

    tensors: tuple[StateTensor, ...]

    def nbytes(self, model_dtype: torch.dtype) -> int:
        """Bytes of one sequence's state."""
        return sum(t.nbytes(model_dtype) for t in self.tensors)


CacheSpec = PagedKV | SharedKV | PagedLatent | RecurrentState


@dataclass
class StateCache:
    """A recurrent layer's views of the state pool, in its ``RecurrentState``'s order: tensor i is
    [num_slots, *tensors[i].shape]."""

    tensors: tuple[torch.Tensor, ...]


@dataclass
class StateMetadata:
    """A step's recurrent-state bookkeeping, for the layers that keep one (chunks in the step's order).

    ``slots``: [B] int64 on the device, chunk b's live slot; ``slots_host`` the same list. ``snapshots``: (b, n,
    slot): once chunk b's first n tokens are computed, copy its state into ``slot`` (n == the chunk's length: its
    end). Each layer copies its own tensors; a snapshot holds every recurrent layer's state at one position."""

    slots: torch.Tensor
    slots_host: list[int]
    snapshots: list[tuple[int, int, int]] = field(default_factory=list)
    zero: list[int] = field(default_factory=list)  # slots zeroed before the forward (fresh sequences) ...
    restore: list[tuple[int, int]] = field(default_factory=list)  # ... and (dst, src) copied: the runner's job
    memo: dict = field(default_factory=dict, repr=False, compare=False)  # what a step's layers share (recurrent_pieces)

    def decode_copies(self) -> list[tuple[int, int]] | None:
        """A decode step's snapshots (each after its chunk's one token) as (snapshot slot, live slot) copies to make
        once the step is computed; None if one is anywhere else."""
        if any(n != 1 for _, n, _ in self.snapshots):
            return None
        return [(slot, self.slots_host[b]) for b, _, slot in self.snapshots]

    def snapshots_of(self, b: int) -> list[tuple[int, int]]:
        """Chunk ``b``'s snapshots as (n, slot), n ascending."""
        return sorted((n, slot) for row, n, slot in self.snapshots if row == b)


def copy_rows(cache: StateCache, pairs: list[tuple[int, int]]) -> None:
    """For each (dst, src) of ``pairs``, row src of every tensor of ``cache`` copied into row dst."""
    if not pairs:
        return
    device = cache.tensors[0].device
    dst, src = (torch.tensor(rows, dtype=torch.int64, device=device) for rows in zip(*pairs))
    for t in cache.tensors:
        t.index_copy_(0, dst, t.index_select(0, src))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
