"""Multi-head latent attention (layers/latent_attention.py) and the families on it: DeepSeek-V3 (R1, V3.1, Kimi K2,
Moonlight), DeepSeek-V2 (V2-Lite: no q LoRA), GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``) and Mistral 4.

Tiny random checkpoints (nanostream/testing/tiny_latent.py: every norm, router and correction bias drawn) give
transformers' greedy tokens in float32 for prompts of 1 to 700 tokens, in chunks, from prefix-cache hits, through
preemption, with DeepSeek's YaRN; the cache pages one latent entry a token and the pool counts its real bytes; an
FP8 cache stores the entries quantized; two ranks (gloo threads) split the heads and keep the latent whole; what
nanostream does not run is refused by name.
"""

import json
import re

import pytest
import torch
import transformers
from helpers import served_openai
from safetensors.torch import load_file, save_file
from test_fp8_weights import KEPT_LAYOUTS, LAYOUTS, quantize, write_fp8
from test_hf_parity import greedy, hf_greedy, random_prompts
from test_tp import in_threads

from nanostream import LLM, ModelLoadError
from nanostream.distributed import SINGLE, TensorParallel
from nanostream.engine.runner.cache_pool import CacheLayout, allocate_caches
from nanostream.engine.runner.kv_pool import WarmupChunk
from nanostream.engine.runner.step_inputs import pack_step
from nanostream.engine.sequence import Sequence
from nanostream.kernels.fp8_kv import FP8_KV_DTYPE
from nanostream.kernels.mla_decode import paged_mla_decode
from nanostream.layers.attention import ForwardContext
from nanostream.layers.attention_backend import TorchAttention
from nanostream.layers.cache_spec import LatentCache, PagedLatent
from nanostream.layers.layer_kernels import LayerKernels
from nanostream.models import decoder_spec, load_model
from nanostream.models.sharding import check_split
from nanostream.sampling_params import SamplingParams
from nanostream.testing import TINY_PRESETS, make_tiny_model, tiny_config

