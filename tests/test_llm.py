"""The offline API as a user drives it: prompts in, outputs in order, stop rules, seeds, logprobs, chat."""

import time
from dataclasses import replace

import pytest
import torch

from nanostream import LLM, EngineConfig, SamplingParams
from nanostream.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(str(qwen3_dir), device="cpu", kvcache_block_size=16)


def test_prompt_forms_and_order(llm):
    text = "The river ran past the mill"
    ids = llm.tokenizer(text).input_ids
    single = llm.generate(text, GREEDY, use_tqdm=False)
    as_ids = llm.generate(ids, GREEDY, use_tqdm=False)
    batch = llm.generate([[7, 8, 9], text, ids], GREEDY, use_tqdm=False)
    assert len(single) == len(as_ids) == 1 and len(batch) == 3
    assert single[0].token_ids == as_ids[0].token_ids == batch[1].token_ids == batch[2].token_ids
    assert single[0].prompt == text and as_ids[0].prompt is None
    assert batch[0].prompt_token_ids == [7, 8, 9] and batch[1].prompt_token_ids == ids
    assert single[0].text == llm.tokenizer.decode(single[0].token_ids)
    assert len({o.request_id for o in batch}) == 3


def test_one_sampling_params_per_prompt(llm):
    outs = llm.generate(
        [[5, 6], [5, 6]], [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), GREEDY], use_tqdm=False
    )
    assert [len(o.token_ids) for o in outs] == [3, 16]
    assert outs[1].token_ids[:3] == outs[0].token_ids
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate([[5], [6]], [GREEDY], use_tqdm=False)


def test_stop_string_cuts_text(llm):
    prompt = [11, 12, 13, 14]
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
    stop = full.text[12:15]
    assert stop and stop.strip()
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]), use_tqdm=False
    )[0]
    assert out.text == full.text[: full.text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < 40 and full.token_ids[: len(out.token_ids)] == out.token_ids
    assert not llm.engine.has_unfinished()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_stop_token_ids_and_min_tokens(llm):
    prompt = [21, 22, 23]
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)[0]
    stop_id = full.token_ids[4]
    first = full.token_ids.index(stop_id)
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id]), use_tqdm=False
    )[0]
    assert out.token_ids == full.token_ids[: first + 1]  # the step already in flight adds nothing
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    # Under min_tokens the stop token may not be sampled at all.
    late = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=30, min_tokens=first + 3, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )[0]
    assert stop_id not in late.token_ids[: first + 3]


def test_seeded_sampling_reproducible_and_batch_independent(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=1234, ignore_eos=True)
    alone = llm.generate([[30, 31, 32]], params, use_tqdm=False)[0].token_ids
    others = SamplingParams(temperature=0.7, max_tokens=25, ignore_eos=True)
    crowd = llm.generate([[40] * 9, [30, 31, 32], [41, 42]], [others, params, others], use_tqdm=False)
    assert crowd[1].token_ids == alone
    different = llm.generate(
        [[30, 31, 32]],
        SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=99, ignore_eos=True),
        use_tqdm=False,
    )[0].token_ids
    assert different != alone


def test_each_rows_cut_applies_in_a_mixed_batch(llm):
    # min_p = 1 and a tiny top_p keep only the most likely token, so those rows sample what greedy does,
    # at temperature 1 and beside rows that sample freely; the free rows do not.
    prompt = [30, 31, 32]
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    free = SamplingParams(temperature=1.0, max_tokens=20, seed=5, ignore_eos=True)
    cuts = [replace(free, min_p=1.0), replace(free, top_p=1e-6), replace(free, top_k=1)]
    outs = llm.generate([prompt] * 5, [free, *cuts, replace(free, seed=6)], use_tqdm=False)
    assert [o.token_ids for o in outs[1:4]] == [greedy[0].token_ids] * 3
    assert outs[0].token_ids != greedy[0].token_ids and outs[4].token_ids != greedy[0].token_ids


