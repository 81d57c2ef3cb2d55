"""The engine's caches by layer kind: the model's layers declare theirs (layers/cache_spec.py), and these pools
hold them.

- The layers with a ``PagedKV`` spec (softmax attention) share the KV pool (kv_pool.py): one block id names the
  same tokens' K and V in each of them, so a sequence has one block table. Layers of another KV shape (Gemma 4's
  full layers: another head size and KV head count) have their own tensor under the same block ids; a layer with a
  ``SharedKV`` spec gets its source layer's views and costs nothing.
- The layers with a ``PagedLatent`` spec (multi-head latent attention) page one latent entry a token under the same
  block ids (their own tensor, [layers, blocks, block_size, width]): a block costs its real bytes, no V half.
- The layers with a ``RecurrentState`` spec (Gated DeltaNet) share the state pool: one slot id names a
  sequence's state in each of them. Slots 0 .. max_num_seqs - 1 are live (a running sequence's), the rest are
  snapshots the prefix cache keeps (engine/state_slots.py).

``CacheLayout`` says which layer is which and what a block and a slot cost; ``allocate_caches`` makes the pools
and gives each layer its views, in layer order (what ``ForwardContext.kv_caches`` holds)::

    layout = CacheLayout(model.cache_specs())
    caches = allocate_caches(layout, num_blocks=512, block_size=16, kv_dtype=torch.bfloat16, num_slots=64,
                             model_dtype=torch.bfloat16, device=torch.device("cuda"))
"""

from __future__ import annotations

import torch

from nanostream.engine.runner.kv_pool import kv_pool_views
from nanostream.layers.attention_backend import KVCache
from nanostream.layers.cache_spec import (
    CacheSpec,
    LatentCache,
    PagedKV,
    PagedLatent,
    RecurrentState,
    SharedKV,
    StateCache,
)


class CacheLayout:
    """The model's cache specs (one per layer, this rank's shapes) by kind."""

    def __init__(self, specs: list[CacheSpec]) -> None:
        self.specs = specs
        self.paged = [i for i, s in enumerate(specs) if isinstance(s, PagedKV)]
        self.shared = [i for i, s in enumerate(specs) if isinstance(s, SharedKV)]
        self.latent = [i for i, s in enumerate(specs) if isinstance(s, PagedLatent)]
        self.recurrent = [i for i, s in enumerate(specs) if isinstance(s, RecurrentState)]
        kinds = PagedKV | SharedKV | PagedLatent | RecurrentState
        unknown = [type(s).__name__ for s in specs if not isinstance(s, kinds)]
        if unknown:
            raise ValueError(f"no pool for the cache specs {sorted(set(unknown))}")
        for i in self.shared:
            if specs[i].source not in self.paged or specs[i].source >= i:
                raise ValueError(f"layer {i} shares layer {specs[i].source}'s KV: not an attention layer before it")
        self.kv_groups: dict[tuple[int, int], list[int]] = {}
        """The attention layers by KV shape (Hkv, D): one pool tensor each, under the same block ids."""
        for i in self.paged:
            self.kv_groups.setdefault((specs[i].num_kv_heads, specs[i].head_dim), []).append(i)
        widths = {specs[i].width for i in self.latent}
        if len(widths) > 1:
            raise ValueError(f"latent attention layers of different widths {sorted(widths)} in one pool")
        self.latent_width = widths.pop() if widths else None
        self.groups, self.group_reaches = self._group_layers()
        """The KV groups (a block table each: engine/block_manager.py): their attention layers, and the reach
        (window or chunk; None: full attention) by which each gives its blocks back."""

    def _group_layers(self) -> tuple[list[list[int]], tuple[int | None, ...]]:
        """The attention layers by the reach that gives their blocks back, each reach's split into groups of at most
        ``slots`` layers (the fewest of any reach), so that every group's block is as large: layer j of each group
        keeps its K and V in slot j of the pool, and a block id names one group's slots. Full attention first (group
        0). One group of every layer (its reach the longest, if all have one) where there is one reach, or layers
        of several shapes, latent or KV-sharing layers."""
        by_reach: dict[int | None, list[int]] = {}
        for i in self.paged:
            by_reach.setdefault(self.specs[i].reach, []).append(i)
        if len(by_reach) < 2 or len(self.kv_groups) > 1 or self.shared or self.latent:
            whole = not by_reach or None in by_reach or self.shared or self.latent
            return [self.paged], (None if whole else max(by_reach),)
        self.slots = min(len(layers) for layers in by_reach.values())
        groups, reaches = [], []
        for reach in sorted(by_reach, key=lambda r: -1 if r is None else r):
            layers = by_reach[reach]
            for start in range(0, len(layers), self.slots):
                groups.append(layers[start : start + self.slots])
                reaches.append(reach)
        return groups, tuple(reaches)

    @property
    def has_state(self) -> bool:
        return bool(self.recurrent)

    def kv_block_bytes(self, block_size: int, kv_dtype: torch.dtype) -> int:
        """Bytes of one block: K and V of ``block_size`` tokens in every attention layer, and their latent entries in
        every latent attention layer; with several KV groups, K and V of one group's ``slots`` layers."""
        if len(self.groups) > 1:
            ((hkv, d),) = self.kv_groups
            return 2 * self.slots * hkv * d * block_size * kv_dtype.itemsize
        kv = sum(2 * len(layers) * hkv * d for (hkv, d), layers in self.kv_groups.items())
        latent = 0
        if self.latent_width is not None:
            latent = len(self.latent) * self.latent_width
        return (kv + latent) * block_size * kv_dtype.itemsize

    def describe(self, num_blocks: int, block_size: int, num_live: int, num_snapshots: int, slot_bytes: int) -> str:
        """What the pools hold, in a line: "2,048 KV blocks of 16 tokens (4 attention layers); 64 sequences' states
        and 64 prefix-cache snapshots of 1.50 MiB each (12 recurrent layers)"."""
        layers = [_count(len(self.paged), "attention layer")] if self.paged else []
        if self.shared:
            layers.append(_count(len(self.shared), "layer reading another's KV", "layers reading another's KV"))
        if self.latent:
            layers.append(_count(len(self.latent), "latent attention layer"))
        kv = f"{num_blocks:,} KV blocks of {block_size} tokens ({', '.join(layers) or 'no attention layer'})"
        if len(self.groups) > 1:  # "(4 attention layers in 4 groups of 1, full or reading back 32 tokens)"
            kinds = dict.fromkeys(self.group_reaches)
            reaches = " or ".join(f"reading back {r} tokens" if r else "full" for r in kinds)
            kv = f"{kv[:-1]} in {len(self.groups)} groups of {self.slots}, {reaches})"
        if not self.recurrent:
            return kv
        return (
            f"{kv}; {num_live:,} sequences' states and {num_snapshots:,} prefix-cache snapshots of "
            f"{slot_bytes / 2**20:.2f} MiB each ({_count(len(self.recurrent), 'recurrent layer')})"
        )

    def slot_bytes(self, model_dtype: torch.dtype) -> int:
        """Bytes of one state slot: a sequence's state in every recurrent layer."""
        return sum(self.specs[i].nbytes(model_dtype) for i in self.recurrent)


