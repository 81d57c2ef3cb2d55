"""Running a recurrent layer over a step's sequences with the prefix cache's snapshots: a sequence's tokens are cut
where a snapshot is asked for (``StateMetadata.snapshots``: after its first n tokens), advanced piece by piece, and
its states copied into the snapshot's slot at each cut. Gated DeltaNet's torch path (layers/gated_deltanet.py) and
the short convolution (layers/short_conv.py) run their sequences through it::

    advance_in_pieces(bounds, cuts, (conv,), (conv_pool,), lambda piece, i: run(piece, conv[i]))
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch


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
