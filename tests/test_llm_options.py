"""The offline API's request options beyond plain sampling: n samples sharing the prompt's KV blocks, prompt
logprobs, logit bias, tools and template options in chat, reasoning split from the answer."""

import re
from dataclasses import replace

import pytest
import torch

from nanostream import LLM, InvalidRequestError, SamplingParams
from nanostream.client.samples import sample_params
from nanostream.structured_outputs import StructuredOutputsParams as SO

PROMPT = list(range(10, 80))  # 70 tokens: four full blocks of 16 and a partial one
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(str(qwen3_dir), device="cpu", kvcache_block_size=16)


def peak_blocks(llm, run):
    """The most KV blocks in use at once while ``run()`` generates."""
    bm, step, peak = llm.engine.block_manager, llm.engine.step, [0]

    def counting():
        result = step()
        peak[0] = max(peak[0], bm.num_blocks - bm.num_free_blocks)
        return result

    llm.engine.step = counting
    try:
        return run(), peak[0]
    finally:
        del llm.engine.step


def test_n_samples_are_reproducible_by_seed_and_share_the_prompt_blocks(llm):
    params = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=20, ignore_eos=True)
    _, one_peak = peak_blocks(llm, lambda: llm.generate([PROMPT[::-1]], replace(params, n=1), use_tqdm=False))
    out, peak = peak_blocks(llm, lambda: llm.generate([PROMPT], params, use_tqdm=False)[0])
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) == 3
    for i, sample in enumerate(out.outputs):  # sample i is the n = 1 request seeded seed + i
        alone = llm.generate(
            [PROMPT], SamplingParams(temperature=1.0, seed=5 + i, max_tokens=20, ignore_eos=True), use_tqdm=False
        )
        assert sample.token_ids == alone[0].token_ids and sample.finish_reason == "length"
    assert (out.text, out.token_ids) == (out.outputs[0].text, out.outputs[0].token_ids)
    assert peak < 3 * one_peak  # 4 shared prompt blocks + 3 x 2 of their own = 10, not 18
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_n_without_a_seed_gives_distinct_samples_and_n_1_is_unchanged(llm):
    out = llm.generate([PROMPT], SamplingParams(n=4, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert len({tuple(o.token_ids) for o in out.outputs}) == 4
    assert sample_params(SamplingParams(seed=3)) == [SamplingParams(seed=3)]
    assert [p.seed for p in sample_params(SamplingParams(n=3, seed=2**64 - 2))] == [2**64 - 2, 2**64 - 1, 0]
    with pytest.raises(InvalidRequestError, match="n must be 1 in an engine request"):
        llm.engine.add_request("x", PROMPT, SamplingParams(n=2))


def test_prompt_logprobs_match_hf_with_chunked_prefill_and_cached_prefixes(qwen3_dir, hf_model_cache):
    llm = LLM(str(qwen3_dir), device="cpu", kvcache_block_size=16, max_num_batched_tokens=24, max_num_seqs=4)
    llm.generate([PROMPT], SamplingParams(max_tokens=1), use_tqdm=False)  # the prompt's blocks are cached now
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    out = llm.generate([PROMPT, PROMPT[:1]], params, use_tqdm=False)
    with torch.no_grad():
        ref = hf_model_cache(qwen3_dir)(torch.tensor([PROMPT])).logits[0].float().log_softmax(-1)
    lps = out[0].prompt_logprobs
    assert len(lps) == len(PROMPT) and lps[0] is None
    for i in range(1, len(PROMPT)):
        token = PROMPT[i]
        assert set(lps[i]) == {token, *ref[i - 1].topk(2).indices.tolist()}
        assert lps[i][token] == pytest.approx(ref[i - 1, token].item(), abs=1e-4)
    assert out[1].prompt_logprobs == [None]
    assert (
        out[0].token_ids
        == llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0].token_ids
    )
    assert llm.generate([PROMPT], SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_logprobs is None


def test_zero_prompt_logprobs_of_a_one_token_prompt_cost_its_step_nothing(llm):
    # Found by tests/test_fuzz.py: a step whose only prompt-logprob rows were one-token prompts asking
    # for 0 top logprobs raised, and failed every request in it (another client's too).
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    alone = llm.generate([PROMPT], greedy, use_tqdm=False)[0].token_ids
    for top in (0, 3):
        out = llm.generate([PROMPT, [7]], [greedy, replace(greedy, prompt_logprobs=top)], use_tqdm=False)
        assert out[0].token_ids == alone and len(out[1].token_ids) == 4
        assert out[1].prompt_logprobs == [None]


def test_logit_bias_forces_and_bans_tokens(llm):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = llm.generate([PROMPT], greedy, use_tqdm=False)[0].token_ids
    forced = llm.generate([PROMPT], replace(greedy, logit_bias={123: 100}), use_tqdm=False)
    assert forced[0].token_ids == [123] * 6
    banned = llm.generate([PROMPT], replace(greedy, logit_bias={plain[0]: -100}), use_tqdm=False)
    assert banned[0].token_ids[0] != plain[0]
    with pytest.raises(InvalidRequestError, match=r"logit_bias names token id 99999, outside the vocabulary"):
        llm.generate([PROMPT], SamplingParams(logit_bias={99999: 1}), use_tqdm=False)
    for bad, match in [({1: 101}, r"in \[-100, 100\]"), ({-1: 1}, "non-negative"), ({"a": 1}, "token ids")]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(logit_bias=bad)


def test_chat_renders_tools_history_and_template_options_as_the_template_does(llm):
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    greedy = SamplingParams(temperature=0, max_tokens=2)
    out = llm.chat(history, greedy, use_tqdm=False, tools=TOOLS, chat_template_kwargs={"enable_thinking": False})[0]
    text = llm.tokenizer.apply_chat_template(
        history, tools=TOOLS, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert out.prompt_token_ids == llm.tokenizer(text, add_special_tokens=False).input_ids
    assert "<tool_call>" in text and "<tool_response>\nsunny" in text and text.endswith("<think>\n\n</think>\n\n")
    thinking = llm.chat(history, greedy, use_tqdm=False, tools=TOOLS)[0]
    assert len(out.prompt_token_ids) > len(thinking.prompt_token_ids)
    with pytest.raises(ValueError, match="chat_template_kwargs may not set tools"):
        llm.chat(history, greedy, use_tqdm=False, chat_template_kwargs={"tools": []})


def test_a_constraint_can_hold_after_a_block_of_free_reasoning(llm):
    """``reasoning=(start, end)``: the output may open with free text between the tags, and the
    constraint holds after it (what a reasoning parser asks for). Scripted with two one-token tags of the
    tiny vocabulary: greedy, the start tag's token is biased up, the end tag's higher."""
    tok = llm.tokenizer
    start, end = "very", "done"
    (s_id,), (e_id,) = (tok.encode(t, add_special_tokens=False) for t in (start, end))
    params = SamplingParams(temperature=0, max_tokens=60, logit_bias={s_id: 50.0, e_id: 80.0})
    year = SO(regex="[0-9]{4}", reasoning=(start, end))
    out = llm.generate(["A year?"], replace(params, structured_outputs=year), use_tqdm=False)[0]
    assert re.fullmatch(r"verydone\n*[0-9]{4}", out.text) and out.finish_reason == "stop", out.text
    # The block is optional: biased the other way round, the start tag is never taken, the answer comes first.
    only_end = replace(params, logit_bias={e_id: 80.0}, structured_outputs=year)
    assert re.fullmatch("[0-9]{4}", llm.generate(["A year?"], only_end, use_tqdm=False)[0].text)
    # reasoning_open (the prompt opened the block): the output must close it before it answers.
    opened = replace(params, logit_bias={e_id: 80.0}, structured_outputs=replace(year, reasoning_open=True))
    assert re.fullmatch(r"done\n*[0-9]{4}", llm.generate(["A year?"], opened, use_tqdm=False)[0].text)


def test_a_reasoning_parser_puts_the_constraint_after_the_reasoning(llm, monkeypatch):
    """With a reasoning parser and a model that has the tags as tokens, a constrained request reaches the
    engine with the parser's tags (the block open or not as the prompt left it), unless the constraint is
    to cover the reasoning too; a model without them answers under the constraint at once."""
    from transformers import AutoTokenizer

    from nanostream.client import output_processor

    messages = [{"role": "user", "content": "A year?"}]
    params = SamplingParams(temperature=0, max_tokens=4, structured_outputs=SO(regex="[0-9]{4}"))
    prompt = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    reasoner = AutoTokenizer.from_pretrained(llm.engine.model_path)
    reasoner.add_tokens(["<think>", "</think>"], special_tokens=False)  # as Qwen3's has them
    for tokenizer, tail, expected in (
        (reasoner, "", (("<think>", "</think>"), False)),
        (reasoner, "<think>\n", (("<think>", "</think>"), True)),  # the template opened the block
        (reasoner, "<think>\n\n</think>\n\n", (None, False)),  # and closed it: enable_thinking=False
        (llm.tokenizer, "", (None, False)),  # no tag tokens: not a reasoning model
    ):
        ids = tokenizer.encode(prompt + tail, add_special_tokens=False)
        so = output_processor.OutputProcessor(
            tokenizer, ids, params, reasoning_parser="qwen3"
        ).params.structured_outputs
        assert (so.reasoning, so.reasoning_open) == expected, (tail, so)
    # What LLM.chat sends the engine is the processor's: with the tags, then covering the reasoning too.
    monkeypatch.setattr(output_processor, "has_reasoning_tokens", lambda tokenizer, parser: True)
    seen = []
    add = llm.engine.add_request
    monkeypatch.setattr(
        llm.engine, "add_request", lambda rid, ids, p, *images: seen.append(p.structured_outputs) or add(rid, ids, p)
    )
    llm.chat(messages, params, use_tqdm=False, reasoning_parser="qwen3")
    assert seen[-1].reasoning == ("<think>", "</think>")
    covering = replace(params, structured_outputs=SO(regex="[0-9]{4}", enable_in_reasoning=True))
    llm.chat(messages, covering, use_tqdm=False, reasoning_parser="qwen3")
    assert seen[-1].reasoning is None


def test_reasoning_parser_splits_the_think_block(llm):
    script = SO(choice=["<think>\nhmm, the sea\n</think>\n\nHello!"], enable_in_reasoning=True)  # the reasoning too
    forced = SamplingParams(temperature=0, max_tokens=40, structured_outputs=script)
    messages = [{"role": "user", "content": "Hi"}]
    out = llm.chat(messages, forced, use_tqdm=False, reasoning_parser="qwen3")[0]
    assert (out.reasoning_content, out.text) == ("\nhmm, the sea\n", "Hello!")
    plain = llm.chat(messages, forced, use_tqdm=False)[0]
    assert plain.reasoning_content is None and plain.text.startswith("<think>")
    with pytest.raises(ValueError, match="reasoning_parser must be one of qwen3"):
        llm.chat(messages, forced, use_tqdm=False, reasoning_parser="deepseek")
