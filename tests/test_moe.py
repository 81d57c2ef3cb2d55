"""The mixture-of-experts families (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral): greedy output
token-identical to transformers for prompts of 1 to 700 tokens through prefix-cache hits and chunked
prefill, what the declarations read and refuse, the two expert layouts of a checkpoint, and random
weights from a directory holding only a config and a tokenizer (``load_format="dummy"``); and (slow) the
same greedy streams through ``nanostream serve`` and ``AsyncClient``.

test_hf_parity.py runs its shared workloads (mixed batches, chunks, preemption, prefill logits) on these
models too; test_tp.py splits them over ranks; test_fused_moe.py checks the kernel.
"""

import dataclasses
import json

import anyio
import pytest
import torch
from helpers import engine_processes, run_in_thread
from safetensors.torch import load_file, save_file
from test_hf_parity import assert_matches_hf, greedy, hf_greedy, random_prompts
from transformers import AutoConfig, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from nanostream import LLM, AsyncClient, ModelLoadError, SamplingParams
from nanostream.distributed.group import TensorParallel
from nanostream.engine.runner.kv_pool import WarmupChunk, allocate_kv_pool
from nanostream.engine.runner.step_inputs import pack_step
from nanostream.engine.sequence import Sequence
from nanostream.kernels.fused_moe import fused_moe
from nanostream.layers.attention import ForwardContext
from nanostream.layers.attention_backend import TorchAttention
from nanostream.layers.layer_kernels import LayerKernels
from nanostream.layers.moe_reference import moe_experts
from nanostream.layers.moe_spec import MoESpec
from nanostream.models import DecoderForCausalLM, decoder_spec, load_model
from nanostream.models.loader import load_weights
from nanostream.testing import TINY_PRESETS, make_tiny_model

MOE = ["qwen3_moe", "qwen2_moe", "mixtral"]
CPU = torch.device("cpu")
SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    return {name: make_tiny_model(tmp_path_factory.mktemp(name), **TINY_PRESETS[name]) for name in MOE}


@pytest.mark.parametrize("name", MOE)
def test_greedy_matches_hf_from_1_to_700_tokens_with_prefix_hits_and_chunked_prefill(name, moe_dirs, hf_model_cache):
    path = moe_dirs[name]
    shared = random_prompts([64], seed=20)[0]
    alone = random_prompts([1, 700, 37], seed=21)
    prompts = alone + [shared + tail for tail in random_prompts([5, 1, 30], seed=22)]
    params = greedy(16)
    llm = LLM(str(path), device="cpu", kvcache_block_size=16, max_num_batched_tokens=256, max_num_seqs=8)
    first = llm.generate(prompts[:4], params, use_tqdm=False)  # the 700 tokens take three steps' budgets
    rest = llm.generate(prompts[4:], params, use_tqdm=False)
    assert [o.num_cached_tokens for o in rest] == [64, 64]  # the shared prefix's four blocks
    stats = llm.engine.stats()
    assert stats.steps["prefill"] + stats.steps["mixed"] >= 3
    assert_matches_hf(hf_model_cache(path), prompts, first + rest, params.max_tokens)


def test_the_triton_backend_runs_the_fused_moe_kernel_token_exact(moe_dirs, hf_model_cache):
    # Under Triton's interpreter on CPU (slow: one short workload): Qwen2-MoE, for its shared expert and
    # dense layer beside the routed experts; the kernel itself is checked in test_fused_moe.py.
    path = moe_dirs["qwen2_moe"]
    prompts = random_prompts([1, 40], seed=24)
    llm = LLM(str(path), device="cpu", dtype="float32", attention_backend="triton", kvcache_block_size=8,
              max_num_batched_tokens=32, max_num_seqs=4)  # fmt: skip
    assert llm.engine.runner.model.model.layers[0].mlp.experts.kernel is fused_moe
    params = greedy(6)
    assert_matches_hf(hf_model_cache(path), prompts, llm.generate(prompts, params, use_tqdm=False), params.max_tokens)


