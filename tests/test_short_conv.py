"""LFM2's gated short convolution (layers/short_conv.py): a decode step in place at the state slots (the kernel of
kernels/gated_delta_decode.py without SiLU, under Triton's interpreter on the CPU) gives the reference path's outputs,
live states and snapshots, and leaves the slots nobody names alone. The layer against transformers runs in the
engine tests (test_hybrid_engine.py, test_families_2025.py)."""

from __future__ import annotations

import pytest
import torch
from test_gated_deltanet import step_context

from nanostream.kernels.gated_delta_decode import short_conv_decode
from nanostream.layers.cache_spec import StateCache
from nanostream.layers.delta_rule import causal_conv1d
from nanostream.layers.short_conv import ShortConv, ShortConvSpec


@pytest.mark.parametrize(
    "snapshots",
    [[], [(0, 1, 7), (2, 1, 1), (2, 1, 3)], [(1, 0, 5)]],
    ids=["none", "at-ends", "before-the-token"],
)
@pytest.mark.parametrize("kernel", [2, 3, 4])
def test_a_decode_step_in_place_gives_the_reference_path(snapshots, kernel):
    torch.manual_seed(kernel)
    layer = ShortConv(ShortConvSpec(hidden_size=48, kernel=kernel))
    with torch.no_grad():
        for param in layer.parameters():
            torch.nn.init.normal_(param, std=0.5)
    slots = [4, 0, 2, 6]
    pool = torch.randn(8, 48, kernel - 1)
    projected = torch.randn(len(slots), 3 * 48)
    results = []
    for decode in (None, short_conv_decode):
        layer.decode = decode
        cache = StateCache((pool.clone(),))
        with torch.no_grad():
            out = layer.mix(None, projected, step_context([1] * len(slots), cache, slots, snapshots))
        results.append((out, *cache.tensors))
    for reference, kernels in zip(*results, strict=True):
        torch.testing.assert_close(kernels, reference, rtol=1e-6, atol=1e-6)
    # the reference path is the gated conv: C * conv(B * x) over [state | token], the state shifted by one
    b, c, x = projected.chunk(3, dim=-1)
    for row, slot in enumerate(slots):
        y, state = causal_conv1d(b[row : row + 1] * x[row : row + 1], layer.conv.weight[:, 0], pool[slot], silu=False)
        torch.testing.assert_close(results[0][0][row], (c[row] * y[0]).detach())
        torch.testing.assert_close(results[0][1][slot], state.detach())
    untouched = [s for s in range(8) if s not in slots and s not in {n for _, _, n in snapshots}]
    torch.testing.assert_close(results[1][1][untouched], pool[untouched])


@pytest.mark.parametrize("kernel", [2, 4])
def test_decoding_sequences_beside_prompt_chunks_take_the_decode_kernel_in_place(kernel):
    # A step of prompt chunks and one-token sequences: the latter through the kernel at their slots, as a decode
    # step's (a one-token sequence with a snapshot before its token goes with the chunks); outputs, live states,
    # snapshots and untouched slots as the reference path gives them.
    torch.manual_seed(kernel)
    layer = ShortConv(ShortConvSpec(hidden_size=48, kernel=kernel))
    with torch.no_grad():
        for param in layer.parameters():
            torch.nn.init.normal_(param, std=0.5)
    lengths, slots = [7, 1, 5, 1, 1], [4, 0, 2, 8, 9]
    snapshots = [(0, 3, 5), (1, 1, 6), (2, 5, 7), (4, 0, 1)]
    pool = torch.randn(11, 48, kernel - 1)
    projected = torch.randn(sum(lengths), 3 * 48)
    decoded = []

    def decode(x, weight, state, at):
        decoded.append(at.tolist())
        return short_conv_decode(x, weight, state, at)

    results = []
    for kernels in (False, True):
        layer.decode = decode if kernels else None
        cache = StateCache((pool.clone(),))
        with torch.no_grad():
            out = layer.mix(None, projected, step_context(lengths, cache, slots, snapshots))
        results.append((out, *cache.tensors))
    assert decoded == [[0, 8]]
    for reference, kernels in zip(*results, strict=True):
        torch.testing.assert_close(kernels, reference, rtol=1e-6, atol=1e-6)
