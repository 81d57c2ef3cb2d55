"""Hybrid models (Gated DeltaNet layers beside full attention: Qwen3.5, Qwen3.5-MoE, Qwen3-Next; LFM2's gated short
convolutions beside attention) through the whole
engine: greedy float32 output token-identical to transformers' generate with prompts of 1 to 700 tokens, chunked
prefill with chunks that end anywhere, preemption, n > 1, prefix hits at several depths restoring a state snapshot
(a hit gives a cold run's tokens), and a multi-turn chat whose prefix-cache hits come close to a dense model's."""

from __future__ import annotations

import random
import re

import pytest
import torch
from helpers import outputs_at_one_and_two_ranks, served_openai
from test_hf_parity import assert_matches_hf, greedy, random_prompts

from nanostream import LLM, SamplingParams
from nanostream.testing import TINY_PRESETS, make_tiny_model

HYBRIDS = {
    "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
}
ENGINE = dict(device="cpu", dtype="float32", kvcache_block_size=8, state_snapshot_interval=16)


@pytest.fixture(scope="module")
def hybrid_dirs(tmp_path_factory):
    return {
        name: make_tiny_model(tmp_path_factory.mktemp(name), architecture=arch, seed=30 + i)
        for i, (name, arch) in enumerate(HYBRIDS.items())
    }


@pytest.fixture(params=list(HYBRIDS))
def hybrid_dir(request, hybrid_dirs):
    return hybrid_dirs[request.param]


def test_mixed_batch_of_1_to_700_tokens_matches_hf(hybrid_dir, hf_model_cache):
    prompts = random_prompts([1, 7, 16, 33, 130, 700], seed=40)
    params = greedy(16)
    with LLM(str(hybrid_dir), **ENGINE) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_matches_hf(hf_model_cache(hybrid_dir), prompts, outputs, params.max_tokens)


def test_chunks_ending_anywhere_and_preemption_match_hf(hybrid_dir, hf_model_cache):
    prompts = random_prompts([61, 150, 9, 37, 23, 45], seed=41)
    params = greedy(24)
    with LLM(str(hybrid_dir), **ENGINE, max_num_batched_tokens=29, max_num_seqs=4, num_kvcache_blocks=30) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.stats()
        assert llm.engine.block_manager.num_free_blocks == 30
        states = llm.engine.block_manager.states
        assert len(states.free_live) == states.num_live  # every live slot back
    assert stats.preemptions > 0 and stats.steps["mixed"] > 0
    assert_matches_hf(hf_model_cache(hybrid_dir), prompts, outputs, params.max_tokens)


def test_prefix_hits_at_several_depths_give_a_cold_runs_tokens(hybrid_dir, hf_model_cache):
    base = random_prompts([90], seed=42)[0]
    tails = random_prompts([3, 11, 1], seed=43)
    prompts = [base[:depth] + tail for depth, tail in zip((17, 50, 90), tails)]  # cached 16, 48 (interval), 88
    params = greedy(12)
    with LLM(str(hybrid_dir), **ENGINE) as llm:
        llm.generate([base], params, use_tqdm=False)  # caches the base's snapshots
        outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.num_cached_tokens for o in outputs] == [16, 48, 88]
    with LLM(str(hybrid_dir), **ENGINE, enable_prefix_caching=False) as cold:
        assert [o.token_ids for o in cold.generate(prompts, params, use_tqdm=False)] == [o.token_ids for o in outputs]
    assert_matches_hf(hf_model_cache(hybrid_dir), prompts, outputs, params.max_tokens)