def test_the_declarations_read_each_familys_experts():
    qwen3 = decoder_spec(
        Qwen3MoeConfig(architectures=["Qwen3MoeForCausalLM"], **SMALL, num_experts=16, num_experts_per_tok=4,
                       moe_intermediate_size=24, norm_topk_prob=True, decoder_sparse_step=2),
        max_model_len=512,
    )  # fmt: skip
    assert qwen3.moe == MoESpec(16, 4, 24, renormalize=True, float32_weights=False, layers=(1, 3))
    assert qwen3.qk_norm and not qwen3.qkv_bias
    qwen2 = decoder_spec(
        Qwen2MoeConfig(architectures=["Qwen2MoeForCausalLM"], **SMALL, num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=24, shared_expert_intermediate_size=40, mlp_only_layers=[0, 2]),
        max_model_len=512,
    )  # fmt: skip
    assert qwen2.moe == MoESpec(8, 2, 24, False, False, layers=(1, 3), shared_expert_intermediate_size=40)
    assert qwen2.qkv_bias and not qwen2.o_bias  # Qwen2-MoE's qkv_bias key (true by default)
    unbiased = Qwen2MoeConfig(architectures=["Qwen2MoeForCausalLM"], **SMALL, qkv_bias=False)
    assert not decoder_spec(unbiased, max_model_len=512).qkv_bias
    dense = Qwen3MoeConfig(architectures=["Qwen3MoeForCausalLM"], **SMALL, num_experts=0)
    assert decoder_spec(dense, max_model_len=512).moe is None  # as transformers: every layer's MLP dense
    mixtral = decoder_spec(
        MixtralConfig(architectures=["MixtralForCausalLM"], **SMALL, num_local_experts=8, num_experts_per_tok=2),
        max_model_len=512,
    )
    # Mixtral: always renormalised, float32 routing weights, every layer MoE, its experts of intermediate_size.
    assert mixtral.moe == MoESpec(8, 2, 96, renormalize=True, float32_weights=True, layers=(0, 1, 2, 3))


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (Qwen3MoeConfig(decoder_sparse_step=0), "decoder_sparse_step=0 is not supported"),
        (Qwen3MoeConfig(num_experts=4, num_experts_per_tok=5), "num_experts_per_tok=5 of num_experts=4"),
        (MixtralConfig(num_local_experts=0), "num_local_experts=0 is not supported"),
        (Qwen2MoeConfig(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
    ],
)
def test_a_moe_config_nanostream_does_not_run_is_refused_naming_the_value(config, message):
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    with pytest.raises(ModelLoadError, match=message):
        decoder_spec(config, max_model_len=512)


def weights_of(path, size=1, rank=0) -> dict[str, torch.Tensor]:
    spec = decoder_spec(AutoConfig.from_pretrained(path), max_model_len=512)
    with torch.device("cpu"):
        model = DecoderForCausalLM(spec, LayerKernels(TorchAttention()), TensorParallel(rank, size))
    load_weights(model, path)
    return model.state_dict()