def test_engine_seed_makes_unseeded_runs_repeatable(qwen3_dir):
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    a = LLM(str(qwen3_dir), device="cpu", seed=7).generate([[3, 4], [5]], params, use_tqdm=False)
    b = LLM(str(qwen3_dir), device="cpu", seed=7).generate([[3, 4], [5]], params, use_tqdm=False)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_logprobs_match_hf(llm, qwen3_dir, hf_model_cache):
    prompt = [50, 51, 52, 53]
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3), use_tqdm=False
    )[0]
    assert len(out.logprobs) == 6
    hf = hf_model_cache(qwen3_dir)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1].float()
    ref = logits.log_softmax(-1)
    for step, (token, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        top = ref[step].topk(3)
        assert set(lp) == {token, *top.indices.tolist()}
        for tid, value in lp.items():
            assert value == pytest.approx(ref[step, tid].item(), abs=1e-4)
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].logprobs is None


def test_chat_applies_the_template(llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    out = llm.chat(messages, GREEDY, use_tqdm=False)
    expected = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert expected.endswith("<|im_start|>assistant\n")
    assert out[0].prompt_token_ids == llm.tokenizer(expected, add_special_tokens=False).input_ids
    two = llm.chat([messages, messages[1:]], GREEDY, use_tqdm=False)
    assert len(two) == 2 and two[0].token_ids == out[0].token_ids


def test_progress_bar_reports_throughput(llm, capsys):
    llm.generate([[1, 2, 3]] * 3, GREEDY, use_tqdm=True)
    err = capsys.readouterr().err
    assert "3/3" in err and "decode" in err and "tok/s" in err


def test_abort_in_every_state_returns_every_block(qwen3_dir):
    engine = LLMEngine(
        EngineConfig(str(qwen3_dir), device="cpu", kvcache_block_size=8, max_num_batched_tokens=32, max_num_seqs=2)
    )
    total = engine.block_manager.num_blocks
    engine.add_request("decoding", list(range(3, 13)), GREEDY)
    engine.step()  # admitted and prefilled in full
    engine.add_request("prefilling", list(range(3, 103)), GREEDY)
    engine.add_request("waiting", list(range(3, 20)), GREEDY)
    engine.step()  # "prefilling" gets a first chunk; "waiting" must wait (max_num_seqs=2)
    seqs = engine.scheduler.requests
    assert seqs["decoding"].num_output_tokens == 2
    assert 0 < seqs["prefilling"].num_computed_tokens < 100
    assert seqs["waiting"].status.value == "waiting"
    for rid in ("prefilling", "waiting", "decoding"):
        delta = engine.abort(rid)
        assert delta.finish_reason == "abort"
        assert engine.abort(rid) is None  # idempotent
    assert engine.block_manager.num_free_blocks == total
    assert not engine.has_unfinished()
    assert engine.step().deltas == []


def test_step_inputs_travel_as_one_buffer_per_dtype(qwen3_dir):
    # prepare() sends a step's int64 and int32 inputs in one copy each; every tensor is a view that
    # starts on a 16-element boundary (kernels may assume aligned pointers) and holds its own values.
    from nanostream.engine.scheduler import ScheduledChunk
    from nanostream.engine.sequence import Sequence

    llm = LLM(str(qwen3_dir), device="cpu", kvcache_block_size=4)
    runner = llm.engine.runner

    def chunk(name, num_tokens, computed, blocks):
        seq = Sequence(
            name,
            list(range(3, 3 + num_tokens)),
            SamplingParams(),
            max_tokens=1,
            sampling_seed=0,
            stop_token_ids=frozenset(),
        )
        seq.num_computed_tokens, seq.block_table = computed, blocks
        return ScheduledChunk(seq, num_tokens - computed)

    chunks = [chunk("decode", 6, 5, [7, 2]), chunk("prefill", 9, 2, [4, 0, 5])]
    ids, positions, meta, sample_rows, *_ = runner.prepare(chunks)
    assert ids.tolist() == [8, *range(5, 12)] and positions.tolist() == [5, *range(2, 9)]
    assert meta.slot_mapping.tolist() == [2 * 4 + 1, 4 * 4 + 2, 4 * 4 + 3, *range(0, 4), 5 * 4]
    assert meta.cu_seqlens_q.tolist() == [0, 1, 8] and meta.seq_lens.tolist() == [6, 9]
    assert meta.block_tables.tolist() == [[7, 2, 0], [4, 0, 5]] and sample_rows == [0, 7]
    int64 = (ids, positions, meta.slot_mapping)
    int32 = (meta.cu_seqlens_q, meta.seq_lens, meta.block_tables)
    for group in (int64, int32):
        assert len({t.untyped_storage().data_ptr() for t in group}) == 1
        assert all(t.storage_offset() % 16 == 0 for t in group)


def test_an_llm_leaves_the_collector_as_it_found_it_and_is_freed_with_its_last_reference(qwen3_dir):
    # The collector's freeze belongs to the program (the engine process and the benchmarks freeze
    # their start-up heap): an LLM neither freezes nor un-freezes what its caller froze.
    import gc
    import weakref

    gc.freeze()
    frozen = gc.get_freeze_count()
    try:
        llm = LLM(str(qwen3_dir), device="cpu", kvcache_block_size=16)
        assert gc.get_freeze_count() <= frozen, "the LLM froze its own objects"
        runner, pool = weakref.ref(llm.engine.runner), weakref.ref(llm.engine.runner.kv_caches[0].k)
        assert llm.generate([[5, 6, 7]], GREEDY)[0].token_ids
        del llm
        gc.collect()
        assert runner() is None and pool() is None
        assert gc.get_freeze_count() > frozen // 2, "deleting the LLM un-froze the caller's objects"
    finally:
        gc.unfreeze()


def test_closing_an_llm_gives_its_pool_and_weights_back_while_its_name_lives(qwen3_dir):
    # A notebook or a test builds one LLM after another under the same name: the end of `with` frees the first's
    # memory before the second sizes its pool from what is free (on a GPU, what it measures).
    import weakref

    with LLM(str(qwen3_dir), device="cpu", kvcache_block_size=16) as llm:
        assert llm.generate([[5, 6, 7]], GREEDY)[0].token_ids
        model, pool = weakref.ref(llm.engine.runner.model), weakref.ref(llm.engine.runner.kv_caches[0].k)
    assert model() is None and pool() is None
    with pytest.raises(RuntimeError, match="this LLM is closed: build a new one"):
        llm.generate([[5, 6, 7]], GREEDY)
    llm.close()  # twice is harmless


def test_engine_stats_split_the_time_to_first_token_into_queue_and_prefill(qwen3_dir):
    # One request at a time: b waits in the queue for all of a, then gets its own prefill step.
    engine = LLM(str(qwen3_dir), device="cpu", max_num_seqs=1).engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("a", [1, 2, 3], params)
    engine.add_request("b", [4, 5, 6], params)
    start = time.monotonic()  # after both arrived
    a_done = None
    while engine.has_unfinished():
        deltas = engine.step().deltas
        if a_done is None and any(d.request_id == "a" and d.finish_reason for d in deltas):
            a_done = time.monotonic()  # b can be scheduled only by a later step
    stats = engine.stats()
    assert stats.first_tokens == 2
    assert stats.queue_seconds >= a_done - start  # b's wait alone
    assert 0 < stats.prefill_seconds < time.monotonic() - start


def test_engine_stats_count_steps_tokens_finishes_and_prefix_hits(qwen3_dir):
    engine = LLM(str(qwen3_dir), device="cpu", kvcache_block_size=16).engine
    shared = list(range(20, 60))  # two full blocks and more
    engine.add_request("a", shared, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    engine.add_request("b", [*shared, 7], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    engine.add_request("c", [1, 2, 3], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.abort("c")
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats()
    assert stats.generation_tokens == 4 + 6  # c's first token was in flight when it was aborted: dropped
    assert stats.finished == {"length": 2, "abort": 1}
    assert stats.prefix_cache_queries == 40 + 41 + 3 and stats.prefix_cache_hits == 32  # b reuses a's 2 blocks
    assert stats.prompt_tokens == 40 + (41 - 32) + 3
    assert sum(stats.steps.values()) == sum(stats.step_ms_buckets) and stats.step_seconds > 0
    assert set(stats.steps) <= {"prefill", "decode", "mixed"} and stats.steps.get("decode", 0) >= 3
    assert stats.scheduled_requests >= sum(stats.steps.values())
