"""nanostream's greedy output is token-identical to Hugging Face transformers' on the same weights.

Every architecture the shared decoder runs: Qwen3 (QK-norm, tied), Qwen2 (q/k/v biases), Llama (untied),
Llama with Llama 3 rope scaling (and attention and MLP biases, untied), Mistral (tied), and the mixture-of-experts
Qwen3-MoE, Qwen2-MoE (a shared expert, a dense layer) and Mixtral (more on them in test_moe.py)."""

import random

import pytest
import torch

from nanostream import LLM, SamplingParams
from nanostream.engine.scheduler import ScheduledChunk
from nanostream.engine.sequence import Sequence
from nanostream.layers.attention import ForwardContext
from nanostream.testing import TINY_PRESETS, make_tiny_model


def greedy(n):
    """n greedy tokens, EOS banned throughout: what transformers' generate(min_new_tokens=n) does (ignore_eos
    would let EOS be picked, where transformers picks the next best)."""
    return SamplingParams(temperature=0, max_tokens=n, min_tokens=n)


GREEDY = greedy(24)
ARCHS = ["qwen3", "qwen2", "llama", "llama3", "mistral", "qwen3_moe", "qwen2_moe", "mixtral"]


@pytest.fixture(scope="session")
def presets(tmp_path_factory):
    """The tiny Llama (untied), Llama 3 (rope scaling, attention and MLP biases, untied), Mistral (tied) and
    mixture-of-experts models."""
    return {
        name: make_tiny_model(tmp_path_factory.mktemp(name), **TINY_PRESETS[name])
        for name in ARCHS
        if name in TINY_PRESETS
    }


@pytest.fixture(params=ARCHS)
def any_model_dir(request, presets):
    return presets.get(request.param) or request.getfixturevalue(f"{request.param}_dir")


def hf_greedy(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
        )
    return out[0, len(prompt) :].tolist()


def random_prompts(lengths, seed, vocab=500):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def assert_matches_hf(hf, prompts, outputs, n):
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.prompt_token_ids == prompt
        assert out.token_ids == hf_greedy(hf, prompt, n), f"prompt of {len(prompt)} tokens diverged"
        assert out.finish_reason == "length"


def test_mixed_batch_matches_hf(any_model_dir, hf_model_cache):
    prompts = random_prompts([1, 7, 16, 33, 100, 257], seed=0)
    llm = LLM(str(any_model_dir), device="cpu", kvcache_block_size=16)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_hf(hf_model_cache(any_model_dir), prompts, outputs, GREEDY.max_tokens)


def test_prefix_cache_hits_match_hf(model_dir, hf_model_cache):
    prefix = random_prompts([80], seed=1)[0]
    prompts = [prefix + tail for tail in random_prompts([5, 17, 1], seed=2)]
    llm = LLM(str(model_dir), device="cpu", kvcache_block_size=16)
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens == 80 for o in rest)  # the five full blocks of the shared prefix
    again = llm.generate(prompts[:1], GREEDY, use_tqdm=False)  # prompt + its own output blocks cached
    assert again[0].num_cached_tokens == 80
    assert_matches_hf(hf_model_cache(model_dir), prompts, first + rest, GREEDY.max_tokens)
    assert again[0].token_ids == first[0].token_ids


def test_chunked_prefill_matches_hf(any_model_dir, hf_model_cache):
    prompts = random_prompts([150, 9, 61], seed=3)
    llm = LLM(str(any_model_dir), device="cpu", kvcache_block_size=8, max_num_batched_tokens=32, max_num_seqs=4)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_hf(hf_model_cache(any_model_dir), prompts, outputs, GREEDY.max_tokens)


def test_preemption_matches_hf(any_model_dir, hf_model_cache):
    prompts = random_prompts([20, 27, 13, 40, 22, 31], seed=4)
    params = greedy(30)
    llm = LLM(
        str(any_model_dir), device="cpu", kvcache_block_size=8, num_kvcache_blocks=16, enable_prefix_caching=False
    )
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == 16
    assert_matches_hf(hf_model_cache(any_model_dir), prompts, outputs, params.max_tokens)


