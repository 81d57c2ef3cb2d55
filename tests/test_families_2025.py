"""The families of 2025-2026 (issue 57), token-identical to transformers' greedy output on tiny random checkpoints
of transformers' own config classes (nanostream.testing's FAMILY_PRESETS: every norm, router and correction bias
drawn): OLMo 3 (sliding and full layers, norms after each block), EXAONE 4 (full layers without rotary embedding),
Apertus (the ungated xIELU MLP), Seed-OSS (biases on q/k/v, o and the MLP), HunYuan dense (QK-norms after the rotary
embedding, NTK alpha), ERNIE 4.5 dense (interleaved rotary, biases) and MoE (softmax scores, a correction bias,
shared experts after a dense layer), Ministral 3 (the queries' temperature past its original context), Llama 4
(chunked local attention, a NoPE layer with the queries' temperature, weightless QK-norms after the interleaved
rotary embedding, a top-1 sigmoid router scaling the expert's input beside a shared expert), Gemma 4 dense and with its
MoE block (tests/test_gemma4_moe.py) and the language models of Mistral3ForConditionalGeneration,
Llama4ForConditionalGeneration and Gemma4ForConditionalGeneration checkpoints. Prompts of 1 to 700 tokens,
prefix hits and chunks on both sides of the windows' edges, preemption, the fused prologue under Triton's
interpreter, refusals by name.
"""

import pytest
import torch
import transformers
from helpers import outputs_at_one_and_two_ranks
from test_families import assert_prefix_hits_and_chunks_match_hf
from test_hf_parity import assert_matches_hf, greedy, random_prompts

from nanostream import LLM
from nanostream.errors import ModelLoadError
from nanostream.layers.cache_spec import SharedKV
from nanostream.models.config_reader import decoder_spec
from nanostream.testing import TINY_PRESETS, make_tiny_model
from nanostream.testing.tiny_families import FAMILY_PRESETS

FAMILIES = list(FAMILY_PRESETS)
WINDOWED = ["olmo3", "exaone4", "ministral3", "ernie4_5_moe", "llama4", "gemma4", "gemma4_moe"]
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


# EXAONE 4 (3 layers) and Llama 4 (4) have KV groups of a layer a block whose sliding or chunked layers give blocks
# back: 28 or 40 such blocks, fewer bytes than 24 blocks of every layer, with steps of 16 (a request holds less)
@pytest.mark.parametrize(
    ("name", "pool"),
    [
        ("exaone4", (28, 16)),
        ("ernie4_5_moe", (24, None)),
        ("llama4", (40, 16)),
        ("gemma4", (24, None)),
        ("gemma4_moe", (24, None)),
    ],
)
def test_preemption_matches_hf(name, pool, family):
    path, hf = family(name)
    prompts = random_prompts([60, 27, 43, 50], seed=43)
    params = greedy(30)
    blocks, step = pool
    options = dict(num_kvcache_blocks=blocks, enable_prefix_caching=False)
    if step is not None:
        options.update(max_num_batched_tokens=step, max_num_seqs=4)
    llm = LLM(str(path), device="cpu", kvcache_block_size=8, **options)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_matches_hf(hf, prompts, outputs, params.max_tokens)


@pytest.mark.parametrize("name", ["hunyuan", "ministral3", "exaone4", "llama4", "gemma4", "gemma4_moe"])
def test_triton_kernels_run_the_families_like_transformers(name, family):
    # Under Triton's interpreter without a GPU: QK-norms after the rotary embedding bypass the fused prologue (the
    # modules norm and rotate, the backend stores), the temperature scales the prologue's queries, a NoPE layer,
    # Llama 4's chunks in both kernels, Gemma 4's GeGLU experts in the fused MoE kernel.
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
        ("lfm2", dict(conv_bias=True), "conv_bias"),
        ("gemma4_moe", dict(top_k_experts=9), "top_k_experts=9 of num_experts=8"),
        ("gemma4_moe", dict(num_experts=None), "num_experts=None"),
        ("lfm2", dict(layer_types=["conv", "sliding_attention", "conv", "full_attention"]), "layer_types"),
    ],
)
def test_what_a_family_does_not_run_is_refused_by_name(name, overrides, named, tmp_path):
    preset = {**TINY_PRESETS[name], **overrides}
    path = make_tiny_model(tmp_path, weights=False, **preset)
    with pytest.raises(ModelLoadError, match=named):
        LLM(str(path), device="cpu", load_format="dummy")


def test_a_llama4_whose_every_layer_is_chunked_gives_back_the_blocks_behind_its_chunk(tmp_path):
    # A query at p reads its chunk alone, [p - p % 16, p]: with no global layer a sequence holds about a chunk and a
    # step's tokens of blocks, so 10 blocks of 8 (80 tokens) serve prompts of 130 to 300 tokens, token-exact
    layers = dict(no_rope_layers=[1] * 4, layer_types=["chunked_attention"] * 4, attention_chunk_size=16)
    path = make_tiny_model(tmp_path, **TINY_PRESETS["llama4"], **layers)
    hf = transformers.Llama4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = random_prompts([300, 130, 217], seed=60)
    options = dict(device="cpu", dtype="float32", kvcache_block_size=8, num_kvcache_blocks=10,
                   max_num_batched_tokens=24, max_num_seqs=2)  # fmt: skip
    with LLM(str(path), **options) as llm:
        assert llm.engine.block_manager.window == 16
        outputs = llm.generate(prompts, greedy(30), use_tqdm=False)
    assert_matches_hf(hf, prompts, outputs, 30)


