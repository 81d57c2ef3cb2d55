"""The fused MoE kernel (nanostream.kernels.fused_moe) against the torch reference
(layers.moe_reference.moe_experts), and the reference against a plain per-token loop over each token's experts:
SiLU-and-mul experts, Gemma 4's GELU-and-mul (tanh approximation), and gpt-oss's (biases on gate/up and down,
the clamped SwiGLU, weights large enough that the clamp bites).

On CPU the kernel runs under Triton's interpreter (small shapes, float32); the gpu-marked cases in
tests/test_gpu_moe.py run it compiled, in bfloat16, at Qwen3-30B-A3B's and Mixtral's shapes.
"""

import pytest
import torch

from nanostream.kernels import moe_align
from nanostream.kernels.expert_ops import ClampedSwiGLU, gated_activation
from nanostream.kernels.fused_moe import TILES, MoETile, fused_moe, tile_for
from nanostream.kernels.moe_align import align_by_expert
from nanostream.layers.moe_reference import moe_experts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def per_token_loop(x, w13, w2, weights, ids, w13_bias=None, w2_bias=None, activation="silu"):
    """float64, one token and one of its experts at a time: the definition."""
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e].double() @ x[t].double()  # [2I]
            if w13_bias is not None:
                h = h + w13_bias[e].double()
            gate, up = h[:inter], h[inter:]
            y = w2[e].double() @ gated_activation(activation, gate, up)  # [H]
            if w2_bias is not None:
                y = y + w2_bias[e].double()
            out[t] += weights[t, j].double() * y
    return out


def routing(num_tokens, num_experts, k, gen, *, unused=(), skew=False):
    """topk ids [T, K] (distinct per token, never an expert of ``unused``) and normalised weights [T, K]."""
    allowed = torch.tensor([e for e in range(num_experts) if e not in unused])
    scores = torch.rand(num_tokens, len(allowed), generator=gen)
    if skew:  # uneven loads: expert 0 (if allowed) is in almost every token's top k
        scores[:, 0] += 0.9
    ids = allowed[scores.topk(k, dim=-1).indices]
    weights = torch.rand(num_tokens, k, generator=gen) + 0.1
    return ids.to(DEVICE), (weights / weights.sum(-1, keepdim=True)).to(DEVICE)


def experts(num_experts, hidden, inter, gen, dtype=torch.float32):
    w13 = 0.2 * torch.randn(num_experts, 2 * inter, hidden, generator=gen)
    w2 = 0.2 * torch.randn(num_experts, hidden, inter, generator=gen)
    return w13.to(DEVICE, dtype), w2.to(DEVICE, dtype)


CASES = {  # (tokens, experts, top-k, hidden, intermediate, routing)
    "one token": (1, 8, 2, 64, 32, {}),
    "uneven loads": (37, 8, 2, 48, 40, {"skew": True}),
    "an expert with no tokens": (9, 6, 3, 64, 48, {"unused": (2, 5)}),
    "more tokens than a tile": (70, 4, 1, 32, 16, {}),
}


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("case", CASES)
def test_fused_moe_matches_the_torch_path(case, activation):
    num_tokens, num_experts, k, hidden, inter, how = CASES[case]
    gen = torch.Generator().manual_seed(list(CASES).index(case))
    x = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE)
    w13, w2 = experts(num_experts, hidden, inter, gen)
    ids, weights = routing(num_tokens, num_experts, k, gen, **how)
    ref = moe_experts(x, w13, w2, weights, ids, activation=activation)
    exact = per_token_loop(x, w13, w2, weights, ids, activation=activation)
    torch.testing.assert_close(ref.double(), exact, rtol=1e-5, atol=1e-5)
    if activation != "silu":  # the activation matters
        assert not torch.allclose(ref, moe_experts(x, w13, w2, weights, ids), atol=1e-3)
    tiles = [None, MoETile(16, 16, 16, 2), MoETile(32, 32, 32, 1)]  # the table's, and two more (N, K tails)
    for tile in tiles:
        out = fused_moe(x, w13, w2, weights, ids, tile=tile, activation=activation)
        assert out.shape == x.shape and out.dtype == x.dtype
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


GPT_OSS_CASES = {  # (tokens, experts, top-k, hidden, intermediate, the down bias: rank 0's, or none at the others)
    "one token": (1, 8, 4, 64, 32, True),
    "uneven loads": (37, 8, 2, 48, 40, True),
    "a rank past the first (no down bias)": (21, 6, 3, 64, 48, False),
}


@pytest.mark.parametrize("case", GPT_OSS_CASES)
def test_fused_moe_with_gpt_oss_biases_and_clamped_swiglu_matches_the_torch_path(case):
    num_tokens, num_experts, k, hidden, inter, down_bias = GPT_OSS_CASES[case]
    gen = torch.Generator().manual_seed(10 + list(GPT_OSS_CASES).index(case))
    act = ClampedSwiGLU(alpha=1.702, limit=7.0)
    x = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE)
    w13, w2 = experts(num_experts, hidden, inter, gen)
    w13 = w13 * (8 / hidden**0.5 / 0.2)  # gate/up of std ~8: the clamp at 7 bites on both sides
    w13_bias = torch.randn(num_experts, 2 * inter, generator=gen).to(DEVICE)
    w2_bias = torch.randn(num_experts, hidden, generator=gen).to(DEVICE) if down_bias else None
    ids, weights = routing(num_tokens, num_experts, k, gen, skew=True)
    options = dict(w13_bias=w13_bias, w2_bias=w2_bias, activation=act)
    gate_up = torch.einsum("eih,th->tei", w13, x) + w13_bias  # [T, E, 2I]: every expert's pre-activations
    assert (gate_up[..., :inter] > act.limit).any() and (gate_up[..., inter:].abs() > act.limit).any()
    ref = moe_experts(x, w13, w2, weights, ids, **options)
    exact = per_token_loop(x, w13, w2, weights, ids, **options)
    torch.testing.assert_close(ref.double(), exact, rtol=1e-5, atol=1e-4)
    assert not torch.allclose(ref, moe_experts(x, w13, w2, weights, ids), atol=1e-2)  # the options matter
    for tile in [None, MoETile(16, 16, 16, 2), MoETile(32, 32, 32, 1)]:
        out = fused_moe(x, w13, w2, weights, ids, tile=tile, **options)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)


