"""Running a recurrent layer over a step's sequences with the prefix cache's snapshots: a sequence's tokens are cut
where a snapshot is asked for (``StateMetadata.snapshots``: after its first n tokens), advanced piece by piece, and
its states copied into the snapshot's slot at each cut. Gated DeltaNet's torch path (layers/gated_deltanet.py) and
the short convolution (layers/short_conv.py) run their sequences through it::

    advance_in_pieces(bounds, cuts, (conv,), (conv_pool,), lambda piece, i: run(piece, conv[i]))
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import NamedTuple

import torch

from nanostream.layers.cache_spec import StateMetadata


def advance_in_pieces(
    bounds: list[int],
    cuts: list[list[tuple[int, int]]],
    states: tuple[torch.Tensor, ...],
    pools: tuple[torch.Tensor, ...] | None,
    advance: Callable[[slice, int], None],
) -> None:
    """For each sequence i, tokens ``bounds[i]:bounds[i+1]``: ``advance(piece, i)`` over its tokens up to each cut
    (n, slot) of ``cuts[i]`` (n ascending), then each ``states[j][i]`` copied into ``pools[j][slot]``; then the rest
    of its tokens. ``advance`` updates ``states[j][i]`` in place."""
    for i, (start, end) in enumerate(itertools.pairwise(bounds)):
        done = start
        for n, slot in [*cuts[i], (end - start, None)]:
            if not 0 <= n <= end - start:
                raise ValueError(f"a snapshot after {n} tokens of a chunk of {end - start}")
            if start + n > done:  # the tokens up to this cut
                advance(slice(done, start + n), i)
                done = start + n
            if slot is not None:
                for pool, state in zip(pools, states, strict=True):
                    pool[slot].copy_(state[i])


class OneTokenRows(NamedTuple):
    """A step's sequences of one token beside its longer chunks: the first run in place at their slots, as a decode
    step runs them (the kernel a decode step's sequences take, and no gather or scatter of their states), the rest as
    a prompt step's. Indices are into the step's packed tokens."""

    tokens: torch.Tensor  # [D] int64, the one-token sequences' tokens (on the step's device)
    slots: torch.Tensor  # [D] int64, their live slots
    copies: list[tuple[int, int]]  # (snapshot slot, live slot): their snapshots, once their token is in
    rest_tokens: torch.Tensor  # [T - D] int64, the other sequences' tokens
    rest_bounds: list[int]  # their bounds within rest_tokens
    rest_cu: torch.Tensor  # the same, int32 on the device
    rest: StateMetadata  # their slots and snapshots, renumbered


def one_token_rows(states: StateMetadata, bounds: list[int], device: torch.device) -> OneTokenRows | None:
    """The split of a step of sequence b's tokens ``bounds[b]:bounds[b+1]``; None where no sequence has exactly one
    token (with no snapshot but after it) or every sequence has. Made once a step: kept on ``states``."""
    if "one_token_rows" in states.memo:
        return states.memo["one_token_rows"]
    cuts = [states.snapshots_of(b) for b in range(len(bounds) - 1)]
    lengths = [end - start for start, end in itertools.pairwise(bounds)]
    one = [b for b, length in enumerate(lengths) if length == 1 and all(n == 1 for n, _ in cuts[b])]
    rest = sorted(set(range(len(lengths))) - set(one))
    split = None
    if one and rest:

        def index(values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        rest_bounds = [0, *itertools.accumulate(lengths[b] for b in rest)]
        renumber = {b: i for i, b in enumerate(rest)}
        slots = [states.slots_host[b] for b in rest]
        split = OneTokenRows(
            tokens=index([bounds[b] for b in one]),
            slots=index([states.slots_host[b] for b in one]),
            copies=[(slot, states.slots_host[b]) for b in one for _, slot in cuts[b]],
            rest_tokens=index([t for b in rest for t in range(bounds[b], bounds[b + 1])]),
            rest_bounds=rest_bounds,
            rest_cu=index(rest_bounds, torch.int32),
            rest=StateMetadata(
                index(slots), slots, [(renumber[b], n, slot) for b, n, slot in states.snapshots if b in renumber]
            ),
        )
    states.memo["one_token_rows"] = split
    return split
