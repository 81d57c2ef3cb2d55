"""The engine on a CUDA GPU (skipped without one): float32 token-identical to transformers."""

import random

import pytest
import torch

from nanostream import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def test_cuda_float32_matches_hf_with_prefix_hits_chunks_and_preemption(qwen3_dir, hf_model_cache):
    rng = random.Random(0)
    shared = [rng.randrange(3, 500) for _ in range(40)]
    prompts = [shared + [rng.randrange(3, 500) for _ in range(n)] for n in (1, 9, 70, 23, 150, 4)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    llm = LLM(
        str(qwen3_dir),
        device="cuda",
        dtype="float32",
        kvcache_block_size=16,
        num_kvcache_blocks=30,
        max_num_batched_tokens=64,
        max_num_seqs=8,
    )
    first = llm.generate(prompts[:1], params, use_tqdm=False)
    outputs = first + llm.generate(prompts[1:], params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert any(o.num_cached_tokens >= 32 for o in outputs[1:])
    hf = hf_model_cache(qwen3_dir)
    for prompt, out in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
        assert out.token_ids == ref[0, len(prompt) :].tolist()


def test_cuda_kv_pool_sized_from_gpu_memory_utilization(qwen3_dir):
    llm = LLM(str(qwen3_dir), device="cuda", gpu_memory_utilization=0.05, max_model_len=1024, max_num_seqs=8)
    _free, total = torch.cuda.mem_get_info()
    pool_bytes = llm.engine.block_manager.num_blocks * llm.engine.runner.kv_block_bytes
    assert 0 < pool_bytes <= 0.05 * total
    out = llm.generate(["The river"] * 4, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert all(len(o.token_ids) == 8 for o in out)
