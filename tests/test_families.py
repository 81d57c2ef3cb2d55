"""The dense families beyond Llama's and the sliding windows, token-identical to transformers' greedy output.

Each tiny checkpoint comes from transformers' own config class with random weights, norms included
(nanostream.testing.TINY_PRESETS): Gemma 3 (sliding and full layers, a window of 24, (1 + w) norms, GeGLU,
its query scale and logit cap), Phi-3 (fused qkv and gate/up checkpoint tensors, a window of 40 on every
layer), OLMo 2 (norms after each block, QK-norms over the whole projections), Granite (its four
multipliers), SmolLM3 (a layer without rotary embedding), GLM-4 (partial, interleaved rotary; four norms),
gpt-oss (attention sinks, sliding and full layers, YaRN, its biased experts with the clamped SwiGLU), and
Mistral and Qwen2 with their windows shorter than the prompts. The prompts run from 1 to 700 tokens,
past every window; prefix-cache hits and prompt chunks start and end on both sides of a window's edge.
"""

import pytest
import torch
from test_hf_parity import assert_matches_hf, greedy, random_prompts

from nanostream import LLM, SamplingParams
from nanostream.testing import TINY_PRESETS, make_tiny_model

WINDOWED = {
    "mistral_window": dict(architecture="MistralForCausalLM", seed=16, sliding_window=32),
    "qwen2_window": dict(  # the sliding layers from max_window_layers up, as Qwen2 counts them
        architecture="Qwen2ForCausalLM",
        seed=17,
        use_sliding_window=True,
        sliding_window=20,
        max_window_layers=1,
        num_hidden_layers=3,
    ),
}
FAMILIES = ["gemma3", "phi3", "olmo2", "granite", "smollm3", "glm4", "gpt_oss", *WINDOWED]
GREEDY = greedy(12)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            kwargs = TINY_PRESETS.get(name) or WINDOWED[name]
            made[name] = make_tiny_model(tmp_path_factory.mktemp(name), **kwargs)
        return made[name]

    return get


@pytest.fixture(params=FAMILIES)
def family_dir(request, family_dirs):
    return family_dirs(request.param)


def test_mixed_batch_of_1_to_700_tokens_matches_hf(family_dir, hf_model_cache):
    prompts = random_prompts([1, 9, 45, 130, 700], seed=20)
    llm = LLM(str(family_dir), device="cpu", kvcache_block_size=16)
    assert_matches_hf(hf_model_cache(family_dir), prompts, llm.generate(prompts, GREEDY, use_tqdm=False), 12)


def assert_prefix_hits_and_chunks_match_hf(path, hf, seed, params=GREEDY):
    """Block size 8, chunks of 24 tokens: a cached prefix of 56 tokens, then three prompts that hit it; the prefix's
    end and the chunk edges fall inside, at and past windows of 20 to 40 tokens, so a query's window starts in a
    cached block or in an earlier chunk."""
    shared = random_prompts([56], seed=seed)[0]
    prompts = [shared + tail for tail in random_prompts([3, 30, 77], seed=seed + 1)]
    llm = LLM(str(path), device="cpu", kvcache_block_size=8, max_num_batched_tokens=24, max_num_seqs=4)
    first = llm.generate(prompts[:1], params, use_tqdm=False)
    rest = llm.generate(prompts[1:], params, use_tqdm=False)
    assert all(o.num_cached_tokens == 56 for o in rest)
    assert_matches_hf(hf, prompts, first + rest, params.max_tokens)


def test_prefix_hits_and_chunks_across_the_window_edge_match_hf(family_dir, hf_model_cache):
    assert_prefix_hits_and_chunks_match_hf(family_dir, hf_model_cache(family_dir), seed=21)


# Gemma 3's 3 layers are 3 KV groups (full, sliding, sliding) of a layer a block: 48 blocks, the bytes of 16 of phi3's
@pytest.mark.parametrize(("name", "blocks"), [("gemma3", 48), ("phi3", 16)])
def test_preemption_with_windows_matches_hf(name, blocks, family_dirs, hf_model_cache):
    path = family_dirs(name)
    prompts = random_prompts([60, 27, 43, 50], seed=23)
    params = greedy(30)
    llm = LLM(str(path), device="cpu", kvcache_block_size=8, num_kvcache_blocks=blocks, enable_prefix_caching=False)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == blocks
    assert_matches_hf(hf_model_cache(path), prompts, outputs, params.max_tokens)


