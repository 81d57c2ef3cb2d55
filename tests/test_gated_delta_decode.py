"""The Gated DeltaNet decode kernels (kernels/gated_delta_decode.py) against the torch reference of
layers/delta_rule.py: each sequence's token from its slot of the pools, in place; padding rows (slot -1) and the
slots no sequence names untouched. Under the Triton interpreter on the CPU; on a GPU at the real models' heads."""

from __future__ import annotations

import pytest
import torch
from test_gated_deltanet import LAYOUTS, SIZES, make_layers, random_states, step_context

from nanostream.kernels.gated_delta_decode import conv_decode, decode_step, delta_rule_decode
from nanostream.layers.cache_spec import StateCache
from nanostream.layers.delta_rule import causal_conv1d, gated_delta_rule


def reference_step(qkv, g, beta, weight, conv_pool, ssm_pool, slots, k_heads, dk):
    """The reference, a sequence at a time, on copies of the pools: (out [B, Hv, Dv], conv pool, ssm pool)."""
    conv_pool = conv_pool.clone()
    x = torch.zeros_like(qkv)
    for b, slot in enumerate(slots.tolist()):
        if slot >= 0:
            x[b : b + 1], conv_pool[slot] = causal_conv1d(qkv[b : b + 1], weight, conv_pool[slot])
    out, ssm_pool = reference_rule(x, g, beta, ssm_pool, slots, k_heads, dk)
    return out, conv_pool, ssm_pool


def reference_rule(x, g, beta, ssm_pool, slots, k_heads, dk):
    """The gated delta rule's reference on the conv's output x [B, C]: (out [B, Hv, Dv], a copy of the ssm pool)."""
    ssm_pool = ssm_pool.clone()
    _, hv, _, dv = ssm_pool.shape
    out = torch.zeros(x.shape[0], hv, dv, dtype=x.dtype)
    for b, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        q, k, v = x[b : b + 1].split([k_heads * dk, k_heads * dk, hv * dv], dim=-1)
        r = hv // k_heads
        q = q.unflatten(-1, (k_heads, dk)).repeat_interleave(r, dim=1)
        k = k.unflatten(-1, (k_heads, dk)).repeat_interleave(r, dim=1)
        o, ssm_pool[slot] = gated_delta_rule(q, k, v.unflatten(-1, (hv, dv)), g[b : b + 1], beta[b : b + 1],
                                             ssm_pool[slot])  # fmt: skip
        out[b] = o[0]
    return out, ssm_pool


def random_step(batch, slots_total, k_heads, dk, hv, dv, kernel, dtype, device):
    gen = torch.Generator().manual_seed(batch * 31 + hv)
    channels = 2 * k_heads * dk + hv * dv

    def rand(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dt)

    qkv, weight = rand(batch, channels), rand(channels, kernel, scale=0.5)
    g = -torch.rand(batch, hv, generator=gen).to(device) * 0.5
    beta = torch.rand(batch, hv, generator=gen).to(device=device, dtype=dtype)
    conv_pool, ssm_pool = (
        rand(slots_total, channels, kernel - 1),
        rand(slots_total, hv, dk, dv, scale=0.2, dt=torch.float32),
    )
    return qkv, g, beta, weight, conv_pool, ssm_pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("k_heads", "dk", "hv", "dv", "kernel"), [(2, 16, 4, 24, 4), (1, 32, 1, 32, 2), (2, 16, 6, 16, 3)]
)
def test_decode_kernels_match_the_reference_at_each_slot(dtype, k_heads, dk, hv, dv, kernel):
    slots = torch.tensor([5, -1, 0, 3, 6])  # a padding row; slots 1, 2 and 4 belong to nobody
    qkv, g, beta, weight, conv_pool, ssm_pool = random_step(5, 7, k_heads, dk, hv, dv, kernel, dtype, "cpu")
    ref_out, ref_conv, ref_ssm = reference_step(qkv.float(), g, beta.float(), weight.float(), conv_pool.float(),
                                                ssm_pool, slots, k_heads, dk)  # fmt: skip
    x = conv_decode(qkv, weight, conv_pool, slots)
    out = delta_rule_decode(x, g, beta, ssm_pool, slots, k_heads, dk)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 3e-2, "atol": 3e-2}
    torch.testing.assert_close(conv_pool.float(), ref_conv, **tol)
    torch.testing.assert_close(ssm_pool, ref_ssm, **tol)
    live = slots >= 0
    torch.testing.assert_close(out[live].float(), ref_out[live], **tol)


