"""Multi-head latent attention on a CUDA GPU (skipped without one): the tiny MLA models end to end with the Triton
backend (its latent store and paged MLA decode kernel, CUDA graphs) float32 token-identical to transformers, and in
bfloat16 against the eager torch backend; an FP8 latent cache; the Moonlight-16B-A3B and DeepSeek-V2-Lite presets on
dummy weights, their pool counting 576 values a token a layer.
"""

import pytest
import torch
from test_gpu import bfloat16_backend_agrees_with_torch_backend, greedy_with_logits
from test_hf_parity import hf_greedy, random_prompts

from nanostream import LLM, SamplingParams
from nanostream.kernels.mla_decode import paged_mla_decode
from nanostream.testing import TINY_PRESETS, make_tiny_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def mla_dirs(tmp_path_factory):
    names = ("deepseek_v3", "deepseek_v2", "glm4_moe_lite")
    return {name: make_tiny_model(tmp_path_factory.mktemp(name), **TINY_PRESETS[name]) for name in names}


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2", "glm4_moe_lite"])
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_float32_triton_backend_matches_hf_with_and_without_cuda_graphs(name, enforce_eager, mla_dirs, hf_model_cache):
    path = mla_dirs[name]
    prompts = random_prompts([1, 9, 200, 700], seed=60)
    llm = LLM(str(path), device="cuda", dtype="float32", attention_backend="triton", enforce_eager=enforce_eager,
              max_num_seqs=8, max_model_len=1024, max_num_batched_tokens=256, gpu_memory_utilization=0.3)  # fmt: skip
    assert llm.engine.runner.model.model.layers[0].self_attn.kernels.decode is paged_mla_decode
    assert (llm.engine.runner.graphs is not None) != enforce_eager
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=16)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(hf_model_cache(path), prompt, 16), f"prompt of {len(prompt)} diverged"


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2"])
def test_bfloat16_triton_backend_agrees_with_the_torch_backend(name, mla_dirs):
    # These are DeepSeek-routed MoE models: as in test_gpu_moe.py, where a token's K-th and (K+1)-th experts are a bf16
    # rounding apart, the absorbed decode (q times W_UK against the latent) and the torch backend's expanded K round
    # it differently and route it to another expert: a step falls far below cosine 0.999 (on an H100, one of 32
    # at 0.92 with the same tokens so far). The float32 tests above are token-exact with transformers.
    bfloat16_backend_agrees_with_torch_backend(mla_dirs[name], "triton", at_rounding=0.8)


def test_an_fp8_latent_cache_runs_in_the_graphs_near_the_bfloat16_one(mla_dirs):
    common = dict(device="cuda", dtype="bfloat16", attention_backend="triton", max_num_seqs=8, max_model_len=1024,
                  gpu_memory_utilization=0.3)  # fmt: skip
    prompt = random_prompts([300], seed=61)[0]
    _, ref_logits = greedy_with_logits(LLM(str(mla_dirs["deepseek_v3"]), **common), prompt, 8)
    llm = LLM(str(mla_dirs["deepseek_v3"]), kv_cache_dtype="fp8", **common)
    assert llm.engine.runner.kv_caches[0].latent.dtype == torch.float8_e4m3fn
    ids, logits = greedy_with_logits(llm, prompt, 8)
    cos = torch.nn.functional.cosine_similarity(logits[:1], ref_logits[:1], dim=-1)
    assert cos.item() > 0.99 and len(ids) == 8


@pytest.mark.parametrize("preset", ["moonlight-16b-a3b", "deepseek-v2-lite"])
def test_a_16b_mla_preset_runs_on_dummy_weights_with_a_latent_pool(preset, tmp_path, load_app):
    presets = load_app("presets")
    path = make_tiny_model(tmp_path, **presets.PRESETS[preset])
    llm = LLM(str(path), dtype="bfloat16", max_model_len=4096, max_num_seqs=16, gpu_memory_utilization=0.85,
              **presets.engine_defaults(preset))  # fmt: skip
    runner = llm.engine.runner
    assert runner.kv_block_bytes == 27 * runner.block_size * 576 * 2  # kv_lora_rank + qk_rope_head_dim, bf16
    print(preset, runner.describe_cache(), f"{runner.num_kv_blocks * runner.block_size:,} tokens of context")
    ids, logits = greedy_with_logits(llm, list(range(3, 1003)), 8)
    assert len(ids) == 8 and torch.isfinite(logits).all() and logits.std(-1).min().item() > 0.05