def test_glm4_rotary_needs_its_permuted_heads(family_dirs):
    # The partial, interleaved rotary runs through q/k rows permuted once at load: without it, other tokens.
    path = family_dirs("glm4")
    llm = LLM(str(path), device="cpu", kvcache_block_size=16)
    prompt = random_prompts([40], seed=24)
    ours = llm.generate(prompt, GREEDY, use_tqdm=False)[0].token_ids
    llm.engine.runner.model.after_loading()  # a second permutation: the order is wrong now
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].token_ids != ours


@pytest.mark.parametrize("name", ["gemma3", "olmo2", "gpt_oss", "smollm3"])
def test_triton_kernels_run_the_families_like_transformers(name, family_dirs, hf_model_cache):
    # Under Triton's interpreter without a GPU: the fused prologue's (1 + w) QK-norm (Gemma 3) and the whole-
    # projection norm before it (OLMo 2), the norm kernels' float32 weight, GeGLU, the windowed kernels, the
    # sinks and the fused MoE kernel's biases and clamped SwiGLU (gpt-oss), the prologue's identity table for
    # a layer without rotary embedding (SmolLM3).
    path = family_dirs(name)
    shared = random_prompts([30], seed=25)[0]
    prompts = [shared + tail for tail in random_prompts([1, 12], seed=26)]
    llm = LLM(
        str(path),
        device="cuda" if torch.cuda.is_available() else "cpu",
        dtype="float32",
        attention_backend="triton",
        kvcache_block_size=8,
        max_num_batched_tokens=16,
        max_num_seqs=2,
    )
    params = greedy(8)
    outputs = llm.generate(prompts[:1], params, use_tqdm=False) + llm.generate(prompts[1:], params, use_tqdm=False)
    assert outputs[1].num_cached_tokens >= 24
    assert_matches_hf(hf_model_cache(path), prompts, outputs, params.max_tokens)


def test_sampling_options_run_on_a_windowed_model(family_dirs):
    llm = LLM(str(family_dirs("gemma3")), device="cpu", kvcache_block_size=16)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=40, seed=3, ignore_eos=True)
    a, b = (llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].token_ids for _ in range(2))
    assert a == b and len(a) == 40  # seeded: the same tokens again, past the window


@pytest.mark.slow
def test_gpt_oss_streams_through_serve_and_the_openai_client_as_transformers_generates(
    family_dirs, hf_model_cache, tmp_path, monkeypatch
):
    # The whole product on one family: `nanostream serve` with its OpenAI frontend, the official client
    # streaming a completion well past the sliding window, the text transformers' greedy tokens decode to.
    from helpers import served_openai
    from test_hf_parity import hf_greedy
    from transformers import AutoTokenizer

    path = family_dirs("gpt_oss")
    prompt = random_prompts([40], seed=27)[0]
    with served_openai(path, tmp_path, monkeypatch) as (api, _):
        stream = api.completions.create(
            model=path.name, prompt=prompt, max_tokens=40, temperature=0, stream=True, extra_body={"min_tokens": 40}
        )
        chunks = [c.choices[0].text for c in stream if c.choices]
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(chunks) > 10  # streamed, not one piece
    expected = tokenizer.decode(hf_greedy(hf_model_cache(path), prompt, 40), skip_special_tokens=True)
    assert "".join(chunks) == expected


def test_a_multimodal_gemma3_checkpoint_serves_its_language_model(tmp_path):
    # Gemma 3 from 4B up is published as Gemma3ForConditionalGeneration: its language model runs, text in and
    # text out, as transformers' whole model generates from text alone (its images: tests/test_gemma3_images.py); a
    # SigLIP pooling head (vision_use_head, this config's default) is in the checkpoint and not used
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    from nanostream.testing import build_tokenizer

    tokenizer = build_tokenizer()
    text = {**TINY_PRESETS["gemma3"], "vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128}
    text.pop("architecture"), text.pop("seed")
    text.update(num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048)
    text.update(query_pre_attn_scalar=24, sliding_window=24, final_logit_softcapping=8.0)
    text.update(layer_types=["sliding_attention", "full_attention", "sliding_attention"], num_hidden_layers=3)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)  # fmt: skip
    config = Gemma3Config(text_config=text, vision_config=vision.to_dict(), mm_tokens_per_image=4,
                          image_token_index=500, boi_token_index=501, eoi_token_index=502)  # fmt: skip
    torch.manual_seed(0)
    hf = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            param.copy_(
                1.0 + 0.1 * torch.randn_like(param) if name.endswith("norm.weight") else 0.15 * torch.randn_like(param)
            )
    hf.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    prompts = random_prompts([5, 60], seed=28)
    outputs = LLM(str(tmp_path), device="cpu", kvcache_block_size=8).generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
        assert out.token_ids == ref[0, len(prompt) :].tolist()