CPU = torch.device("cpu")
FAMILIES = ["deepseek_v3", "deepseek_v2", "glm4_moe_lite", "mistral4"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    names = [*FAMILIES, "deepseek_v3_yarn"]
    return {name: make_tiny_model(tmp_path_factory.mktemp(name), **TINY_PRESETS[name]) for name in names}


@pytest.fixture(scope="module")
def hf():
    """transformers' model of a directory, by its architecture's class (AutoModel does not know Mistral 4's)."""
    cache = {}

    def get(path):
        if path not in cache:
            arch = json.loads((path / "config.json").read_text())["architectures"][0]
            cache[path] = getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval()
        return cache[path]

    return get


def assert_matches(model, prompts, outputs, n):
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == hf_greedy(model, prompt, n), f"prompt of {len(prompt)} tokens diverged"


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_matches_hf_from_1_to_700_tokens_in_chunks_and_from_prefix_hits(name, dirs, hf):
    path = dirs[name]
    shared = random_prompts([64], seed=50)[0]
    prompts = random_prompts([1, 700, 37], seed=51) + [shared + tail for tail in random_prompts([5, 1, 30], seed=52)]
    params = greedy(10)
    llm = LLM(str(path), device="cpu", dtype="float32", kvcache_block_size=16, max_num_batched_tokens=128,
              max_num_seqs=8)  # fmt: skip
    first = llm.generate(prompts[:4], params, use_tqdm=False)  # the 700 tokens take six steps' budgets
    rest = llm.generate(prompts[4:], params, use_tqdm=False)
    assert [o.num_cached_tokens for o in rest] == [64, 64]
    stats = llm.engine.stats()
    assert stats.steps["prefill"] + stats.steps["mixed"] >= 6 and stats.steps["mixed"] > 0  # decode rows absorbed
    assert_matches(hf(path), prompts, first + rest, params.max_tokens)


def test_preemption_recomputes_the_latent_and_matches_hf(dirs, hf):
    path = dirs["deepseek_v3"]
    prompts = random_prompts([20, 27, 13, 40, 22, 31], seed=53)
    params = greedy(24)
    llm = LLM(str(path), device="cpu", dtype="float32", kvcache_block_size=8, num_kvcache_blocks=16,
              max_num_seqs=6, max_num_batched_tokens=64)  # fmt: skip
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == 16
    assert_matches(hf(path), prompts, outputs, params.max_tokens)


def test_deepseek_yarn_scales_the_tables_and_the_softmax_and_matches_hf(dirs, hf):
    path = dirs["deepseek_v3_yarn"]
    spec = decoder_spec(transformers.AutoConfig.from_pretrained(path), max_model_len=512)
    assert spec.rope.rope_type == "yarn" and spec.rope.scaling.attention_factor != 1.0  # mscale 0.8 / mscale 1.0
    mscale = 0.1 * 1.0 * torch.log(torch.tensor(4.0)).item() + 1.0  # mscale_all_dim 1.0, factor 4
    assert spec.latent_attention.scale == pytest.approx(24**-0.5 * mscale**2)
    prompts = random_prompts([3, 300], seed=54)  # past original_max_position_embeddings (128)
    llm = LLM(str(path), device="cpu", dtype="float32", kvcache_block_size=16)
    assert_matches(hf(path), prompts, llm.generate(prompts, greedy(10), use_tqdm=False), 10)


def test_the_pool_pages_one_latent_entry_a_token_at_its_real_bytes(dirs):
    path = dirs["deepseek_v3"]
    llm = LLM(str(path), device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=40)
    runner = llm.engine.runner
    assert runner.layout.specs == [PagedLatent(32 + 8)] * 3  # kv_lora_rank + qk_rope_head_dim, no V half
    assert runner.kv_block_bytes == 3 * 16 * 40 * 4
    assert all(isinstance(c, LatentCache) and c.latent.shape == (40, 16, 40) for c in runner.kv_caches)
    assert "40 KV blocks of 16 tokens (3 latent attention layers)" in runner.describe_cache()
    fp8 = LLM(str(path), device="cpu", dtype="float32", kvcache_block_size=16, kv_cache_dtype="fp8",
              kv_cache_memory_bytes=3 * 16 * 40 * 100)  # fmt: skip
    assert fp8.engine.runner.kv_block_bytes == 3 * 16 * 40 and fp8.engine.runner.num_kv_blocks == 100
    assert fp8.engine.runner.kv_caches[0].latent.dtype == FP8_KV_DTYPE


def test_an_fp8_cache_stores_the_entries_quantized_and_stays_close(dirs, hf):
    # e4m3 keeps ~2 significant digits: the logits move a little, the model's choices mostly not.
    path = dirs["glm4_moe_lite"]
    prompts = random_prompts([50, 9], seed=55)
    llm = LLM(str(path), device="cpu", dtype="float32", kvcache_block_size=16, kv_cache_dtype="fp8")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, logprobs=5), use_tqdm=False)
    stored = torch.cat([c.latent.flatten(0, 1) for c in llm.engine.runner.kv_caches]).float()
    assert stored.abs().amax() <= 448 and stored.count_nonzero() > 0
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            logits = hf(path)(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
        top = logits.topk(5).indices.tolist()
        assert out.token_ids[0] in top[:2]  # the float model's first or second choice
        theirs = {t: logits[t].item() for t in out.logprobs[0]}
        assert max(abs(theirs[t] - lp) for t, lp in out.logprobs[0].items()) < 0.2


def test_each_declaration_reads_its_latent_attention_and_experts():
    v3 = decoder_spec(tiny_config("DeepseekV3ForCausalLM", num_nextn_predict_layers=1), max_model_len=256)
    mla = v3.latent_attention
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.width, mla.interleaved, v3.head_dim) == (32, 32, 40, True, 8)
    assert v3.token_mixers == ("latent_attention",) * 3 and v3.unused_tensors == ("model.layers.3.",)
    assert (v3.moe.layers, v3.moe.groups, v3.moe.correction_bias, v3.moe.scoring) == ((1, 2), 4, True, "sigmoid")
    v2 = decoder_spec(tiny_config("DeepseekV2ForCausalLM"), max_model_len=256)
    assert v2.latent_attention.q_lora_rank is None and v2.latent_attention.interleaved
    assert (v2.moe.scoring, v2.moe.renormalize, v2.moe.correction_bias, v2.moe.scaling) == ("softmax", 0, 0, 1.5)
    glm = decoder_spec(tiny_config("Glm4MoeLiteForCausalLM", rope_interleave=False), max_model_len=256)
    assert glm.moe.layers == (1, 2) and not glm.latent_attention.interleaved and glm.latent_attention.v_head_dim == 24
    mistral = decoder_spec(tiny_config("Mistral4ForCausalLM"), max_model_len=256)
    assert (mistral.moe.scoring, mistral.moe.correction_bias, mistral.moe.groups) == ("softmax", False, 2)
    assert (mistral.latent_attention.query_scale_beta, mistral.latent_attention.query_scale_period) == (0.1, 64)