def runs(pairs, block_experts, num_padded, block_m) -> dict[int, list[int]]:
    """Each expert's run as the sorted list of what it holds (pairs and pads): within a run the order is free."""
    by_expert: dict[int, list[int]] = {}
    for b in range(int(num_padded) // block_m):
        by_expert.setdefault(int(block_experts[b]), []).extend(pairs[b * block_m : (b + 1) * block_m].tolist())
    return {e: sorted(held) for e, held in by_expert.items()}


def test_alignment_pads_each_experts_run_to_the_block_and_bounds_the_length_statically():
    ids = torch.tensor([[0, 2], [2, 0], [2, 1]], device=DEVICE)  # pairs 0..5; expert 3 gets none
    pairs, block_experts, num_padded = align_by_expert(ids, 4, 4)
    pad = 6  # T*K: a pair that does not exist
    assert num_padded.tolist() == [12] and block_experts.tolist()[:3] == [0, 1, 2]
    assert runs(pairs.cpu(), block_experts.cpu(), 12, 4) == {
        0: [0, 3, pad, pad],
        1: [5, pad, pad, pad],
        2: [1, 2, 4, pad],
    }
    assert pairs[12:].tolist() == [pad] * 8
    assert len(pairs) == 20  # T*K + min(E, T*K) * (block - 1), rounded up to the block: any routing fits


@pytest.mark.parametrize("num_tokens, num_experts, k, block_m", [(1, 128, 8, 16), (256, 128, 8, 64), (37, 8, 2, 16)])
def test_the_alignment_kernel_makes_the_runs_the_torch_ops_make(monkeypatch, num_tokens, num_experts, k, block_m):
    gen = torch.Generator().manual_seed(num_tokens)
    ids, _ = routing(num_tokens, num_experts, k, gen, skew=True)
    assert ids.numel() <= moe_align.ALIGN_KERNEL_PAIRS
    kernel = [t.cpu() for t in align_by_expert(ids, num_experts, block_m)]
    monkeypatch.setattr(moe_align, "ALIGN_KERNEL_PAIRS", 0)  # the torch ops (prefill's path)
    torch_ops = [t.cpu() for t in align_by_expert(ids, num_experts, block_m)]
    assert kernel[0].shape == torch_ops[0].shape and kernel[1].shape == torch_ops[1].shape
    assert kernel[2].tolist() == torch_ops[2].tolist()
    used = int(kernel[2]) // block_m
    assert kernel[1][:used].tolist() == torch_ops[1][:used].tolist()
    assert runs(*kernel[:2], kernel[2], block_m) == runs(*torch_ops[:2], torch_ops[2], block_m)
    assert (kernel[0][int(kernel[2]) :] == ids.numel()).all()  # past the runs: pads


def test_the_launcher_checks_layouts():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 32, generator=gen).to(DEVICE)
    w13, w2 = experts(4, 32, 16, gen)
    ids, weights = routing(3, 4, 2, gen)
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe(x, w13, w2[:, :, :8], weights, ids)
    with pytest.raises(ValueError, match="rows must be contiguous"):
        fused_moe(x, w13.transpose(1, 2).contiguous().transpose(1, 2), w2, weights, ids)
    with pytest.raises(ValueError, match="share a dtype"):
        fused_moe(x.double(), w13, w2, weights, ids)
    with pytest.raises(ValueError, match="topk_weights must be contiguous"):
        fused_moe(x, w13, w2, weights.t().contiguous().t(), ids)
    with pytest.raises(ValueError, match=r"w13_bias must be a float \[4, 32\]"):
        fused_moe(x, w13, w2, weights, ids, w13_bias=torch.zeros(4, 16, device=DEVICE))
    with pytest.raises(ValueError, match=r"w2_bias must be a float \[4, 32\] with contiguous rows"):
        fused_moe(x, w13, w2, weights, ids, w2_bias=torch.zeros(32, 4, device=DEVICE).t())
    with pytest.raises(
        ValueError, match=r"activation is one of \('silu', 'gelu_tanh'\) or a ClampedSwiGLU, not 'gelu'"
    ):
        fused_moe(x, w13, w2, weights, ids, activation="gelu")


def test_tiles_come_from_the_table_by_token_count():
    small, large = tile_for(1, 128, 2048, 768, torch.bfloat16), tile_for(8192, 128, 2048, 768, torch.bfloat16)
    assert small.block_m <= large.block_m
    assert tile_for(10**9, 8, 64, 32, torch.float32) == TILES["default"][-1][1]  # the last row holds any count
    assert tile_for(64, 128, 2048, 768, torch.bfloat16) == TILES[128, 2048, 768, "bfloat16"][0][1]  # by shape
