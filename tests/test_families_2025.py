"""The families of 2025-2026 (issue 57), token-identical to transformers' greedy output on tiny random checkpoints
of transformers' own config classes (nanostream.testing's FAMILY_PRESETS: every norm, router and correction bias
drawn): OLMo 3 (sliding and full layers, norms after each block), EXAONE 4 (full layers without rotary embedding),
Apertus (the ungated xIELU MLP), Seed-OSS (biases on q/k/v, o and the MLP), HunYuan dense (QK-norms after the rotary
embedding, NTK alpha), ERNIE 4.5 dense (interleaved rotary, biases) and MoE (softmax scores, a correction bias,
shared experts after a dense layer), Ministral 3 (the queries' temperature past its original context), Llama 4
(chunked local attention, a NoPE layer with the queries' temperature, weightless QK-norms after the interleaved
rotary embedding, a top-1 sigmoid router scaling the expert's input beside a shared expert) and the language models
of Mistral3ForConditionalGeneration and Llama4ForConditionalGeneration checkpoints. Prompts of 1 to 700 tokens,
prefix hits and chunks on both sides of the windows' edges, preemption, the fused prologue under Triton's
interpreter, refusals by name.
"""

import pytest
import torch
import transformers
from test_families import assert_prefix_hits_and_chunks_match_hf
from test_hf_parity import assert_matches_hf, greedy, random_prompts

from nanostream import LLM
from nanostream.errors import ModelLoadError
from nanostream.testing import TINY_PRESETS, make_tiny_model
from nanostream.testing.tiny_families import FAMILY_PRESETS

FAMILIES = list(FAMILY_PRESETS)
WINDOWED = ["olmo3", "exaone4", "ministral3", "ernie4_5_moe", "llama4"]
GREEDY = greedy(10)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    made, models = {}, {}

    def get(name):
        if name not in made:
            made[name] = make_tiny_model(tmp_path_factory.mktemp(name), **TINY_PRESETS[name])
            cls = getattr(transformers, TINY_PRESETS[name]["architecture"])  # the wrapper's own class too
            models[name] = cls.from_pretrained(made[name], dtype=torch.float32).eval()
        return made[name], models[name]

    return get


@pytest.mark.parametrize("name", FAMILIES)
def test_mixed_batch_of_1_to_700_tokens_matches_hf(name, family):
    path, hf = family(name)
    prompts = random_prompts([1, 9, 45, 130, 700], seed=40)
    llm = LLM(str(path), device="cpu", kvcache_block_size=16)
    assert_matches_hf(hf, prompts, llm.generate(prompts, GREEDY, use_tqdm=False), GREEDY.max_tokens)


@pytest.mark.parametrize("name", WINDOWED)
def test_prefix_hits_and_chunks_across_the_window_edge_match_hf(name, family):
    # the prefix's end and the chunk edges also on both sides of the temperature's first step (64 positions)
    assert_prefix_hits_and_chunks_match_hf(*family(name), seed=41, params=GREEDY)


@pytest.mark.parametrize("name", ["exaone4", "ernie4_5_moe", "llama4"])
def test_preemption_matches_hf(name, family):
    path, hf = family(name)
    prompts = random_prompts([60, 27, 43, 50], seed=43)
    params = greedy(30)
    llm = LLM(str(path), device="cpu", kvcache_block_size=8, num_kvcache_blocks=24, enable_prefix_caching=False)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_matches_hf(hf, prompts, outputs, params.max_tokens)


@pytest.mark.parametrize("name", ["hunyuan", "ministral3", "exaone4", "llama4"])
def test_triton_kernels_run_the_families_like_transformers(name, family):
    # Under Triton's interpreter without a GPU: QK-norms after the rotary embedding bypass the fused prologue (the
    # modules norm and rotate, the backend stores), the temperature scales the prologue's queries, a NoPE layer,
    # Llama 4's chunks in both kernels.
    path, hf = family(name)
    shared = random_prompts([70], seed=44)[0]
    prompts = [shared + tail for tail in random_prompts([1, 12], seed=45)]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(str(path), device=device, dtype="float32", attention_backend="triton", kvcache_block_size=8,
              max_num_batched_tokens=32, max_num_seqs=2)  # fmt: skip
    params = greedy(4)
    outputs = llm.generate(prompts[:1], params, use_tqdm=False) + llm.generate(prompts[1:], params, use_tqdm=False)
    assert outputs[1].num_cached_tokens >= 64
    assert_matches_hf(hf, prompts, outputs, params.max_tokens)


@pytest.mark.parametrize(
    ("name", "overrides", "named"),
    [
        ("hunyuan", dict(rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=1e4)), "alpha"),
        ("apertus", dict(hidden_act="relu2"), "hidden_act"),
        ("ernie4_5_moe", dict(moe_norm_min=0.5), "moe_norm_min"),
        ("llama4", dict(num_experts_per_tok=2), "num_experts_per_tok"),
        ("llama4", dict(attention_chunk_size=0), "attention_chunk_size"),
    ],
)
def test_what_a_family_does_not_run_is_refused_by_name(name, overrides, named, tmp_path):
    preset = {**TINY_PRESETS[name], **overrides}
    path = make_tiny_model(tmp_path, weights=False, **preset)
    with pytest.raises(ModelLoadError, match=named):
        LLM(str(path), device="cpu", load_format="dummy")
