"""Every field of every request model is honoured or refused: the rule "a field that would change the
result is honoured or refused by name", walked field by field.

Each field of ``CompletionRequest``, ``ChatRequest``, ``ResponsesRequest``, ``MessagesRequest`` and
``EmbeddingRequest`` has an entry below (a new field without one fails ``test_every_field_has_a_check``):
a sampling field is proven on the server against the offline engine given the same ``SamplingParams``,
with a value chosen so that it changes the output (checked too, so a dropped field cannot pass); the
dialects' fields against the chat route given the same option; the rest by what they do; refused
fields by their 400 naming them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from helpers import API_KEY, serve_http

from nanostream import LLM, SamplingParams
from nanostream.frontends.openai_server import create_app
from nanostream.frontends.openai_server.chat_protocol import ChatRequest
from nanostream.frontends.openai_server.embeddings import EmbeddingRequest
from nanostream.frontends.openai_server.messages_protocol import UNSUPPORTED as MESSAGES_UNSUPPORTED
from nanostream.frontends.openai_server.messages_protocol import MessagesRequest
from nanostream.frontends.openai_server.protocol import CompletionRequest
from nanostream.frontends.openai_server.responses_protocol import UNSUPPORTED as RESPONSES_UNSUPPORTED
from nanostream.frontends.openai_server.responses_protocol import ResponsesRequest
from nanostream.frontends.openai_server.unsupported import UNSUPPORTED

pytestmark = pytest.mark.slow

ENGINE_OPTIONS = dict(kvcache_block_size=16, device="cpu")
PROMPT = [5, 6, 7, 8]
GREEDY = {"temperature": 0, "max_tokens": 8}
SAMPLED = {"temperature": 1.0, "seed": 7, "max_tokens": 8}
USER = [{"role": "user", "content": "Tell me a story"}]


@pytest.fixture(scope="module")
def url(engine) -> Iterator[str]:
    base, stop = serve_http(create_app(engine, api_key=API_KEY))
    yield base
    stop()


@pytest.fixture(scope="module")
def llm(qwen3_dir) -> LLM:
    return LLM(str(qwen3_dir), **ENGINE_OPTIONS)


def post(http, path: str, body: dict) -> dict:
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def completion(http, model, **body) -> dict:
    return post(http, "/v1/completions", {"model": model, "prompt": PROMPT, "return_token_ids": True, **body})


def offline(llm, **params) -> list[int]:
    return llm.generate([PROMPT], SamplingParams(**params), use_tqdm=False)[0].token_ids


# ---- sampling fields: the server's tokens are the offline engine's with the field, not without it ----------


def eos(llm) -> int:
    return llm.tokenizer.convert_tokens_to_ids("<|endoftext|>")


def sampling_cases(llm) -> dict[str, tuple[dict, dict]]:
    """field -> (the base parameters, the field's value and any it needs): each changes the output."""
    first = offline(llm, **GREEDY)[0]
    to_eos = {"logit_bias": {eos(llm): 100.0}}  # EOS first: what min_tokens and ignore_eos change
    pushed = {"logit_bias": {first: 2.0}}  # the first token again and again, unless penalised
    return {
        "temperature": ({**GREEDY, "seed": 7}, {"temperature": 1.0}),
        "seed": (SAMPLED, {"seed": 8}),
        "top_p": (SAMPLED, {"top_p": 1e-6}),
        "top_k": (SAMPLED, {"top_k": 1}),
        "min_p": (SAMPLED, {"min_p": 1.0}),
        "max_tokens": (GREEDY, {"max_tokens": 3}),
        "min_tokens": ({**GREEDY, **to_eos}, {"min_tokens": 4}),
        "ignore_eos": ({**GREEDY, **to_eos}, {"ignore_eos": True}),
        "stop_token_ids": (GREEDY, {"stop_token_ids": [offline(llm, **GREEDY)[2]]}),
        "logit_bias": (GREEDY, pushed),
        "presence_penalty": ({**GREEDY, **pushed}, {"presence_penalty": 2.0}),
        "frequency_penalty": ({**GREEDY, **pushed}, {"frequency_penalty": 2.0}),
        "repetition_penalty": ({**GREEDY, **pushed}, {"repetition_penalty": 2.0}),
        "n": (SAMPLED, {"n": 2}),  # (sample 0 equals n = 1; sample 1 is seed + 1's)
    }


@pytest.mark.parametrize(
    "field",
    [
        "temperature",
        "seed",
        "top_p",
        "top_k",
        "min_p",
        "max_tokens",
        "min_tokens",
        "ignore_eos",
        "stop_token_ids",
        "logit_bias",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "n",
    ],
)
def test_a_sampling_field_reaches_the_engine(http, model, llm, field):
    base, extra = sampling_cases(llm)[field]
    without, with_ = offline(llm, **base), offline(llm, **{**base, **extra})
    if field == "n":
        with_ = llm.generate([PROMPT], SamplingParams(**base, n=2), use_tqdm=False)[0].outputs[1].token_ids
    assert with_ != without, f"{extra} does not change this output: the check could not fail"
    wire = {k: ({str(t): b for t, b in v.items()} if k == "logit_bias" else v) for k, v in {**base, **extra}.items()}
    got = completion(http, model, **wire)
    assert got["choices"][-1]["token_ids"] == with_


def test_stop_skip_special_tokens_and_echo(http, model, llm):
    text = llm.generate([PROMPT], SamplingParams(**GREEDY), use_tqdm=False)[0].text
    cut = text[2:4]
    assert completion(http, model, **GREEDY, stop=[cut])["choices"][0]["text"] == text[: text.index(cut)]
    special = llm.tokenizer.convert_tokens_to_ids("<|im_start|>")
    forced = {**GREEDY, "logit_bias": {str(special): 100.0}, "max_tokens": 2}
    assert completion(http, model, **forced)["choices"][0]["text"] == ""
    assert completion(http, model, **forced, skip_special_tokens=False)["choices"][0]["text"] == "<|im_start|>" * 2
    echoed = completion(http, model, **GREEDY, echo=True)["choices"][0]["text"]
    assert echoed == llm.tokenizer.decode(PROMPT) + text


def test_return_token_ids_gives_the_prompts_and_each_choices_ids(http, model, llm):
    want = offline(llm, **GREEDY)
    got = completion(http, model, **GREEDY)["choices"][0]
    assert (got["prompt_token_ids"], got["token_ids"]) == (PROMPT, want)
    plain = post(http, "/v1/completions", {"model": model, "prompt": PROMPT, **GREEDY})["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain
    chat = post(http, "/v1/chat/completions", {"model": model, "messages": USER, **GREEDY, "return_token_ids": True})
    prompt = post(http, "/tokenize", {"model": model, "messages": USER})["tokens"]
    assert chat["prompt_token_ids"] == prompt and len(chat["choices"][0]["token_ids"]) == 8
    streamed = http.post(
        "/v1/completions", json={"model": model, "prompt": PROMPT, **GREEDY, "stream": True, "return_token_ids": True}
    )
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert events[0]["choices"][0]["prompt_token_ids"] == PROMPT
    assert [t for e in events for t in e["choices"][0]["token_ids"]] == want
    # chat, streamed: every id, also of the chunks a parser holds back (a tool call's start)
    reply = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {"model": model, "messages": USER, "tools": tools, "return_token_ids": True, **GREEDY, "max_tokens": 40}
    body["structured_outputs"] = {"choice": [reply]}
    reply_json = post(http, "/v1/chat/completions", body)
    whole = reply_json["choices"][0]
    assert whole["message"]["tool_calls"] and len(whole["token_ids"]) > 5
    streamed = http.post("/v1/chat/completions", json={**body, "stream": True})
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert events[0]["prompt_token_ids"] == reply_json["prompt_token_ids"]
    assert [t for e in events for c in e["choices"] for t in c.get("token_ids") or []] == whole["token_ids"]


# ---- everything else, by what it does ----------------------------------------------------------------------

OTHER_CHECKS = {  # field -> the test (in this repository) that proves it is honoured
    "model": "test_openai_server.py (an unknown model is a 404 naming the served one)",
    "stream": "test_openai_server.py (streamed text equals the whole reply)",
    "stream_options": "test_openai_server.py (include_usage; test_openai_api.py: continuous_usage_stats)",
    "stop": "test_stop_skip_special_tokens_and_echo",
    "skip_special_tokens": "test_stop_skip_special_tokens_and_echo",
    "echo": "test_stop_skip_special_tokens_and_echo; test_openai_api.py (chat echo)",
    "return_token_ids": "test_return_token_ids_gives_the_prompts_and_each_choices_ids",
    "response_format": "test_openai_api.py::test_json_schema_output_validates_streamed_and_not",
    "structured_outputs": "test_openai_api.py (regex, choice, grammar)",
    "prompt_logprobs": "test_openai_server.py (prompt logprobs equal the engine's)",
    "logprobs": "test_openai_server.py (logprobs equal the engine's)",
    "top_logprobs": "test_openai_server.py",
    "truncate_prompt_tokens": "test_openai_api.py (truncate_prompt_tokens)",
    "prompt": "the input itself",
    "messages": "the input itself",
    "max_completion_tokens": "test_openai_server.py",
    "tools": "test_openai_api.py (tool calls)",
    "tool_choice": "test_openai_api.py (required, named, auto)",
    "parallel_tool_calls": "test_openai_api.py (one call with parallel_tool_calls false)",
    "chat_template_kwargs": "test_openai_api.py::test_enable_thinking_false_changes_the_prompt_as_the_template_does",
    "add_generation_prompt": "test_openai_api.py (continue_final_message, echo)",
    "continue_final_message": "test_openai_api.py (continue_final_message)",
    # the Responses API
    "input": "the input itself",
    "instructions": "test_dialect_fields_match_the_chat_route",
    "text": "test_responses_api.py::test_a_json_schema_validates",
    "reasoning": "test_dialect_fields_match_the_chat_route",
    "max_output_tokens": "test_responses_api.py::test_max_output_tokens_ends_incomplete",
    "metadata": "test_dialect_fields_match_the_chat_route (returned as given)",
    "store": "test_responses_api.py (store: false keeps nothing)",
    "previous_response_id": "test_responses_api.py (three turns)",
    "truncation": "test_dialect_fields_match_the_chat_route (auto refused)",
    "include": "test_responses_api.py::test_reasoning_items (reasoning.encrypted_content; any other refused)",
    # the Messages API
    "system": "test_dialect_fields_match_the_chat_route",
    "stop_sequences": "test_messages_api.py::test_max_tokens_and_stop_sequences",
    "thinking": "test_messages_api.py::test_thinking_blocks",
    "output_config": "test_messages_api.py::test_a_json_schema_output_validates (effort refused)",
    # /v1/embeddings
    "encoding_format": "test_embeddings.py::test_base64_and_dimensions",
    "dimensions": "test_embeddings.py::test_base64_and_dimensions (and refused where the model does not allow it)",
}
REFUSED = {"suffix": "x", "best_of": 2}  # fields of the models that take only their inert value


def test_every_field_has_a_check():
    sampling = {
        "temperature", "seed", "top_p", "top_k", "min_p", "max_tokens", "min_tokens", "ignore_eos",
        "stop_token_ids", "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty", "n",
    }  # fmt: skip
    models = [CompletionRequest, ChatRequest, ResponsesRequest, MessagesRequest, EmbeddingRequest]
    fields = {name for m in models for name in m.model_fields}
    unchecked = fields - sampling - set(OTHER_CHECKS) - set(REFUSED)
    assert not unchecked, f"fields with no check of being honoured or refused: {sorted(unchecked)}"


@pytest.mark.parametrize(("field", "value"), REFUSED.items())
def test_a_model_field_with_a_value_this_server_does_not_run_is_refused(http, model, field, value):
    r = http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 1, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


@pytest.mark.parametrize("field", sorted(UNSUPPORTED))
def test_an_unsupported_field_is_refused_by_name(http, model, field):
    value = "x" if field != "prompt_logprobs_temperature" else 0.5
    r = http.post("/v1/chat/completions", json={"model": model, "messages": USER, "max_tokens": 1, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


@pytest.mark.parametrize(
    ("path", "field", "body"),
    [("/v1/responses", f, {"input": "Hi", "max_output_tokens": 1}) for f in sorted(RESPONSES_UNSUPPORTED)]
    + [("/v1/messages", f, {"messages": USER, "max_tokens": 1}) for f in sorted(MESSAGES_UNSUPPORTED)],
)
def test_the_dialects_refuse_what_they_do_not_run_by_name(http, model, path, field, body):
    r = http.post(path, json={"model": model, **body, field: [{"x": 1}] if field != "background" else True})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert field in error["message"] and error.get("param", field) == field, error


def test_prompt_logprobs_temperature_is_refused_even_as_a_string(http, model):
    r = http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "prompt_logprobs_temperature": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs_temperature", r.text


def test_dialect_fields_match_the_chat_route(http, model):
    """The dialects' options give what the chat route gives with the same option (proven against the engine
    above), and differ from what they give without it."""

    def chat(**body) -> dict:
        return post(http, "/v1/chat/completions", {"model": model, **GREEDY, **body})

    def text(**body) -> str:
        return chat(**body)["choices"][0]["message"]["content"]

    def responses(**body) -> dict:
        return post(http, "/v1/responses", {"model": model, "max_output_tokens": 8, **body})

    def output_text(**body) -> str:
        return responses(**body)["output"][-1]["content"][0]["text"]

    plain, briefed = text(messages=USER), text(messages=[{"role": "system", "content": "Be brief."}, *USER])
    assert plain != briefed
    assert output_text(input=USER, temperature=0, instructions="Be brief.") == briefed
    brief = {"model": model, "max_tokens": 8, "messages": USER, "system": "Be brief.", "temperature": 0}
    assert post(http, "/v1/messages", brief)["content"][-1]["text"] == briefed
    for options in ({"temperature": 1.0, "top_p": 0.9, "seed": 3}, {"temperature": 1.0, "top_k": 2, "seed": 3}):
        sampled = text(messages=USER, **options)
        assert sampled != plain and output_text(input=USER, **options) == sampled
    off = chat(messages=USER, chat_template_kwargs={"enable_thinking": False}, max_tokens=1)["usage"]
    got = responses(input=USER, reasoning={"effort": "none"}, max_output_tokens=1)["usage"]["input_tokens"]
    assert got == off["prompt_tokens"] != chat(messages=USER, max_tokens=1)["usage"]["prompt_tokens"]
    assert responses(input="Hi", metadata={"k": "v"}, max_output_tokens=1)["metadata"] == {"k": "v"}
    r = http.post("/v1/responses", json={"model": model, "input": "Hi", "truncation": "auto"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncation", r.text
