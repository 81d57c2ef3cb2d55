"""The Gated DeltaNet layer (layers/gated_deltanet.py) against transformers' Qwen3.5 (separate projections) and
Qwen3-Next (fused, grouped per key head) layers, which run their torch fallbacks on CPU; and its states: a
sequence split into chunks, decoded token by token, or run in a varlen batch beside others with non-zero
starting states gives what one run of it alone gives.
"""

import itertools

import pytest
import torch
from transformers import Qwen3_5TextConfig, Qwen3NextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
from transformers.models.qwen3_next.modeling_qwen3_next import (
    Qwen3NextGatedDeltaNet,
    causal_conv1d_update,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from nanostream.layers.attention import ForwardContext
from nanostream.layers.attention_backend import AttentionMetadata
from nanostream.layers.cache_spec import StateCache, StateMetadata
from nanostream.layers.delta_rule import causal_conv1d, gated_delta_rule
from nanostream.layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetSpec

LAYOUTS = ["separate", "fused"]
SIZES = dict(
    hidden_size=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,  # r = 2 value heads per key head: a wrong repetition or grouping shows
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    vocab_size=32,
    rms_norm_eps=1e-6,
)
TIGHT = dict(atol=1e-5, rtol=1e-5)


def make_layers(layout: str, dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, GatedDeltaNet]:
    """transformers' layer with every parameter random, and ours with its state dict."""
    torch.manual_seed(0)
    fused = layout == "fused"
    config = (Qwen3NextConfig if fused else Qwen3_5TextConfig)(**SIZES)
    hf = (Qwen3NextGatedDeltaNet if fused else Qwen3_5GatedDeltaNet)(config, layer_idx=0)
    with torch.no_grad():
        for param in hf.parameters():
            torch.nn.init.normal_(param, std=0.2)
        # A = exp(A_log) ~ 0.14 and softplus(a + dt_bias) ~ 0.3: a slow decay, so a carried state matters
        torch.nn.init.normal_(hf.A_log, mean=-2.0, std=0.5)
        torch.nn.init.normal_(hf.dt_bias, mean=-1.0, std=0.5)
        torch.nn.init.normal_(hf.norm.weight, mean=1.0, std=0.2)
    spec = GatedDeltaNetSpec(
        hidden_size=config.hidden_size,
        num_k_heads=config.linear_num_key_heads,
        num_v_heads=config.linear_num_value_heads,
        head_k_dim=config.linear_key_head_dim,
        head_v_dim=config.linear_value_head_dim,
        conv_kernel=config.linear_conv_kernel_dim,
        rms_norm_eps=config.rms_norm_eps,
        fused_projections=fused,
    )
    ours = GatedDeltaNet(spec)
    load_from(hf, ours)
    return hf.to(dtype).eval(), ours.to(dtype).eval()


@torch.no_grad()
def load_from(hf: torch.nn.Module, ours: GatedDeltaNet) -> None:
    """transformers' layer's tensors into ours as the loader places them: the input projections into in_proj."""
    weights = hf.state_dict()
    projections = ("qkvz", "ba") if ours.spec.fused_projections else ("qkv", "z", "b", "a")
    for name in projections:
        ours.in_proj.load_shard(ours.in_proj.weight, weights[f"in_proj_{name}.weight"], name)
    ours.conv1d.load_weight(ours.conv1d.weight, weights["conv1d.weight"])
    ours.load_weight(ours.A_log, weights["A_log"])
    ours.load_weight(ours.dt_bias, weights["dt_bias"])
    ours.norm.weight.copy_(weights["norm.weight"])
    ours.out_proj.weight.copy_(weights["out_proj.weight"])


def fresh_states(spec: GatedDeltaNetSpec, batch: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(batch, *spec.conv_state_shape, dtype=dtype), torch.zeros(batch, *spec.ssm_state_shape)


def random_states(spec: GatedDeltaNetSpec, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch, *spec.conv_state_shape), 0.5 * torch.randn(batch, *spec.ssm_state_shape)


def cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


@torch.no_grad()
def run_chunks(layer: GatedDeltaNet, hidden: torch.Tensor, chunks: list[int], conv, ssm) -> torch.Tensor:
    """One sequence's tokens in consecutive steps, its states ([1, ...]) carried from one to the next."""
    out, start = [], 0
    for length in chunks:
        out.append(layer.step(hidden[start : start + length], cu_seqlens([length]), conv, ssm))
        start += length
    assert start == hidden.shape[0]
    return torch.cat(out)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("length", [1, 5, 37])
def test_matches_transformers_on_a_whole_sequence(layout, length):
    hf, ours = make_layers(layout)
    hidden = torch.randn(length, SIZES["hidden_size"])
    conv, ssm = fresh_states(ours.spec, 1, torch.float32)
    with torch.no_grad():
        expected = hf(hidden[None])[0]  # no cache: a fresh sequence, the chunked delta rule
        got = ours.step(hidden, cu_seqlens([length]), conv, ssm)
    torch.testing.assert_close(got, expected, **TIGHT)
    assert ssm.abs().sum() > 0 and conv.abs().sum() > 0  # the states were written


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("chunks", [[7, 1, 13, 16], [1] * 37, [2, 35]], ids=["chunks", "decode", "short-first"])
def test_chunked_prefill_and_decode_equal_one_run(layout, chunks):
    _, ours = make_layers(layout)
    hidden = torch.randn(37, SIZES["hidden_size"])
    whole_conv, whole_ssm = fresh_states(ours.spec, 1, torch.float32)
    whole = run_chunks(ours, hidden, [37], whole_conv, whole_ssm)
    conv, ssm = fresh_states(ours.spec, 1, torch.float32)
    torch.testing.assert_close(run_chunks(ours, hidden, chunks, conv, ssm), whole, **TIGHT)
    torch.testing.assert_close(conv, whole_conv, **TIGHT)
    torch.testing.assert_close(ssm, whole_ssm, **TIGHT)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_varlen_batch_with_starting_states_equals_each_sequence_alone(layout):
    _, ours = make_layers(layout)
    lengths = [13, 1, 0, 6]  # a prompt chunk, a decode token, none (its states stay), another chunk
    hidden = torch.randn(sum(lengths), SIZES["hidden_size"])
    conv, ssm = random_states(ours.spec, len(lengths))
    alone_conv, alone_ssm = conv.clone(), ssm.clone()
    with torch.no_grad():
        batched = ours.step(hidden, cu_seqlens(lengths), conv, ssm)
    bounds = cu_seqlens(lengths).tolist()
    for i, (start, end) in enumerate(itertools.pairwise(bounds)):
        # row i's slice is a view: run_chunks updates it in place
        alone = run_chunks(ours, hidden[start:end], [end - start], alone_conv[i : i + 1], alone_ssm[i : i + 1])
        torch.testing.assert_close(batched[start:end], alone, **TIGHT)
    torch.testing.assert_close(conv, alone_conv, **TIGHT)
    torch.testing.assert_close(ssm, alone_ssm, **TIGHT)
    # the starting states count: the same tokens from fresh states give other outputs
    with torch.no_grad():
        from_fresh = ours.step(hidden, cu_seqlens(lengths), *fresh_states(ours.spec, len(lengths), torch.float32))
    assert not torch.allclose(batched, from_fresh, **TIGHT)


@pytest.mark.parametrize("length", [1, 9, 70])  # 70: over transformers' chunk of 64
def test_functions_continue_from_a_state_as_transformers_does(length):
    torch.manual_seed(1)
    heads_k, heads_v, dk, dv, channels, kernel = 2, 4, 16, 8, 24, 4
    q, k = torch.randn(2, 1, length, heads_k, dk).unbind(0)
    v = torch.randn(1, length, heads_v, dv)
    g = -torch.rand(1, length, heads_v)  # log decay in [-1, 0]
    beta = torch.rand(1, length, heads_v)
    state = torch.randn(1, heads_v, dk, dv)
    repeat = lambda x: x[0].repeat_interleave(heads_v // heads_k, dim=1)
    got, got_state = gated_delta_rule(repeat(q), repeat(k), v[0], g[0], beta[0], state[0])
    for rule in (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule):
        expected, expected_state = rule(
            q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
        )
        torch.testing.assert_close(got, expected[0], **TIGHT)
        torch.testing.assert_close(got_state, expected_state[0], **TIGHT)

    x, weight = torch.randn(length, channels), torch.randn(channels, kernel)
    hf_state = torch.randn(1, channels, kernel)  # transformers keeps K columns; the oldest is never read
    conv_state = hf_state[0, :, 1:].clone()
    y, new_state = causal_conv1d(x, weight, conv_state)
    torch.testing.assert_close(y, causal_conv1d_update(x.t()[None], hf_state, weight, activation="silu")[0].t())
    torch.testing.assert_close(new_state, hf_state[0, :, 1:])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bfloat16_follows_transformers_casts(layout):
    hf, ours = make_layers(layout, torch.bfloat16)
    hidden = torch.randn(37, SIZES["hidden_size"], dtype=torch.bfloat16)
    conv, ssm = fresh_states(ours.spec, 1, torch.bfloat16)
    with torch.no_grad():
        expected = hf(hidden[None])[0]
        got = ours.step(hidden, cu_seqlens([37]), conv, ssm)
    assert got.dtype == torch.bfloat16 and ssm.dtype == torch.float32
    # the same casts: only the delta rule's float32 order of summation (chunks against steps) differs, which
    # rounding to bfloat16 mostly hides; at most one bfloat16 step (2^-8 relative) apart
    assert (got == expected).float().mean() > 0.95
    torch.testing.assert_close(got, expected, atol=4e-3, rtol=8e-3)


def test_rejects_what_it_cannot_run():
    _, ours = make_layers("separate")
    conv, ssm = fresh_states(ours.spec, 2, torch.float32)
    hidden = torch.randn(5, SIZES["hidden_size"])
    with pytest.raises(ValueError, match="cu_seqlens"):
        ours.step(hidden, cu_seqlens([2, 2]), conv, ssm)  # 4 tokens for 5
    with pytest.raises(ValueError, match="conv_states"):
        ours.step(hidden, cu_seqlens([2, 3]), conv[:1], ssm)
    with pytest.raises(TypeError, match="float32"):
        ours.step(hidden, cu_seqlens([2, 3]), conv, ssm.bfloat16())
    with pytest.raises(ValueError, match="multiple of num_k_heads"):
        GatedDeltaNetSpec(64, 3, 4, 16, 16, 4, 1e-6, fused_projections=False)


def step_context(lengths: list[int], cache: StateCache, slots: list[int], snapshots: list[tuple[int, int, int]]):
    """A ForwardContext of one step of sequences of ``lengths`` for layer 0, states in rows ``slots`` of ``cache``."""
    bounds = cu_seqlens(lengths)
    meta = AttentionMetadata(
        slot_mapping=torch.full((bounds[-1].item(),), -1), cu_seqlens_q=bounds, seq_lens=torch.tensor(lengths),
        block_tables=torch.zeros(len(lengths), 1, dtype=torch.int32), max_seqlen_q=max(lengths),
        max_seqlen_k=max(lengths), cu_seqlens_q_host=bounds.tolist(), seq_lens_host=lengths,
    )  # fmt: skip
    states = StateMetadata(torch.tensor(slots), slots, snapshots)
    return ForwardContext(meta, [cache], states)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_step_on_the_state_pool_advances_live_slots_and_takes_snapshots_mid_chunk(layout):
    _, ours = make_layers(layout)
    lengths, slots = [13, 1, 9], [4, 0, 2]  # live slots in no particular order; the others hold snapshots
    conv, ssm = random_states(ours.spec, 8)
    conv[4], ssm[4] = 0, 0  # the first sequence is fresh (the engine zeroed its slot), the others continue
    cache = StateCache((conv.clone(), ssm.clone()))
    # after 5 and 13 (its end) of the first chunk's tokens, after 1 of the decode row, before and inside the third
    snapshots = [(0, 13, 7), (0, 5, 5), (1, 1, 6), (2, 0, 1), (2, 4, 3)]
    hidden = torch.randn(sum(lengths), SIZES["hidden_size"])
    with torch.no_grad():
        got = ours(hidden, step_context(lengths, cache, slots, snapshots))
    bounds = cu_seqlens(lengths).tolist()
    for b, (start, end) in enumerate(itertools.pairwise(bounds)):
        # the sequence alone, from its starting state: its outputs and its state at its end (now in its live slot)
        alone_conv, alone_ssm = conv[slots[b]].clone()[None], ssm[slots[b]].clone()[None]
        alone = run_chunks(ours, hidden[start:end], [end - start], alone_conv, alone_ssm)
        torch.testing.assert_close(got[start:end], alone, **TIGHT)
        torch.testing.assert_close(cache.tensors[0][slots[b]], alone_conv[0], **TIGHT)
        torch.testing.assert_close(cache.tensors[1][slots[b]], alone_ssm[0], **TIGHT)
        for row, n, slot in snapshots:  # each snapshot: the state after only the first n tokens
            if row != b:
                continue
            first_conv, first_ssm = conv[slots[b]].clone()[None], ssm[slots[b]].clone()[None]
            if n:
                run_chunks(ours, hidden[start : start + n], [n], first_conv, first_ssm)
            torch.testing.assert_close(cache.tensors[0][slot], first_conv[0], **TIGHT)
            torch.testing.assert_close(cache.tensors[1][slot], first_ssm[0], **TIGHT)
    assert not torch.allclose(cache.tensors[1][5], cache.tensors[1][7])  # mid-chunk is not the end


def test_the_layer_declares_its_state_per_sequence():
    _, ours = make_layers("separate")
    spec = ours.cache_spec()
    assert [t.shape for t in spec.tensors] == [ours.spec.conv_state_shape, ours.spec.ssm_state_shape]
    assert [t.dtype for t in spec.tensors] == [None, torch.float32]  # conv: the model's dtype
    assert spec.nbytes(torch.bfloat16) == 2 * (96 * 3) + 4 * (4 * 16 * 8)  # C = 2 * 2 * 16 + 4 * 8