def test_the_prompts_end_snapshot_is_kept_when_every_slot_waits_for_its_step(hybrid_dirs):
    # 4 snapshot slots (max_num_seqs), all taken by the first chunk's interval boundaries (16..64) and still waiting
    # for their step when the second chunk is scheduled: the prompt's end (96) takes the latest one's slot, so the
    # next turn restores its whole history, as a cold run would compute it.
    path = hybrid_dirs["qwen3_5"]
    shared = random_prompts([100], seed=52)[0]
    prompts = [shared + tail for tail in random_prompts([3, 50], seed=53)]
    params = greedy(8)
    options = {**ENGINE, "max_num_batched_tokens": 64, "max_num_seqs": 4}
    with LLM(str(path), **options) as llm:
        assert llm.engine.scheduler.block_manager.states.num_snapshots == 4
        llm.generate([shared], params, use_tqdm=False)
        hit = llm.generate(prompts, params, use_tqdm=False)
    with LLM(str(path), **options, enable_prefix_caching=False) as cold:
        fresh = cold.generate(prompts, params, use_tqdm=False)
    assert [o.num_cached_tokens for o in hit] == [96, 96]
    assert [o.token_ids for o in hit] == [o.token_ids for o in fresh]


def test_six_conversations_next_turns_each_restore_their_whole_history(hybrid_dirs):
    # 12 snapshot slots for six conversations' interval, prompt-end and decode-tail snapshots: the chunks that a step
    # plans take slots only after every admission of the step holds its hit, so no turn loses its history to
    # the turns admitted beside it (the last one hit 0 tokens before).
    path = hybrid_dirs["qwen3_5"]
    prompts = random_prompts([5, 17, 40, 3, 64, 9], seed=54)
    params = greedy(40)
    with LLM(str(path), **ENGINE, max_num_batched_tokens=128, max_num_seqs=12) as llm:
        first = llm.generate(prompts, params, use_tqdm=False)
        turns = [p + o.token_ids + tail for p, o, tail in zip(prompts, first, random_prompts([4] * 6, seed=55))]
        second = llm.generate(turns, params, use_tqdm=False)
    assert [o.num_cached_tokens for o in second] == [(len(p) + 39) // 8 * 8 for p in prompts]


def test_n_samples_share_the_prompts_state_and_are_each_what_one_request_gives(hybrid_dirs):
    path = hybrid_dirs["qwen3_5"]
    prompt = random_prompts([45], seed=44)[0]
    params = SamplingParams(temperature=0.8, seed=5, n=3, max_tokens=10, ignore_eos=True)
    with LLM(str(path), **ENGINE) as llm:
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        assert llm.engine.stats().prefix_cache_hits == 2 * 40  # samples 1 and 2 from the prompt's end snapshot
        alone = [
            llm.generate([prompt], SamplingParams(temperature=0.8, seed=5 + i, max_tokens=10, ignore_eos=True),
                         use_tqdm=False)[0].token_ids
            for i in range(3)
        ]  # fmt: skip
    assert [o.token_ids for o in out.outputs] == alone
    assert len({tuple(t) for t in alone}) > 1


def chat_hit_share(path, hf, turns: int = 4, conversations: int = 3) -> float:
    """The share of prompt tokens served from the prefix cache over a multi-turn chat: a shared system prompt,
    each turn's prompt the conversation's whole history (its replies as generated) and a new message; every
    reply checked against transformers."""
    rng = random.Random(45)
    system = [rng.randrange(3, 500) for _ in range(40)]
    histories = [list(system) for _ in range(conversations)]
    params = greedy(12)
    cached = total = 0
    with LLM(str(path), **ENGINE) as llm:
        for _ in range(turns):
            prompts = [h + [rng.randrange(3, 500) for _ in range(rng.randrange(5, 20))] for h in histories]
            outputs = llm.generate(prompts, params, use_tqdm=False)
            assert_matches_hf(hf, prompts, outputs, params.max_tokens)
            cached += sum(o.num_cached_tokens for o in outputs)
            total += sum(len(p) for p in prompts)
            histories = [p + o.token_ids for p, o in zip(prompts, outputs)]
    return cached / total


def test_a_multi_turn_chat_hits_the_prefix_cache_nearly_as_a_dense_model_does(hybrid_dirs, qwen3_dir, hf_model_cache):
    dense = chat_hit_share(qwen3_dir, hf_model_cache(qwen3_dir))
    hybrid = chat_hit_share(hybrid_dirs["qwen3_5"], hf_model_cache(hybrid_dirs["qwen3_5"]))
    print(f"prefix-cache share of prompt tokens: dense {dense:.3f}, hybrid {hybrid:.3f} ({hybrid / dense:.3f}x)")
    assert dense > 0.5
    assert hybrid >= 0.9 * dense


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    """Qwen3.5 as Qwen publishes it: Qwen3_5ForConditionalGeneration, a vision tower beside the language model."""
    return make_tiny_model(tmp_path_factory.mktemp("qwen3_5_vl"), **TINY_PRESETS["qwen3_5_vl"])


def test_the_published_multimodal_checkpoint_runs_its_language_model_as_transformers_does(vl_dir):
    import transformers

    hf = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(vl_dir, dtype=torch.float32).eval()
    prompts = random_prompts([5, 70], seed=46)
    params = greedy(12)
    with LLM(str(vl_dir), **ENGINE) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_matches_hf(hf, prompts, outputs, params.max_tokens)


def test_structured_output_holds_on_a_hybrid_model(hybrid_dirs):
    import json

    import jsonschema

    from nanostream.structured_outputs import StructuredOutputsParams

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    params = SamplingParams(max_tokens=60, seed=1, structured_outputs=StructuredOutputsParams(json=schema))
    with LLM(str(hybrid_dirs["qwen3_next"]), **ENGINE) as llm:
        (out,) = llm.generate(["A JSON object:"], params, use_tqdm=False)
    jsonschema.validate(json.loads(out.text), schema)


def test_the_batch_invariant_mode_gives_a_requests_tokens_whatever_shares_its_steps(hybrid_dirs):
    prompts = random_prompts([5, 30, 77], seed=54)
    params = SamplingParams(temperature=0.9, seed=7, max_tokens=12, ignore_eos=True)
    with LLM(str(hybrid_dirs["qwen3_next"]), **ENGINE, batch_invariant=True) as llm:
        together = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        alone = [llm.generate([p], params, use_tqdm=False)[0].token_ids for p in prompts]
    assert together == alone


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3_next", "lfm2"])
def test_two_ranks_generate_what_one_does_through_chunks_hits_and_preemption(name, hybrid_dirs):
    # Each rank holds half of every DeltaNet layer's key heads (and their value heads), or half of a short
    # convolution's channels, and half of the attention heads; rank 0 sends each chunk's state slot, start and
    # snapshots with its tokens. (Each layout's split of the DeltaNet is checked against one rank's logits in
    # test_hybrid_model.py.)
    path = hybrid_dirs[name]
    shared = random_prompts([40], seed=47)[0]
    prompts = [shared + tail for tail in random_prompts([3, 30, 9, 17], seed=48)]
    options = dict(**ENGINE, max_num_batched_tokens=24, max_num_seqs=4, num_kvcache_blocks=14)
    one, two = outputs_at_one_and_two_ranks(path, prompts, greedy(20), **options)
    assert [o.token_ids for o in one] == [o.token_ids for o in two]


@pytest.mark.slow
def test_qwen3_5_streams_through_serve_and_the_openai_client_and_refuses_a_broken_image(vl_dir, tmp_path, monkeypatch):
    import openai
    import transformers
    from test_hf_parity import hf_greedy

    prompt = random_prompts([40], seed=49)[0]
    with served_openai(vl_dir, tmp_path, monkeypatch) as (api, said):
        stream = api.completions.create(model=vl_dir.name, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                        extra_body={"min_tokens": 24})  # fmt: skip
        chunks = [c.choices[0].text for c in stream if c.choices]
        image = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
        with pytest.raises(openai.BadRequestError, match="image 1"):  # (images that open: test_image_api.py)
            api.chat.completions.create(model=vl_dir.name, messages=[{"role": "user", "content": image}])
    out = "".join(said)
    # what the pools hold: the attention layer's KV blocks, the 3 DeltaNet layers' states and their snapshots
    assert re.search(r"cache: [\d,]+ KV blocks of 16 tokens \(1 attention layer\); 256 sequences' states and \d+ "
                     r"prefix-cache snapshots of [\d.]+ MiB each \(3 recurrent layers\)", out), out  # fmt: skip
    hf = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(vl_dir, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(vl_dir)
    assert len(chunks) > 5
    assert "".join(chunks) == tokenizer.decode(hf_greedy(hf, prompt, 24), skip_special_tokens=True)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_on_a_gpu_the_hybrid_engine_gives_the_cpu_engines_tokens(backend, hybrid_dirs):
    # The state pool, its slots and snapshots on the device; the DeltaNet layers' torch code eager on it, the
    # attention layers through each backend; float32, so the tokens are the CPU's.
    path = hybrid_dirs["qwen3_next"]
    shared = random_prompts([40], seed=50)[0]
    prompts = [shared + tail for tail in random_prompts([1, 30, 200], seed=51)]
    params = greedy(16)
    runs = []
    for device in ("cpu", "cuda"):
        options = {**ENGINE, "device": device, "max_num_batched_tokens": 64, "max_num_seqs": 4}
        if device == "cuda":
            options["attention_backend"] = backend
        with LLM(str(path), **options) as llm:
            outputs = llm.generate(prompts[:1], params, use_tqdm=False) + llm.generate(
                prompts[1:], params, use_tqdm=False
            )
        runs.append([o.token_ids for o in outputs])
        assert [o.num_cached_tokens for o in outputs[1:]] == [40, 40]  # the first prompt's end snapshot
    assert runs[0] == runs[1]


@pytest.mark.gpu
def test_on_a_gpu_in_bfloat16_the_deltanet_runs_flas_kernels_and_a_hit_continues_as_a_cold_run(hybrid_dirs):
    pytest.importorskip("fla")
    path = hybrid_dirs["qwen3_5_moe"]
    shared = random_prompts([100], seed=52)[0]
    prompts = [shared + tail for tail in random_prompts([3, 50], seed=53)]
    params = greedy(8)
    options = {**ENGINE, "device": "cuda", "dtype": "bfloat16", "max_num_batched_tokens": 64, "max_num_seqs": 4}
    with LLM(str(path), **options) as llm:
        assert llm.engine.runner.model.model.layers[0].linear_attn.varlen is not None  # fla-core's kernels
        llm.generate([shared], params, use_tqdm=False)
        hit = llm.generate(prompts, params, use_tqdm=False)
    with LLM(str(path), **options, enable_prefix_caching=False) as cold:
        fresh = cold.generate(prompts, params, use_tqdm=False)
    assert [o.num_cached_tokens for o in hit] == [96, 96]
    assert [o.token_ids[:4] for o in hit] == [o.token_ids[:4] for o in fresh]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3_5", "lfm2"])
def test_on_a_gpu_hybrid_decode_replays_cuda_graphs_with_the_state_slots_as_inputs(name, hybrid_dirs):
    # Decode through the captured graphs (the state slots an input, padding rows touching no state) gives the eager
    # engine's tokens exactly, snapshots taken during decode included: the second turn restores one.
    path = hybrid_dirs[name]
    prompts = random_prompts([5, 17, 40, 3, 64, 9], seed=54)
    params = greedy(40)
    options = {**ENGINE, "device": "cuda", "dtype": "bfloat16", "max_num_batched_tokens": 128, "max_num_seqs": 12}
    runs = []
    for eager in (False, True):
        with LLM(str(path), **options, enforce_eager=eager) as llm:
            assert (llm.engine.runner.graphs is None) == eager
            first = llm.generate(prompts, params, use_tqdm=False)
            turns = [p + o.token_ids + tail for p, o, tail in zip(prompts, first, random_prompts([4] * 6, seed=55))]
            second = llm.generate(turns, params, use_tqdm=False)
        # each second turn restores the first's state at its last full block, a decode tail
        assert [o.num_cached_tokens for o in second] == [(len(p) + 39) // 8 * 8 for p in prompts]
        runs.append([o.token_ids for o in first + second])
    assert runs[0] == runs[1]
