"""DeepSeek's router (layers/grouped_router.py) and the two families on it that attend as Llama does: GLM-4.5
(``Glm4MoeForCausalLM``) and MiniMax-M2 (``MiniMaxM2ForCausalLM``).

The router alone chooses the experts transformers' routers choose and weighs them to the bit, on random logits:
with groups, scaling and a correction bias large enough to change the choice, in float32 and (from the loaded
models) in bfloat16 with transformers' dtypes. The tiny models give transformers' greedy tokens in float32 for
prompts of 1 to 300 tokens, in chunks and from prefix-cache hits; what nanostream does not run is refused by name;
two ranks (threads, gloo) give one rank's logits, the router and its bias whole on each.
"""

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_hf_parity import assert_matches_hf, greedy, random_prompts
from test_tp import in_threads
from transformers import AutoConfig, AutoModelForCausalLM, Glm4MoeConfig, MiniMaxM2Config
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2TopKRouter

from nanostream import LLM, ModelLoadError, SamplingParams
from nanostream.distributed import SINGLE, TensorParallel
from nanostream.engine.runner.kv_pool import WarmupChunk, allocate_kv_pool
from nanostream.engine.runner.step_inputs import pack_step
from nanostream.engine.sequence import Sequence
from nanostream.kernels.fused_moe import fused_moe
from nanostream.layers.attention import ForwardContext
from nanostream.layers.attention_backend import TorchAttention
from nanostream.layers.grouped_router import GroupedTopKRouter, grouped_topk
from nanostream.layers.layer_kernels import LayerKernels
from nanostream.layers.moe_spec import MoESpec
from nanostream.models import decoder_spec, load_model
from nanostream.testing import TINY_PRESETS, make_tiny_model, tiny_config

CPU = torch.device("cpu")
FAMILIES = ["glm4_moe", "minimax_m2"]
ROUTER = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return {name: make_tiny_model(tmp_path_factory.mktemp(name), **TINY_PRESETS[name]) for name in FAMILIES}


def by_expert(weights, ids):
    """(weights, ids) with each row's experts in id order: torch.topk's unsorted order is no contract."""
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


ROUTERS = {
    "glm_groups": (Glm4MoeConfig, dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                                       routed_scaling_factor=2.5, norm_topk_prob=True)),
    "glm_plain": (Glm4MoeConfig, dict(n_routed_experts=8, num_experts_per_tok=3, norm_topk_prob=False)),
    "minimax": (MiniMaxM2Config, dict(num_local_experts=16, num_experts_per_tok=4)),
}  # fmt: skip


@pytest.mark.parametrize("case", ROUTERS)
def test_the_router_chooses_and_weighs_as_transformers_does(case):
    config_cls, options = ROUTERS[case]
    config = config_cls(architectures=[config_cls.__name__.replace("Config", "ForCausalLM")], **ROUTER, **options)
    moe = decoder_spec(config, max_model_len=256).moe
    gen = torch.Generator().manual_seed(0)
    weight = 0.3 * torch.randn(moe.num_experts, 32, generator=gen)
    bias = 0.5 * torch.randn(moe.num_experts, generator=gen)  # of the scores' own spread: it moves the choice
    x = torch.randn(256, 32, generator=gen)
    theirs = Glm4MoeTopkRouter(config) if config_cls is Glm4MoeConfig else MiniMaxM2TopKRouter(config)
    ours = GroupedTopKRouter(32, moe)
    with torch.no_grad():
        for router in (theirs, ours):
            router.weight.copy_(weight)
        ours.e_score_correction_bias.copy_(bias)
        if config_cls is Glm4MoeConfig:
            theirs.e_score_correction_bias.copy_(bias)
            _, their_weights, their_ids = theirs(x)
        else:
            _, their_weights, their_ids = theirs(x, bias)
        weights, ids = ours(x)
    assert weights.dtype == their_weights.dtype == torch.float32
    got, expected = by_expert(weights, ids), by_expert(their_weights, their_ids)
    assert torch.equal(got[1], expected[1])
    assert torch.equal(got[0], expected[0])  # the unbiased scores, renormalised and scaled, to the bit
    scores = torch.sigmoid(x @ weight.T)
    unbiased = grouped_topk(scores, None, moe.top_k, moe.groups, moe.topk_groups).sort(-1).values
    assert (unbiased != got[1]).any(-1).float().mean() > 0.3  # the bias changes many rows' choice
    if moe.groups > 1:
        ungrouped = grouped_topk(scores, ours.e_score_correction_bias, moe.top_k).sort(-1).values
        assert (ungrouped != got[1]).any(-1).float().mean() > 0.2  # and so do the groups


