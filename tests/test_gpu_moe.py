"""The mixture-of-experts path on a CUDA GPU (skipped without one): the fused Triton MoE kernel against the torch
path at Qwen3-30B-A3B's and Mixtral-8x7B's layer shapes in bfloat16, inside a CUDA graph, and the tiny MoE
models end to end (float32 token-identical to transformers with and without CUDA graphs; bfloat16 Triton
backend against the torch reference backend); the Qwen3-30B-A3B preset on dummy weights.

Tolerance of the kernel in bfloat16: the relative (Frobenius) error of its output against the torch path
computed in float32 on the same bf16 inputs is at most 1e-2, the bound the torch path's own bf16 output
is held to as well. In float32 (IEEE dot products, no TF32) the two agree to 1e-5 (rtol and atol).
"""

import random

import pytest
import torch
from test_gpu import bfloat16_backend_agrees_with_torch_backend, greedy_with_logits
from test_hf_parity import hf_greedy

from nanostream import LLM, SamplingParams
from nanostream.kernels.fused_moe import fused_moe
from nanostream.layers.moe_reference import moe_experts
from nanostream.testing import TINY_PRESETS, make_tiny_model

pytestmark = pytest.mark.gpu
BF16_TOL = 1e-2

SHAPES = {  # experts, top-k, hidden, intermediate (per rank)
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "qwen3-30b-a3b tp2": (128, 8, 2048, 384),
    "mixtral-8x7b": (8, 2, 4096, 14336),
}


def layer_inputs(shape, tokens, dtype, seed=0):
    num_experts, k, hidden, inter = shape
    gen = torch.Generator("cuda").manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=gen).mul_(0.02).to(dtype)
    w2 = torch.randn(num_experts, hidden, inter, device="cuda", generator=gen).mul_(0.02).to(dtype)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(dtype)
    scores = torch.rand(tokens, num_experts, device="cuda", generator=gen)
    weights, ids = torch.softmax(4 * scores, -1).topk(k, dim=-1)
    return x, w13, w2, (weights / weights.sum(-1, keepdim=True)).to(dtype), ids


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("tokens", [1, 16, 64, 256, 2048])
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_moe_matches_the_torch_path_in_bfloat16(shape, tokens):
    x, w13, w2, weights, ids = layer_inputs(SHAPES[shape], tokens, torch.bfloat16)
    exact = moe_experts(x.float(), w13.float(), w2.float(), weights.float(), ids)
    fused, reference = fused_moe(x, w13, w2, weights, ids), moe_experts(x, w13, w2, weights, ids)
    assert torch.isfinite(fused).all()
    assert rel(fused, exact) < BF16_TOL and rel(reference, exact) < BF16_TOL, (rel(fused, exact), rel(reference, exact))


@pytest.mark.parametrize("tokens", [1, 33, 300])
def test_fused_moe_matches_the_torch_path_in_float32(tokens):
    x, w13, w2, weights, ids = layer_inputs((16, 4, 256, 96), tokens, torch.float32, seed=1)
    torch.testing.assert_close(
        fused_moe(x, w13, w2, weights, ids), moe_experts(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5
    )


def test_fused_moe_replays_in_a_cuda_graph_with_new_routing():
    x, w13, w2, weights, ids = layer_inputs(SHAPES["qwen3-30b-a3b"], 64, torch.bfloat16)
    fused_moe(x, w13, w2, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, ids)
    for seed in (1, 2):  # new tokens and routing in the captured buffers
        nx, _, _, nweights, nids = layer_inputs(SHAPES["qwen3-30b-a3b"], 64, torch.bfloat16, seed=seed)
        x.copy_(nx), weights.copy_(nweights), ids.copy_(nids)
        graph.replay()
        torch.testing.assert_close(out, fused_moe(x, w13, w2, weights, ids), rtol=0, atol=0)


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss"])
def moe_dir(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp(request.param), **TINY_PRESETS[request.param])


@pytest.mark.parametrize("backend, enforce_eager", [("torch", True), ("triton", True), ("triton", False)])
def test_cuda_float32_moe_matches_hf_with_prefix_hits_chunks_and_preemption(
    moe_dir, hf_model_cache, backend, enforce_eager
):
    rng = random.Random(0)
    shared = [rng.randrange(3, 500) for _ in range(40)]
    prompts = [shared + [rng.randrange(3, 500) for _ in range(n)] for n in (1, 9, 70, 23, 150, 4)]
    params = SamplingParams(temperature=0, max_tokens=32, min_tokens=32)
    llm = LLM(str(moe_dir), device="cuda", dtype="float32", attention_backend=backend, enforce_eager=enforce_eager,
              kvcache_block_size=16, num_kvcache_blocks=30, max_num_batched_tokens=64, max_num_seqs=8)  # fmt: skip
    runner = llm.engine.runner
    assert (runner.graphs is not None) == (runner.prefill_graphs is not None) == (not enforce_eager)
    outputs = llm.generate(prompts[:1], params, use_tqdm=False) + llm.generate(prompts[1:], params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    hf = hf_model_cache(moe_dir)
    assert [o.token_ids for o in outputs] == [hf_greedy(hf, p, 32) for p in prompts]


def test_bfloat16_triton_backend_agrees_with_torch_backend_on_moe_models(moe_dir):
    # test_gpu.py's check on the MoE models: the Triton backend runs the fused kernel in CUDA graphs. Some
    # steps fall well below cosine 0.999 (on the H200, 3 of one prompt's 32 down to 0.84), with the same tokens so far:
    # where a token's K-th and (K+1)-th experts are a bf16 rounding apart in its router, the two backends'
    # roundings route it differently, and a whole expert's output changes (a third of the mix in this test
    # model, 3 of 8 experts), not a rounding of it. The float32 tests above are exact; the kernel's bf16
    # error is bounded at the real shapes below.
    bfloat16_backend_agrees_with_torch_backend(moe_dir, "triton", at_rounding=0.8)


def test_the_torch_moe_path_runs_in_the_prefill_graphs_in_bfloat16(moe_dir):
    # The torch backend captures prefill graphs too (at one GPU): its MoE path must not sync the host there.
    llm = LLM(str(moe_dir), device="cuda", dtype="bfloat16", attention_backend="torch", max_num_seqs=8,
              max_model_len=1024, max_num_batched_tokens=256, num_kvcache_blocks=64)  # fmt: skip
    assert llm.engine.runner.prefill_graphs is not None
    out = llm.generate([[5, 6, 7] * 40], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert len(out[0].token_ids) == 8


def test_the_qwen3_30b_a3b_preset_runs_on_dummy_weights_with_finite_bfloat16_logits(tmp_path, load_app):
    # apps/presets.py's shape, every layer (61 GB of bf16 weights made on the device), through the engine.
    presets = load_app("presets")
    path = make_tiny_model(tmp_path, **presets.PRESETS[presets.QWEN3_30B_A3B])
    llm = LLM(str(path), dtype="bfloat16", max_model_len=2048, max_num_seqs=8, enforce_eager=True,
              **presets.engine_defaults(presets.QWEN3_30B_A3B))  # fmt: skip
    ids, logits = greedy_with_logits(llm, list(range(3, 503)), 8)
    assert len(ids) == 8 and torch.isfinite(logits).all()
    assert logits.std(-1).min().item() > 0.05  # not flattened to a constant