@pytest.mark.parametrize(
    ("name", "overrides", "message"),
    [
        ("DeepseekV3ForCausalLM", dict(architectures=["DeepseekV32ForCausalLM"]),
         "DeepseekV32ForCausalLM is not supported: .*indexer.* is not implemented"),
        ("DeepseekV3ForCausalLM", dict(attention_bias=True), "attention_bias=True is not supported"),
        ("DeepseekV3ForCausalLM", dict(kv_lora_rank=0), "kv_lora_rank=0 is not supported"),
        ("DeepseekV2ForCausalLM", dict(topk_method="group_limited_greedy"), "topk_method='group_limited_greedy'"),
        ("DeepseekV2ForCausalLM", dict(norm_topk_prob=True), "norm_topk_prob=True is not supported"),
        ("Glm4MoeLiteForCausalLM", dict(mlp_layer_types=["dense", "moe", "sparse"]), "mlp_layer_types=.*'dense' or"),
        ("Mistral4ForCausalLM", dict(rope_parameters=dict(rope_type="default", rope_theta=1e4,
                                                          llama_4_scaling_beta=0.1)), "need llama_4_scaling_beta"),
    ],
)  # fmt: skip
def test_a_config_nanostream_does_not_run_is_refused_naming_the_value(name, overrides, message):
    config = tiny_config(name)
    for key, value in overrides.items():
        setattr(config, key, value)
    with pytest.raises(ModelLoadError, match=message):
        decoder_spec(config, max_model_len=256)


def test_a_split_of_the_heads_that_cannot_be_made_names_the_numbers():
    spec = decoder_spec(tiny_config("DeepseekV3ForCausalLM"), max_model_len=256)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 cannot split .*num_attention_heads \(4\)"):
        check_split(spec, 3)