def test_the_llama4_scout_preset_reads_as_its_published_config(load_app, tmp_path):
    path = make_tiny_model(tmp_path, **load_app("presets").PRESETS["llama4-scout-fp8"])  # config.json alone (dummy)
    spec = decoder_spec(transformers.AutoConfig.from_pretrained(path), max_model_len=32768)
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (48, 40, 8, 128)
    assert spec.layer_chunks == tuple(None if (i + 1) % 4 == 0 else 8192 for i in range(48))
    assert spec.rope_layers == tuple((i + 1) % 4 != 0 for i in range(48)) and spec.kv_window is None
    moe = spec.moe
    assert (moe.num_experts, moe.top_k, moe.router, moe.layers) == (16, 1, "sigmoid", tuple(range(48)))
    assert (moe.intermediate_size, moe.shared_expert_intermediate_size, spec.intermediate_size) == (8192, 8192, 16384)
    assert spec.quantization is not None


@pytest.mark.gpu
def test_on_a_gpu_the_llama4_scout_preset_generates_in_fp8_or_is_refused_with_the_memory_it_needs(load_app, tmp_path):
    # ~109 GB of FP8 weights: one H200 runs it with room for KV; an H100 (80 GB) refuses it, saying how much it needs
    path = make_tiny_model(tmp_path, **load_app("presets").PRESETS["llama4-scout-fp8"])
    try:
        llm = LLM(str(path), load_format="dummy", max_model_len=32768, max_num_seqs=8)
    except (ValueError, MemoryError, RuntimeError) as exc:
        assert torch.cuda.get_device_properties(0).total_memory < 120 * 2**30, exc
        assert "GiB" in str(exc) or "GB" in str(exc), exc
        return
    with llm:
        out = llm.generate([list(range(5, 300))], greedy(8), use_tqdm=False)
    assert len(out[0].token_ids) == 8


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma4", "gemma4_moe"])
def test_two_gemma4_ranks_generate_what_one_does_through_chunks_hits_and_preemption(name, family):
    # Each rank holds half of the query heads and of the sliding layers' two KV heads, and the full layers' one KV
    # head replicated; the per-layer inputs are computed whole on each rank; the shared layers read their source's
    # pages on each rank; with the MoE block, half of every expert's intermediate rows, the router and the block's
    # norms whole (the experts' partial sums all-reduced before their norm). Rank 0 schedules; the workers mirror
    # each step.
    path, hf = family(name)
    shared = random_prompts([40], seed=47)[0]
    prompts = [shared + tail for tail in random_prompts([3, 30, 9, 17], seed=48)]
    options = dict(device="cpu", dtype="float32", kvcache_block_size=8, max_num_batched_tokens=24, max_num_seqs=4,
                   num_kvcache_blocks=14)  # fmt: skip
    one, two = outputs_at_one_and_two_ranks(path, prompts, GREEDY, **options)
    assert [o.token_ids for o in one] == [o.token_ids for o in two]
    assert_matches_hf(hf, prompts, two, GREEDY.max_tokens)


def test_gemma4s_shared_layers_cost_no_kv_and_its_full_layers_page_their_own_shape(family):
    path, _ = family("gemma4")
    with LLM(str(path), device="cpu", dtype="float32", kvcache_block_size=8) as llm:
        layout = llm.engine.runner.layout
        assert layout.specs[4:] == [SharedKV(2), SharedKV(3)]  # the last two layers read layers 2's and 3's
        assert layout.kv_groups == {(2, 16): [0, 2], (1, 32): [1, 3]}
        # K and V of 8 tokens, float32: two sliding layers of 2 x 16, two full ones of 1 x 32, nothing for the rest
        assert layout.kv_block_bytes(8, torch.float32) == 2 * (2 * 2 * 16 + 2 * 1 * 32) * 8 * 4


def test_the_gemma4_preset_reads_as_its_config(load_app, tmp_path):
    path = make_tiny_model(tmp_path, **load_app("presets").PRESETS["gemma-4-text"])  # config.json alone (dummy)
    spec = decoder_spec(transformers.AutoConfig.from_pretrained(path), max_model_len=32768)
    full = [i for i in range(30) if i % 6 == 5]
    assert [spec.kv_shape(i) for i in (0, 5)] == [(4, 256), (4, 512)] and spec.window(0) == 512
    assert spec.kv_sources == (None,) * 20 + tuple(17 if i in full else 19 for i in range(20, 30))
    assert spec.layer_intermediate == (9216,) * 20 + (18432,) * 10 and spec.per_layer_input == (262144, 256, 0)
    assert spec.rope.scaling.rotated_pairs == 64 and spec.sliding_rope.scaling is None
    assert spec.attention_scale == 1.0 and spec.final_logit_softcap == 30.0


@pytest.mark.gpu
def test_on_a_gpu_the_gemma4_preset_generates_in_bf16(load_app, tmp_path):
    path = make_tiny_model(tmp_path, **load_app("presets").PRESETS["gemma-4-text"])
    with LLM(str(path), load_format="dummy", max_model_len=8192, max_num_seqs=8) as llm:
        out = llm.generate([list(range(5, 1300)), list(range(7, 20))], greedy(8), use_tqdm=False)
    assert [len(o.token_ids) for o in out] == [8, 8]