def allocate_caches(
    layout: CacheLayout,
    *,
    num_blocks: int,
    block_size: int,
    kv_dtype: torch.dtype,
    num_slots: int,
    model_dtype: torch.dtype,
    device: torch.device,
) -> list[KVCache | LatentCache | StateCache]:
    """Zeroed pools: the KV blocks of the attention layers (the latent entries of the latent ones) and ``num_slots``
    state slots of the recurrent ones; each layer's views, in layer order."""
    caches: list[KVCache | LatentCache | StateCache | None] = [None] * len(layout.specs)
    if len(layout.groups) > 1:  # one shape: layer j of every group in slot j
        ((hkv, d),) = layout.kv_groups
        views = kv_pool_views(layout.slots, num_blocks, block_size, hkv, d, kv_dtype, device)
        for g, layers in enumerate(layout.groups):
            for i, view in zip(layers, views, strict=False):
                caches[i] = KVCache(view.k, view.v, g)
    for (hkv, d), layers in layout.kv_groups.items() if len(layout.groups) == 1 else ():
        views = kv_pool_views(len(layers), num_blocks, block_size, hkv, d, kv_dtype, device)
        for i, view in zip(layers, views, strict=True):
            caches[i] = view
    for i in layout.shared:
        caches[i] = caches[layout.specs[i].source]
    if layout.latent_width is not None:
        pool = torch.zeros(len(layout.latent), num_blocks, block_size, layout.latent_width, dtype=kv_dtype,
                           device=device)  # fmt: skip
        for i, view in zip(layout.latent, pool, strict=True):
            caches[i] = LatentCache(view)
    for i in layout.recurrent:
        tensors = layout.specs[i].tensors
        caches[i] = StateCache(
            tuple(torch.zeros(num_slots, *t.shape, dtype=t.dtype or model_dtype, device=device) for t in tensors)
        )
    return caches


def init_states(caches: list[KVCache | StateCache], zero: list[int], restore: list[tuple[int, int]]) -> None:
    """Before a step: slots ``zero`` (fresh sequences) set to zeros, and each (dst, src) of ``restore`` (a prefix
    hit) a copy of snapshot src, in every recurrent layer."""
    if not zero and not restore:
        return
    device = next(c.tensors[0].device for c in caches if isinstance(c, StateCache))
    zero_t = torch.tensor(zero, dtype=torch.int64, device=device) if zero else None
    dst, src = (torch.tensor(x, dtype=torch.int64, device=device) for x in zip(*restore)) if restore else (None, None)
    for cache in caches:
        if not isinstance(cache, StateCache):
            continue
        for t in cache.tensors:
            if zero_t is not None:
                t.index_fill_(0, zero_t, 0)
            if dst is not None:
                t.index_copy_(0, dst, t.index_select(0, src))


def _count(n: int, thing: str, things: str | None = None) -> str:
    return f"{n} {thing if n == 1 else things or thing + 's'}"