def test_several_steps_carry_the_state_as_the_reference_does():
    """Eight tokens a step at a time give the reference's eight-token run: outputs and final states."""
    k_heads, dk, hv, dv, kernel, steps = 2, 16, 4, 16, 4, 8
    slots = torch.tensor([2, 0])
    qkv, g, beta, weight, conv_pool, ssm_pool = random_step(
        2 * steps, 3, k_heads, dk, hv, dv, kernel, torch.float32, "cpu"
    )
    conv0, ssm0 = conv_pool.clone(), ssm_pool.clone()
    outs = []
    for t in range(steps):
        rows = slice(2 * t, 2 * t + 2)
        x = conv_decode(qkv[rows], weight, conv_pool, slots)
        outs.append(delta_rule_decode(x, g[rows].contiguous(), beta[rows].contiguous(), ssm_pool, slots, k_heads, dk))
    for b, slot in enumerate(slots.tolist()):
        tokens = qkv[b::2]
        x, conv_end = causal_conv1d(tokens, weight, conv0[slot])
        q, k, v = x.split([k_heads * dk, k_heads * dk, hv * dv], dim=-1)
        q = q.unflatten(-1, (k_heads, dk)).repeat_interleave(hv // k_heads, dim=1)
        k = k.unflatten(-1, (k_heads, dk)).repeat_interleave(hv // k_heads, dim=1)
        ref, ssm_end = gated_delta_rule(q, k, v.unflatten(-1, (hv, dv)), g[b::2], beta[b::2], ssm0[slot])
        torch.testing.assert_close(torch.stack([o[b] for o in outs]), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(conv_pool[slot], conv_end, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ssm_pool[slot], ssm_end, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "snapshots",
    [[], [(0, 1, 7), (2, 1, 1), (2, 1, 3)], [(1, 0, 5)]],
    ids=["none", "at-ends", "before-the-token"],
)
def test_a_layers_decode_step_in_place_gives_the_reference_path(layout, snapshots):
    """The layer with the kernels (a decode step read and written at the slots, its snapshots copied after it)
    against the layer without them: outputs, live slots, snapshot slots, and the slots nobody names."""
    _, ours = make_layers(layout)
    slots = [4, 0, 2, 6]
    conv, ssm = random_states(ours.spec, 8)
    hidden = torch.randn(len(slots), SIZES["hidden_size"])
    results = []
    for decode in (None, decode_step):
        ours.decode = decode
        cache = StateCache((conv.clone(), ssm.clone()))
        with torch.no_grad():
            out = ours(hidden, step_context([1] * len(slots), cache, slots, snapshots))
        results.append((out, *cache.tensors))
    for reference, kernels in zip(*results, strict=True):
        torch.testing.assert_close(kernels, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("prompts", ["per-sequence", "varlen"])
def test_decoding_sequences_beside_prompt_chunks_take_the_decode_kernel_in_place(layout, prompts):
    """A step of prompt chunks and one-token sequences (continuous batching's usual step): the one-token sequences
    run through the decode kernels at their slots, as a decode step's would, the chunks through the prompt path on
    their own gathered states; outputs, live slots, snapshots and untouched slots as the reference path gives them.
    A one-token sequence with a snapshot before its token goes with the chunks."""
    from test_delta_rule_fla import torch_varlen

    _, ours = make_layers(layout)
    lengths, slots = [13, 1, 9, 1, 1], [4, 0, 2, 8, 9]
    snapshots = [(0, 5, 5), (1, 1, 6), (2, 9, 7), (4, 0, 1)]  # (b, after n tokens, into slot)
    conv, ssm = random_states(ours.spec, 11)
    hidden = torch.randn(sum(lengths), SIZES["hidden_size"])
    decoded = []

    def decode(qkv, g, beta, weight, conv_pool, ssm_pool, at, k_heads, dk):
        decoded.append(at.tolist())
        return decode_step(qkv, g, beta, weight, conv_pool, ssm_pool, at, k_heads, dk)

    results = []
    for kernels in (False, True):
        ours.decode = decode if kernels else None
        ours.varlen = torch_varlen if kernels and prompts == "varlen" else None
        cache = StateCache((conv.clone(), ssm.clone()))
        with torch.no_grad():
            out = ours(hidden, step_context(lengths, cache, slots, snapshots))
        results.append((out, *cache.tensors))
    assert decoded == [[0, 8]]  # sequences 1 and 3; sequence 4's snapshot before its token sends it with the chunks
    for reference, kernels in zip(*results, strict=True):
        torch.testing.assert_close(kernels, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize(("k_heads", "hv"), [(16, 32), (16, 64)], ids=["hv32", "hv64"])
def test_decode_kernels_at_the_real_heads_eager_and_in_a_cuda_graph(k_heads, hv):
    dk = dv = 128
    batch, total = 64, 80
    slots = torch.randperm(total)[:batch].cuda()
    slots[7] = -1
    step = random_step(batch, total, k_heads, dk, hv, dv, 4, torch.bfloat16, "cuda")
    qkv, g, beta, weight, conv_pool, ssm_pool = step
    _, ref_conv, _ = reference_step(*(t.float().cpu() for t in step[:5]), ssm_pool.cpu(), slots.cpu(), k_heads, dk)
    # the rule's reference on the conv output the kernel hands it, rounded to bf16 as the model's dtype rounds it
    # (on the float conv output instead, bf16's rounding of k and v moves 0.1% of the state's values by up to 0.02)
    conv_out = conv_decode(qkv, weight, conv_pool.clone(), slots).float().cpu()
    ref_out, ref_ssm = reference_rule(conv_out, g.float().cpu(), beta.float().cpu(), ssm_pool.cpu(), slots.cpu(),
                                      k_heads, dk)  # fmt: skip
    for captured in (False, True):
        conv, ssm = conv_pool.clone(), ssm_pool.clone()

        def run(conv=conv, ssm=ssm):
            return delta_rule_decode(conv_decode(qkv, weight, conv, slots), g, beta, ssm, slots, k_heads, dk)

        if captured:
            run(conv.clone(), ssm.clone())  # compile outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = run()
            graph.replay()
        else:
            out = run()
        live = (slots >= 0).cpu()
        torch.testing.assert_close(out.float().cpu()[live], ref_out[live], rtol=3e-2, atol=3e-2)
        torch.testing.assert_close(ssm.cpu(), ref_ssm, rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(conv.float().cpu(), ref_conv, rtol=1e-2, atol=1e-2)