def test_softmax_scoring_chooses_among_the_best_groups_by_their_two_best_scores():
    # No transformers router scores by softmax with groups: a row-by-row reference of the rule instead.
    config = Glm4MoeConfig(architectures=["Glm4MoeForCausalLM"], **ROUTER, n_routed_experts=12, num_experts_per_tok=3,
                           n_group=3, topk_group=2, routed_scaling_factor=1.5, scoring_func="softmax")  # fmt: skip
    moe = decoder_spec(config, max_model_len=256).moe
    assert (moe.scoring, moe.groups, moe.topk_groups, moe.scaling) == ("softmax", 3, 2, 1.5)
    router = GroupedTopKRouter(32, moe)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        router.weight.copy_(torch.randn(12, 32, generator=gen))
        router.e_score_correction_bias.copy_(0.05 * torch.randn(12, generator=gen))
        x = torch.randn(64, 32, generator=gen)
        weights, ids = by_expert(*router(x))
    scores = torch.softmax(x @ router.weight.T, dim=-1)
    for t in range(64):
        choice = (scores[t] + router.e_score_correction_bias).tolist()
        ranked = sorted(range(3), key=lambda g: -sum(sorted(choice[4 * g : 4 * g + 4])[-2:]))
        allowed = [e for g in ranked[:2] for e in range(4 * g, 4 * g + 4)]
        chosen = sorted(sorted(allowed, key=lambda e: -choice[e])[:3])
        assert ids[t].tolist() == chosen
        expected = scores[t, chosen] / scores[t, chosen].sum() * 1.5
        torch.testing.assert_close(weights[t], expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", FAMILIES)
def test_bfloat16_routers_keep_transformers_dtypes_and_choices(name, dirs):
    # GLM-4.5's gate and bias stay float32 (transformers keeps them so), MiniMax-M2's are the model's dtype.
    path = dirs[name]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    spec = decoder_spec(AutoConfig.from_pretrained(path), max_model_len=256)
    ours = load_model(spec, LayerKernels(TorchAttention()), path, dtype=torch.bfloat16, device=CPU)
    layer = spec.moe.layers[0]
    theirs, gate = hf.model.layers[layer].mlp, ours.model.layers[layer].mlp.gate
    bias = theirs.gate.e_score_correction_bias if name == "glm4_moe" else theirs.e_score_correction_bias
    assert (gate.weight.dtype, gate.e_score_correction_bias.dtype) == (theirs.gate.weight.dtype, bias.dtype)
    assert gate.weight.dtype == (torch.float32 if name == "glm4_moe" else torch.bfloat16)
    x = torch.randn(128, spec.hidden_size, generator=torch.Generator().manual_seed(2)).bfloat16()
    with torch.no_grad():
        _, their_weights, their_ids = theirs.gate(x) if name == "glm4_moe" else theirs.gate(x, bias)
        got, expected = by_expert(*gate(x)), by_expert(their_weights, their_ids)
    assert torch.equal(got[1], expected[1]) and torch.equal(got[0], expected[0])


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_matches_hf_from_1_to_300_tokens_in_chunks_and_from_prefix_hits(name, dirs, hf_model_cache):
    path = dirs[name]
    shared = random_prompts([64], seed=40)[0]
    prompts = random_prompts([1, 300, 37], seed=41) + [shared + tail for tail in random_prompts([5, 1, 30], seed=42)]
    params = greedy(12)
    llm = LLM(str(path), device="cpu", dtype="float32", kvcache_block_size=16, max_num_batched_tokens=64,
              max_num_seqs=8)  # fmt: skip
    first = llm.generate(prompts[:4], params, use_tqdm=False)  # the 300 tokens take five steps' budgets
    rest = llm.generate(prompts[4:], params, use_tqdm=False)
    assert [o.num_cached_tokens for o in rest] == [64, 64]
    assert llm.engine.stats().steps["prefill"] + llm.engine.stats().steps["mixed"] >= 5
    assert_matches_hf(hf_model_cache(path), prompts, first + rest, params.max_tokens)


def test_each_declaration_reads_its_router_and_layers():
    glm = decoder_spec(tiny_config("Glm4MoeForCausalLM"), max_model_len=256)
    assert glm.moe == MoESpec(8, 3, 32, renormalize=True, float32_weights=True, layers=(1, 2, 3),
                              shared_expert_intermediate_size=32, shared_expert_gate=False, router="grouped_topk",
                              scoring="sigmoid", correction_bias=True, groups=4, topk_groups=2, scaling=2.5,
                              float32_router=True)  # fmt: skip
    assert (glm.qk_norm, glm.qkv_bias, glm.o_bias, glm.rope.rotary_dim, glm.rope.interleaved) == (True, True, 0, 8, 0)
    assert glm.unused_tensors == ("model.layers.4.",)  # its multi-token-prediction layer
    air = decoder_spec(tiny_config("Glm4MoeForCausalLM", use_qk_norm=False, n_shared_experts=2, num_mtp_layers=0,
                                   topk_method="greedy"), max_model_len=256)  # fmt: skip
    assert not air.qk_norm and air.unused_tensors == ()
    assert (air.moe.shared_expert_intermediate_size, air.moe.correction_bias, air.moe.groups) == (64, False, 1)
    assert decoder_spec(tiny_config("Glm4MoeForCausalLM", first_k_dense_replace=4), max_model_len=256).moe is None
    minimax = decoder_spec(tiny_config("MiniMaxM2ForCausalLM", num_mtp_modules=2), max_model_len=256)
    assert minimax.moe == MoESpec(8, 2, 32, renormalize=True, float32_weights=True, layers=(0, 1, 2),
                                  router="grouped_topk", scoring="sigmoid", correction_bias=True)  # fmt: skip
    assert (minimax.qk_norm, minimax.qk_norm_whole, minimax.rope.rotary_dim) == (True, True, 8)
    assert minimax.unused_tensors == ("model.layers.3.", "model.layers.4.")


@pytest.mark.parametrize(
    ("name", "overrides", "message"),
    [
        ("Glm4MoeForCausalLM", dict(scoring_func="sqrtsoftplus"), "scoring_func='sqrtsoftplus' is not supported"),
        ("Glm4MoeForCausalLM", dict(topk_method="group_limited_greedy"), "topk_method='group_limited_greedy'"),
        ("Glm4MoeForCausalLM", dict(n_group=3), "n_group=3, topk_group=2 is not supported: 8 experts do not split"),
        ("Glm4MoeForCausalLM", dict(topk_group=5), "topk_group=5 is not supported: the top 5 of 4 groups"),
        ("Glm4MoeForCausalLM", dict(topk_group=1, num_experts_per_tok=3), "3 experts cannot be taken from 1 group"),
        ("Glm4MoeForCausalLM", dict(first_k_dense_replace=-1), "first_k_dense_replace=-1 is not supported"),
        ("Glm4MoeForCausalLM", dict(routed_scaling_factor=float("inf")), "routed_scaling_factor=inf is not supported"),
        ("MiniMaxM2ForCausalLM", dict(qk_norm_type="per_head"), "qk_norm_type='per_head' is not supported"),
        ("MiniMaxM2ForCausalLM", dict(attn_type_list=[1, 0, 1]), r"attn_type_list=\[1, 0, 1\] is not supported"),
        ("MiniMaxM2ForCausalLM", dict(use_routing_bias=False), "use_routing_bias=False is not supported"),
        ("MiniMaxM2ForCausalLM", dict(shared_intermediate_size=64), "shared_intermediate_size=64 is not supported"),
        ("MiniMaxM2ForCausalLM", dict(sliding_window=64), "sliding_window=64 is not supported"),
        ("MiniMaxM2ForCausalLM", dict(num_experts_per_tok=9), "num_experts_per_tok=9 of num_local_experts=8"),
    ],
)
def test_a_config_nanostream_does_not_run_is_refused_naming_the_value(name, overrides, message):
    with pytest.raises(ModelLoadError, match=message):
        decoder_spec(tiny_config(name, **overrides), max_model_len=256)


@pytest.mark.parametrize("name", FAMILIES)
def test_both_expert_layouts_and_a_multi_token_prediction_layer_load(name, dirs, tmp_path, caplog):
    # The published layout (MiniMax-M2's bias on block_sparse_moe, experts.N.w1) and transformers' stacked one (its
    # bias on mlp) give the same model; the checkpoint's MTP layer after the decoder's is skipped with a line.
    stacked = make_tiny_model(tmp_path / "stacked", **TINY_PRESETS[name], expert_layout="stacked")
    names = set(load_file(dirs[name] / "model.safetensors"))
    block = "block_sparse_moe" if name == "minimax_m2" else "mlp.gate"
    assert f"model.layers.1.{block}.e_score_correction_bias" in names
    with_mtp = tmp_path / "mtp"
    shutil.copytree(dirs[name], with_mtp)
    config = json.loads((with_mtp / "config.json").read_text())
    config.setdefault("num_mtp_modules", 1)  # MiniMax-M2's name for them (GLM-4.5's num_nextn_predict_layers: 1)
    (with_mtp / "config.json").write_text(json.dumps(config))
    tensors = load_file(with_mtp / "model.safetensors")
    mtp = config["num_hidden_layers"]
    tensors[f"model.layers.{mtp}.eh_proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, with_mtp / "model.safetensors")
    prompt = random_prompts([20], seed=43)
    outs = []
    with caplog.at_level(logging.INFO, logger="nanostream.models.loader"):
        for path in (dirs[name], stacked, with_mtp):
            llm = LLM(str(path), device="cpu", dtype="float32", kvcache_block_size=16)
            outs.append(llm.generate(prompt, greedy(6), use_tqdm=False)[0].token_ids)
    assert outs[0] == outs[1] == outs[2]
    assert f"1 tensors under model.layers.{mtp}.* not loaded" in caplog.text


def step_logits(spec, path, tp: TensorParallel):
    model = load_model(spec, LayerKernels(TorchAttention()), path, dtype=torch.float32, device=CPU, tp=tp)
    kv = allocate_kv_pool(spec, 16, 8, torch.float32, CPU, model.shard.num_kv_heads)
    chunks = []
    for i, (cached, new) in enumerate([(0, 30), (8, 1), (0, 3)]):
        seq = Sequence(f"s{i}", list(range(3 + i, 3 + i + cached + new)), SamplingParams(), max_tokens=1,
                       sampling_seed=0, stop_token_ids=frozenset())  # fmt: skip
        seq.block_table = list(range(4 * i, 4 * i + 4))
        chunks.append(WarmupChunk(seq, cached, new))
    inputs = pack_step(chunks, 8, CPU)
    with torch.inference_mode():
        hidden = model(inputs.input_ids, inputs.positions, ForwardContext(inputs.meta, kv))
        return model, model.compute_logits(hidden[inputs.sample_rows])


@pytest.mark.parametrize(("name", "size"), [("glm4_moe", 2), ("minimax_m2", 2), ("minimax_m2", 4), ("olmo2", 2)])
def test_ranks_give_one_ranks_logits_with_the_router_whole_on_each(name, size, tmp_path, monkeypatch):
    # The whole-projection QK-norms (MiniMax-M2, OLMo 2) take their statistics over the ranks' rows: one more
    # all-reduce a layer; at 4 ranks each of MiniMax-M2's 2 KV heads is on two ranks.
    path = make_tiny_model(tmp_path, **TINY_PRESETS[name])
    spec = decoder_spec(AutoConfig.from_pretrained(path), max_model_len=256)
    reduces, plain = [], TensorParallel.all_reduce
    monkeypatch.setattr(TensorParallel, "all_reduce", lambda self, x: reduces.append(1) or plain(self, x))
    whole, expected = step_logits(spec, path, SINGLE)
    out = in_threads(size, lambda tp: step_logits(spec, path, tp))
    per_layer = 2 + spec.qk_norm_whole  # o_proj's, the MLP's, the QK-norms' statistics
    assert len(reduces) == size * (1 + per_layer * spec.num_layers)  # the embedding's, then per layer; every rank's
    for rank, (model, logits) in out.items():
        assert (logits is None) == (rank > 0)
        if spec.qk_norm_whole:  # this rank's heads' rows of the norm's weight
            assert model.model.layers[0].self_attn.attn.q_norm.weight.shape == (spec.num_heads // size * spec.head_dim,)
        if spec.moe is not None:
            layer = spec.moe.layers[0]
            gate, one = model.model.layers[layer].mlp.gate, whole.model.layers[layer].mlp.gate
            assert torch.equal(gate.weight, one.weight)
            assert torch.equal(gate.e_score_correction_bias, one.e_score_correction_bias)
    torch.testing.assert_close(out[0][1], expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[0][1].argmax(-1), expected.argmax(-1))


def test_the_triton_backend_runs_the_fused_moe_kernel_on_the_routers_weights(dirs, hf_model_cache):
    # Under Triton's interpreter on CPU (one short workload): the kernel takes the router's float32 ids and weights,
    # scaled to sum to 2.5 (GLM-4.5's routed_scaling_factor), beside the shared expert.
    path = dirs["glm4_moe"]
    prompts = random_prompts([1, 40], seed=44)
    llm = LLM(str(path), device="cpu", dtype="float32", attention_backend="triton", kvcache_block_size=8,
              max_num_batched_tokens=32, max_num_seqs=4)  # fmt: skip
    assert llm.engine.runner.model.model.layers[1].mlp.experts.kernel is fused_moe
    params = greedy(6)
    assert_matches_hf(hf_model_cache(path), prompts, llm.generate(prompts, params, use_tqdm=False), params.max_tokens)