@pytest.mark.parametrize("name", ["qwen2_moe", "mixtral"])
def test_the_per_expert_and_stacked_layouts_load_the_same_weights(name, tmp_path):
    per_expert = make_tiny_model(tmp_path / "per_expert", **TINY_PRESETS[name])
    stacked = make_tiny_model(tmp_path / "stacked", **TINY_PRESETS[name], expert_layout="stacked")
    names = [set(load_file(p / "model.safetensors")) for p in (per_expert, stacked)]
    block = "block_sparse_moe" if name == "mixtral" else "mlp"
    assert f"model.layers.0.{block}.experts.1.{'w1' if name == 'mixtral' else 'gate_proj'}.weight" in names[0]
    assert "model.layers.0.mlp.experts.gate_up_proj" in names[1]  # transformers' own stacked names
    for size, rank in [(1, 0), (2, 1)]:  # the whole model, and rank 1's half of every expert
        a, b = weights_of(per_expert, size, rank), weights_of(stacked, size, rank)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    moe = weights_of(per_expert, 2, 1)
    full = load_file(per_expert / "model.safetensors")
    inter = full[f"model.layers.0.{block}.experts.2.{'w2' if name == 'mixtral' else 'down_proj'}.weight"].shape[1]
    down = full[f"model.layers.0.{block}.experts.2.{'w2' if name == 'mixtral' else 'down_proj'}.weight"]
    assert torch.equal(moe["model.layers.0.mlp.experts.w2"][2], down[:, inter // 2 :])  # the second half's columns


def test_a_checkpoint_missing_one_experts_tensor_is_refused(moe_dirs, tmp_path):
    tensors = load_file(moe_dirs["qwen3_moe"] / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    for f in moe_dirs["qwen3_moe"].iterdir():
        if f.suffix != ".safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"lacks 1 weight.*model\.layers\.1\.mlp\.experts\.w13:up\.5"):
        LLM(str(tmp_path), device="cpu")


def test_dummy_weights_start_an_engine_from_only_a_config_and_a_tokenizer(tmp_path):
    path = make_tiny_model(tmp_path, **TINY_PRESETS["qwen2_moe"], weights=False)
    assert sorted(p.suffix for p in path.iterdir() if p.suffix in (".json", ".safetensors")) == [".json"] * 3
    with pytest.raises(ModelLoadError, match="no \\*.safetensors files.*load_format='dummy'"):
        LLM(str(path), device="cpu")
    llm = LLM(str(path), device="cpu", load_format="dummy", kvcache_block_size=16)
    out = llm.generate([[5, 6, 7], [9] * 40], greedy(8), use_tqdm=False)
    assert [len(o.token_ids) for o in out] == [8, 8]
    again = LLM(str(path), device="cpu", load_format="dummy", kvcache_block_size=16)
    assert again.generate([[5, 6, 7]], greedy(8), use_tqdm=False)[0].token_ids == out[0].token_ids  # seeded by name
    with pytest.raises(ValueError, match="load_format must be one of auto, dummy"):
        LLM(str(path), device="cpu", load_format="random")


def test_dummy_weights_keep_a_deep_bfloat16_forward_finite(tmp_path):
    # Qwen3-30B-A3B's depth, top-8 routing and norm layout at a narrower width: the residual stream stays
    # within a few units through 48 layers and the logits are finite and not flat.
    path = make_tiny_model(
        tmp_path, architecture="Qwen3MoeForCausalLM", weights=False, num_hidden_layers=48, hidden_size=256,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_experts=32, num_experts_per_tok=8,
        moe_intermediate_size=96, vocab_size=2048,
    )  # fmt: skip
    spec = decoder_spec(AutoConfig.from_pretrained(path), max_model_len=512)
    kernels = LayerKernels(TorchAttention())
    model = load_model(spec, kernels, path, dtype=torch.bfloat16, device=CPU, load_format="dummy")
    kv = allocate_kv_pool(spec, 4, 16, torch.bfloat16, CPU, spec.num_kv_heads)
    seq = Sequence("s", list(range(3, 67)), SamplingParams(), max_tokens=1, sampling_seed=0, stop_token_ids=frozenset())
    seq.block_table = list(range(4))
    inputs = pack_step([WarmupChunk(seq, 0, 64)], 16, CPU)
    ctx, m = ForwardContext(inputs.meta, kv), model.model
    peaks = []
    with torch.inference_mode():
        x, residual = m.head(inputs.input_ids)
        for i in range(spec.num_layers):
            x, residual = m.between(i, m.attend(i, inputs.positions, x, ctx), residual)
            peaks.append((x if residual is None else residual).abs().max().item())
        logits = model.compute_logits(x)
    assert torch.isfinite(logits).all() and max(peaks) < 50, peaks
    assert logits.float().std(-1).min() > 0.05  # not flattened to a constant


def test_the_moe_block_runs_the_kernel_its_layer_kernels_name(moe_dirs):
    calls = []

    def counting(x, w13, w2, weights, ids, **options):
        calls.append((tuple(ids.shape), options))
        return moe_experts(x, w13, w2, weights, ids, **options)

    spec = decoder_spec(AutoConfig.from_pretrained(moe_dirs["qwen2_moe"]), max_model_len=512)
    kernels = LayerKernels(TorchAttention(), moe=counting)
    model = load_model(spec, kernels, moe_dirs["qwen2_moe"], dtype=torch.float32, device=CPU)
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["SparseMoE", "MLP", "SparseMoE"]
    with torch.inference_mode():
        model.model.layers[0].mlp(torch.randn(5, spec.hidden_size))
    assert calls == [((5, 2), dict(w13_bias=None, w2_bias=None, activation="silu"))]  # Qwen's experts: no bias
    assert json.loads((moe_dirs["qwen2_moe"] / "config.json").read_text())["mlp_only_layers"] == [1]


@pytest.mark.slow
def test_nanostream_serve_streams_each_moe_model_as_transformers_generates(moe_dirs, hf_model_cache):
    # One engine process per family (`nanostream serve`, started together), every prompt streamed at once
    # through one AsyncClient each; chunks small enough that the 300-token prompt is prefilled in pieces.
    prompts = random_prompts([1, 300, 12], seed=23)
    params = greedy(12)
    options = dict(device="cpu", dtype="float32", kvcache_block_size=16, max_num_batched_tokens=128, max_num_seqs=8)

    async def stream_all(address: str) -> list[list[int]]:
        async with AsyncClient(address) as client:
            outputs: list[list[int]] = [[] for _ in prompts]

            async def one(i: int) -> None:
                async for chunk in client.stream(prompts[i], params):
                    outputs[i] += chunk.token_ids

            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
        return outputs

    for name in MOE:
        with engine_processes(str(moe_dirs[name]), {name: options}) as engines:
            streamed = run_in_thread(stream_all, engines[name].address)
        hf = hf_model_cache(moe_dirs[name])
        assert streamed == [hf_greedy(hf, p, params.max_tokens) for p in prompts], name


def test_n_samples_and_structured_output_run_on_a_moe_model(moe_dirs):
    # What the engine does around the model is the same for every family: n seeded samples are the n = 1
    # requests of seeds seed + i (sharing the prompt's blocks), and a grammar holds the output to its choices.
    from nanostream import StructuredOutputsParams

    llm = LLM(str(moe_dirs["qwen2_moe"]), device="cpu", kvcache_block_size=16)
    prompt = random_prompts([40], seed=30)[0]
    sampled = SamplingParams(temperature=0.9, seed=5, max_tokens=8, ignore_eos=True)
    together = llm.generate([prompt], SamplingParams(temperature=0.9, seed=5, n=3, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)[0].outputs  # fmt: skip
    alone = [llm.generate([prompt], dataclasses.replace(sampled, seed=5 + i), use_tqdm=False)[0]
             for i in range(3)]  # fmt: skip
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    words = ["alpha", "beta", "gamma"]
    params = SamplingParams(
        temperature=1.0, seed=1, max_tokens=16, structured_outputs=StructuredOutputsParams(choice=words)
    )
    outs = llm.generate([prompt, prompt[:7]], params, use_tqdm=False)
    assert all(o.text in words for o in outs), [o.text for o in outs]
