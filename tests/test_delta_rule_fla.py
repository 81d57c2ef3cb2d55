"""The Gated DeltaNet's step-at-once path (layers/delta_rule_fla.py): the cutting of a step at its snapshots into
rounds of one call each gives the per-sequence reference's outputs, states and snapshots (CPU, with a torch rule in
the kernels' place); fla-core's kernels against the reference at Qwen3.5-9B's and Qwen3-Next's head shapes, prompt
chunks, decode and in a CUDA graph (GPU): 16 key heads read by 32 value heads (Qwen3.5-9B, Qwen3-Next) or 64."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_gated_deltanet import LAYOUTS, SIZES, make_layers, random_states, step_context

from nanostream.layers.cache_spec import StateCache
from nanostream.layers.delta_rule import causal_conv1d, gated_delta_rule
from nanostream.layers.delta_rule_fla import Heads, varlen_delta_rule


def torch_varlen(qkv, g, beta, weight, conv, ssm, cu_seqlens, heads: Heads, decode=False):
    """The reference, sequence by sequence, in ``varlen_delta_rule``'s signature: what the kernels compute."""
    out = qkv.new_empty(qkv.shape[0], heads.v, heads.dv)
    r = heads.v // heads.k
    for b, (start, end) in enumerate(itertools.pairwise(cu_seqlens.tolist())):
        assert not decode or end - start == 1
        x, conv_state = causal_conv1d(qkv[start:end], weight, conv[b])
        conv[b] = conv_state
        q, k, v = x.split([heads.k * heads.dk, heads.k * heads.dk, heads.v * heads.dv], dim=-1)
        q = q.unflatten(-1, (heads.k, heads.dk)).repeat_interleave(r, dim=1)
        k = k.unflatten(-1, (heads.k, heads.dk)).repeat_interleave(r, dim=1)
        out[start:end], ssm[b] = gated_delta_rule(q, k, v.unflatten(-1, (heads.v, heads.dv)), g[start:end],
                                                  beta[start:end], ssm[b])  # fmt: skip
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    ("lengths", "snapshots"),
    [
        ([13, 1, 9], [(0, 13, 7), (0, 5, 5), (1, 1, 6), (2, 0, 1), (2, 4, 3)]),  # cuts inside chunks: rounds
        ([13, 1, 9], [(0, 13, 7), (1, 1, 6)]),  # only at chunks' ends: one call
        ([1, 1, 1], [(2, 1, 5)]),  # a decode step
    ],
)
def test_a_step_cut_at_its_snapshots_gives_the_references_outputs_states_and_snapshots(layout, lengths, snapshots):
    _, ours = make_layers(layout)
    slots = [4, 0, 2]
    conv, ssm = random_states(ours.spec, 8)
    hidden = torch.randn(sum(lengths), SIZES["hidden_size"])
    results = []
    for varlen in (None, torch_varlen):
        ours.varlen = varlen
        cache = StateCache((conv.clone(), ssm.clone()))
        with torch.no_grad():
            out = ours(hidden, step_context(lengths, cache, slots, snapshots))
        results.append((out, *cache.tensors))
    for reference, stepwise in zip(*results, strict=True):
        torch.testing.assert_close(stepwise, reference, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [Heads(16, 128, 32, 128), Heads(16, 128, 64, 128)], ids=["hv32", "hv64"])
@pytest.mark.parametrize("lengths", [[1] * 64, [700, 1, 33, 129]], ids=["decode", "prefill"])
def test_fla_kernels_match_the_reference(heads, lengths):
    pytest.importorskip("fla")
    torch.manual_seed(0)
    dev, dtype, kernel = torch.device("cuda"), torch.bfloat16, 4
    channels = 2 * heads.k * heads.dk + heads.v * heads.dv
    n, tokens = len(lengths), sum(lengths)
    qkv = torch.randn(tokens, channels, device=dev, dtype=dtype)
    g = -torch.rand(tokens, heads.v, device=dev) * 0.3
    beta = torch.rand(tokens, heads.v, device=dev, dtype=dtype)
    weight = torch.randn(channels, kernel, device=dev, dtype=dtype) * 0.5
    conv = torch.randn(n, channels, kernel - 1, device=dev, dtype=dtype)
    ssm = torch.randn(n, heads.v, heads.dk, heads.dv, device=dev) * 0.1
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=dev)
    decode = max(lengths) == 1
    ref_conv, ref_ssm = conv.float().cpu(), ssm.cpu()
    ref = torch_varlen(qkv.float().cpu(), g.cpu(), beta.float().cpu(), weight.float().cpu(), ref_conv, ref_ssm,
                       cu.cpu(), heads)  # fmt: skip
    out = varlen_delta_rule(qkv, g, beta, weight, conv, ssm, cu, heads, decode)
    torch.testing.assert_close(out.float().cpu(), ref, rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(ssm.cpu(), ref_ssm, rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(conv.float().cpu(), ref_conv, rtol=1e-2, atol=1e-2)