def test_a_multi_token_prediction_layer_is_skipped(dirs, tmp_path):
    path = tmp_path / "mtp"
    path.mkdir()
    for f in dirs["deepseek_v3"].iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    config = json.loads((path / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(4, 4)
    tensors["model.layers.3.self_attn.kv_b_proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, path / "model.safetensors")
    prompt = random_prompts([20], seed=56)
    outs = [LLM(str(p), device="cpu", dtype="float32").generate(prompt, greedy(6), use_tqdm=False)[0].token_ids
            for p in (dirs["deepseek_v3"], path)]  # fmt: skip
    assert outs[0] == outs[1]


def step_logits(spec, path, tp: TensorParallel, keep_fp8: bool | None = None):
    """One mixed step (a 30-token prompt, a decode row over 9 cached tokens, a 3-token prompt) on ``tp``'s shard."""
    model = load_model(spec, LayerKernels(TorchAttention()), path, dtype=torch.float32, device=CPU, tp=tp,
                       keep_fp8=keep_fp8)  # fmt: skip
    caches = allocate_caches(CacheLayout(model.cache_specs()), num_blocks=16, block_size=8, kv_dtype=torch.float32,
                             num_slots=0, model_dtype=torch.float32, device=CPU)  # fmt: skip
    chunks = []
    for i, (cached, new) in enumerate([(8, 1), (0, 30), (0, 3)]):
        seq = Sequence(f"s{i}", list(range(3 + i, 3 + i + cached + new)), SamplingParams(), max_tokens=1,
                       sampling_seed=0, stop_token_ids=frozenset())  # fmt: skip
        seq.block_table = list(range(4 * i, 4 * i + 4))
        chunks.append(WarmupChunk(seq, cached, new))
    with torch.inference_mode():
        first = pack_step([WarmupChunk(chunks[0].seq, 0, 8)], 8, CPU)  # the decode row's context, a step before
        model(first.input_ids, first.positions, ForwardContext(first.meta, caches))
        inputs = pack_step(chunks, 8, CPU)
        hidden = model(inputs.input_ids, inputs.positions, ForwardContext(inputs.meta, caches))
        return model, model.compute_logits(hidden[inputs.sample_rows])


def test_two_ranks_split_the_heads_keep_the_latent_whole_and_give_one_ranks_logits(dirs):
    path = dirs["deepseek_v3"]
    spec = decoder_spec(transformers.AutoConfig.from_pretrained(path), max_model_len=256)
    whole, expected = step_logits(spec, path, SINGLE)
    out = in_threads(2, lambda tp: step_logits(spec, path, tp))
    one = whole.model.layers[0].self_attn
    for rank, (model, logits) in out.items():
        assert (logits is None) == (rank > 0)
        attn = model.model.layers[0].self_attn
        assert attn.num_heads == 2 and attn.kv_b_proj.weight.shape == (2 * (16 + 16), 32)
        assert torch.equal(attn.kv_b_proj.weight, one.kv_b_proj.weight[rank * 64 : (rank + 1) * 64])
        assert torch.equal(attn.qkv_proj.weight, one.qkv_proj.weight)  # q_a and kv_a whole on each rank
        assert model.cache_specs() == whole.cache_specs()  # the same entry on every rank
    torch.testing.assert_close(out[0][1], expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[0][1].argmax(-1), expected.argmax(-1))


def write_deepseek_fp8(src, tmp_path, layout) -> None:
    """``tmp_path / "fp8"``: ``src`` as DeepSeek-V3's FP8 checkpoints store it (kv_a_proj_with_mqa quantized too),
    ``tmp_path / "twin"`` its dequantized weights."""
    write_fp8(src, tmp_path / "fp8", tmp_path / "twin", layout)
    stored, twin = (load_file(tmp_path / d / "model.safetensors") for d in ("fp8", "twin"))
    for name in [n for n in stored if n.endswith("kv_a_proj_with_mqa.weight")]:
        stored[name], stored[name + layout.scale], twin[name] = quantize(stored[name], layout)
    for d, tensors in (("fp8", stored), ("twin", twin)):
        save_file(tensors, tmp_path / d / "model.safetensors", metadata={"format": "pt"})


def test_deepseek_v3s_fp8_block_checkpoint_gives_transformers_greedy_ids_on_its_dequantized_weights(dirs, tmp_path, hf):
    # Its layout: quant_method "fp8", weight_scale_inv per block (48 x 40 here: partial blocks at every edge) on
    # every projection (q_a, q_b, kv_a_proj_with_mqa, kv_b, o, the experts', the shared experts', the dense MLP's),
    # the router and its float32 e_score_correction_bias as they are.
    write_deepseek_fp8(dirs["deepseek_v3"], tmp_path, LAYOUTS["fp8-block"])
    stored = load_file(tmp_path / "fp8" / "model.safetensors")
    for name in ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj", "mlp.experts.0.up_proj",
                 "mlp.shared_experts.down_proj"):  # fmt: skip
        assert stored[f"model.layers.1.{name}.weight"].dtype == torch.float8_e4m3fn
        assert f"model.layers.1.{name}.weight_scale_inv" in stored
    assert stored["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    prompts = random_prompts([1, 40, 90], seed=57)
    llm = LLM(str(tmp_path / "fp8"), device="cpu", dtype="float32", kvcache_block_size=16)
    assert_matches(hf(tmp_path / "twin"), prompts, llm.generate(prompts, greedy(10), use_tqdm=False), 10)


def test_kept_fp8_projections_compute_what_dequantized_ones_do_and_kv_b_stays_in_the_models_dtype(dirs, tmp_path):
    layout = KEPT_LAYOUTS["fp8-block-aligned"]  # blocks of 16 x 16: q_b, o and the dense MLP keep them
    write_deepseek_fp8(dirs["deepseek_v3"], tmp_path, layout)
    spec = decoder_spec(transformers.AutoConfig.from_pretrained(tmp_path / "fp8"), max_model_len=256)
    model, logits = step_logits(spec, tmp_path / "fp8", SINGLE, keep_fp8=True)
    _, expected = step_logits(spec, tmp_path / "fp8", SINGLE, keep_fp8=False)
    attn = model.model.layers[0].self_attn
    assert attn.q_b_proj.fp8_block == (16, 16) and attn.o_proj.fp8_block == (16, 16)
    assert attn.kv_b_proj.fp8_block is None and attn.kv_b_proj.weight.dtype == torch.float32  # read as W_UK, W_UV
    torch.testing.assert_close(logits, expected, rtol=1e-6, atol=1e-6)


def test_the_triton_backend_runs_the_mla_kernels_and_matches_hf(dirs, hf):
    # Under Triton's interpreter on CPU (a short workload): the latent store and the paged MLA decode kernel.
    path = dirs["deepseek_v3"]
    prompts = random_prompts([1, 40], seed=58)
    llm = LLM(str(path), device="cpu", dtype="float32", attention_backend="triton", kvcache_block_size=8,
              max_num_batched_tokens=32, max_num_seqs=4)  # fmt: skip
    assert llm.engine.runner.model.model.layers[0].self_attn.kernels.decode is paged_mla_decode
    assert_matches(hf(path), prompts, llm.generate(prompts, greedy(5), use_tqdm=False), 5)


@pytest.mark.parametrize("preset", ["moonlight-16b-a3b", "deepseek-v2-lite"])
def test_the_16b_mla_presets_read_as_their_published_configs(preset, load_app, tmp_path):
    presets = load_app("presets")
    path = make_tiny_model(tmp_path, **presets.PRESETS[preset])  # config.json alone (load_format="dummy")
    spec = decoder_spec(transformers.AutoConfig.from_pretrained(path), max_model_len=4096)
    mla = spec.latent_attention
    assert (spec.num_layers, spec.num_heads, mla.q_lora_rank, mla.width, mla.v_head_dim) == (27, 16, None, 576, 128)
    assert spec.moe.layers == tuple(range(1, 27)) and spec.moe.shared_expert_intermediate_size == 2 * 1408
    if preset == "moonlight-16b-a3b":
        assert (spec.moe.scoring, spec.moe.correction_bias, spec.moe.scaling) == ("sigmoid", True, 2.446)
        assert mla.scale == 192**-0.5 and spec.rope.theta == 50000.0
    else:  # YaRN's mscale(40, 0.707) twice in the softmax scale, the tables' factor mscale / mscale_all_dim = 1
        assert (spec.moe.scoring, spec.moe.correction_bias, spec.moe.renormalize) == ("softmax", False, False)
        mscale = 0.1 * 0.707 * torch.log(torch.tensor(40.0)).item() + 1
        assert mla.scale == pytest.approx(192**-0.5 * mscale**2) and spec.rope.scaling.attention_factor == 1.0
    # a token's cache: 576 values a layer, against 16 heads x (192 + 128) for the same shape with plain attention
    assert 16 * (192 + 128) / mla.width == pytest.approx(8.9, abs=0.05)


@pytest.mark.slow
def test_two_rank_engines_match_hf_through_chunks_hits_and_preemption(dirs, hf):
    # Worker processes over gloo: rank 0 schedules, each rank attends with its half of the heads over its own copy of
    # the latent pages (the same block ids).
    path = dirs["glm4_moe_lite"]
    shared = random_prompts([40], seed=59)[0]
    prompts = [shared + tail for tail in random_prompts([3, 30, 9, 17], seed=60)]
    options = dict(device="cpu", dtype="float32", kvcache_block_size=8, max_num_batched_tokens=24, max_num_seqs=4,
                   num_kvcache_blocks=14)  # fmt: skip
    with LLM(str(path), tensor_parallel_size=2, **options) as llm:
        outputs = llm.generate(prompts[:1], greedy(20), use_tqdm=False) + llm.generate(
            prompts[1:], greedy(20), use_tqdm=False
        )
        stats = llm.engine.stats()
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0
    assert_matches(hf(path), prompts, outputs, 20)


@pytest.mark.slow
def test_deepseek_v3_streams_through_serve_and_the_openai_client(dirs, hf, tmp_path, monkeypatch):
    path = dirs["deepseek_v3"]
    prompt = random_prompts([40], seed=61)[0]
    with served_openai(path, tmp_path, monkeypatch) as (api, said):
        stream = api.completions.create(model=path.name, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                        extra_body={"min_tokens": 24})  # fmt: skip
        chunks = [c.choices[0].text for c in stream if c.choices]
    assert re.search(r"cache: [\d,]+ KV blocks of 16 tokens \(3 latent attention layers\)", "".join(said)), said
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    assert len(chunks) > 5
    assert "".join(chunks) == tokenizer.decode(hf_greedy(hf(path), prompt, 24), skip_special_tokens=True)


def test_the_batch_invariant_mode_is_refused_for_latent_attention(dirs):
    # a decode row attends absorbed, a recomputed one (after a preemption) expanded: not the same arithmetic
    with pytest.raises(ValueError, match="batch_invariant does not run latent attention"):
        LLM(str(dirs["deepseek_v3"]), device="cpu", dtype="float32", batch_invariant=True)