def test_preemption_with_prefix_cache_matches_hf(qwen3_dir, hf_model_cache):
    shared = random_prompts([24], seed=5)[0]
    prompts = [shared + p for p in random_prompts([3, 9, 14, 6], seed=6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = LLM(
        str(qwen3_dir),
        device="cpu",
        kvcache_block_size=8,
        num_kvcache_blocks=18,
        max_num_batched_tokens=48,
        max_num_seqs=4,
    )
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_matches_hf(hf_model_cache(qwen3_dir), prompts, outputs, params.max_tokens)


def test_prefill_logits_match_hf(any_model_dir, hf_model_cache):
    prompt = random_prompts([300], seed=7)[0]
    llm = LLM(str(any_model_dir), device="cpu", kvcache_block_size=16)
    runner = llm.engine.runner
    seq = Sequence("p", prompt, GREEDY, max_tokens=1, sampling_seed=0, stop_token_ids=frozenset())
    seq.block_table = list(range(19))
    input_ids, positions, meta, *_ = runner.prepare([ScheduledChunk(seq, len(prompt))])
    with torch.inference_mode():
        hidden = runner.model(input_ids, positions, ForwardContext(meta, runner.kv_caches))
        ours = runner.model.compute_logits(hidden)
        ref = hf_model_cache(any_model_dir)(torch.tensor([prompt])).logits[0].float()
    rel = (ours - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert rel.max().item() < 1e-4


@pytest.mark.parametrize("block_size", [1, 5, 32])
def test_block_sizes_match_hf(qwen3_dir, hf_model_cache, block_size):
    prompts = random_prompts([3, 40, 71], seed=8)
    llm = LLM(str(qwen3_dir), device="cpu", kvcache_block_size=block_size)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_hf(hf_model_cache(qwen3_dir), prompts, outputs, GREEDY.max_tokens)


def test_sharded_untied_biased_qwen3_matches_hf(tmp_path, hf_model_cache):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from nanostream.testing import build_tokenizer

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        attention_bias=True,
        tie_word_embeddings=False,
        max_position_embeddings=512,
        architectures=["Qwen3ForCausalLM"],
    )
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.15)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    build_tokenizer().save_pretrained(tmp_path)
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    prompts = random_prompts([12, 50], seed=9)
    outputs = LLM(str(tmp_path), device="cpu", kvcache_block_size=16).generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_hf(hf_model_cache(tmp_path), prompts, outputs, GREEDY.max_tokens)


@pytest.mark.parametrize("any_model_dir", ["qwen3", "qwen2", "llama3"], indirect=True)
def test_triton_backend_matches_hf_with_prefix_hits_chunks_and_preemption(any_model_dir, hf_model_cache):
    # Without a GPU the kernels run under Triton's interpreter: slow, so one small mixed workload, on the
    # three models that take the kernels' different paths: Qwen3 through the fused prologue's QK-norm,
    # Qwen2 through it with biased projections and no norm, the scaled Llama 3 with its rotary tables and
    # biases. The kernels see no architecture: Llama and Mistral take those paths too (and match HF on
    # the torch backend above).
    shared = random_prompts([24], seed=10)[0]
    prompts = [shared + tail for tail in random_prompts([1, 9, 40, 5], seed=11)]
    params = greedy(16)
    llm = LLM(
        str(any_model_dir),
        device="cuda" if torch.cuda.is_available() else "cpu",
        dtype="float32",
        attention_backend="triton",
        kvcache_block_size=8,
        num_kvcache_blocks=12,
        max_num_batched_tokens=32,
        max_num_seqs=4,
    )
    assert llm.engine.runner.backend.name == "triton"
    outputs = llm.generate(prompts[:1], params, use_tqdm=False) + llm.generate(prompts[1:], params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert any(o.num_cached_tokens >= 24 for o in outputs[1:])
    assert_matches_hf(hf_model_cache(any_model_dir), prompts, outputs, params.max_tokens)


def test_repetition_penalty_matches_hf_while_other_requests_decode(qwen3_dir, hf_model_cache):
    # A penalty reads the request's own output tokens, so the engine resolves the step in flight
    # before scheduling; a stale (pending) token in the counts would change the greedy choice.
    prompts = random_prompts([12, 30, 7], seed=12)
    penalized = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.5)
    llm = LLM(str(qwen3_dir), device="cpu", kvcache_block_size=16)
    outputs = llm.generate(prompts, [penalized, GREEDY, GREEDY], use_tqdm=False)
    hf = hf_model_cache(qwen3_dir)
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompts[0]]), max_new_tokens=24, min_new_tokens=24, do_sample=False, repetition_penalty=1.5
        )
    assert outputs[0].token_ids == ref[0, len(prompts[0]) :].tolist()
    assert outputs[0].token_ids != hf_greedy(hf, prompts[0], 24)  # the penalty changed the output
    assert_matches_hf(hf, prompts[1:], outputs[1:], GREEDY.max_tokens)


def test_llama3_rope_scaling_tables_match_hf(presets, hf_model_cache):
    # The scaled frequencies must be transformers' to the bit: a table an ulp off flips greedy choices later.
    from nanostream.layers.rotary import RopeSpec, RotaryEmbedding

    llm = LLM(str(presets["llama3"]), device="cpu", kvcache_block_size=16)
    rotary = llm.engine.runner.model.model.rotary
    hf = hf_model_cache(presets["llama3"])
    positions = torch.arange(2048)[None]
    hf_cos, hf_sin = hf.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
    half = rotary.cos.shape[1]
    assert torch.equal(rotary.cos, hf_cos[0, :, :half]) and torch.equal(rotary.sin, hf_sin[0, :, :half])
    unscaled = RotaryEmbedding(2 * half, 2048, RopeSpec(hf.config.rope_parameters["rope_theta"]))
    same = (unscaled.cos == rotary.cos).all(0)  # per frequency, over every position
    assert same.tolist() == [True] * 3 + [False] * 5  # kept, interpolated, slowed down (LLAMA3_ROPE_SCALING)
