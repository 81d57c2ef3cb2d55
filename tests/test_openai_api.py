"""What apps and agents use beyond plain chat, over real HTTP with the official ``openai`` client, a real
engine process and a tiny random model (a "scripted" reply is forced with structured outputs): JSON that
validates, regex and choices, tool calls (required, named, auto; streamed deltas equal the whole reply),
tool histories rendered as the template renders them, n samples, template options, reasoning, the
tokenizer routes, the fields this server refuses, vLLM's extensions (continuous usage stats, echo with
continue_final_message, truncate_prompt_tokens) and every field of the openai package's response models in the
raw replies."""

from __future__ import annotations

import json
import re
import typing
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from helpers import API_KEY, engine_processes, run_in_thread, serve_http
from openai.types import Completion, CompletionChoice
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import BaseModel, Field

from nanostream import LLM, AsyncClient, SamplingParams
from nanostream.frontends.openai_server import create_app

pytestmark = pytest.mark.slow

ENGINE_OPTIONS = dict(kvcache_block_size=16, device="cpu")
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
    },
    "required": ["name", "age", "pets"],
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def engine(qwen3_dir) -> Iterator[str]:
    with engine_processes(str(qwen3_dir), {"main": ENGINE_OPTIONS}) as started:
        yield started["main"].address


@pytest.fixture(scope="module")
def url(engine) -> Iterator[str]:
    base, stop = serve_http(create_app(engine, api_key=API_KEY))
    yield base
    stop()


@pytest.fixture(scope="module")
def reasoning_api(engine) -> Iterator:
    """A second server on the engine, with the qwen3 reasoning parser."""
    import openai

    base, stop = serve_http(create_app(engine, api_key=API_KEY, reasoning_parser="qwen3"))
    yield openai.OpenAI(base_url=base + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    stop()


@pytest.fixture(scope="module")
def llm(qwen3_dir) -> LLM:
    return LLM(str(qwen3_dir), **ENGINE_OPTIONS)


def streamed_content(stream) -> tuple[str, str | None]:
    text, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(text), finish


def forced(text: str) -> dict:
    """extra_body that makes the tiny model write exactly ``text`` (a scripted reply), reasoning included."""
    return {"structured_outputs": {"choice": [text], "enable_in_reasoning": True}}


def assert_400(response: httpx.Response, param: str | None, *fragments: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    for fragment in fragments:
        assert fragment in error["message"], error


# ---- structured outputs ---------------------------------------------------------------------------


def test_json_schema_output_validates_streamed_and_not(api, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    args = dict(model=model, messages=USER, response_format=fmt, max_tokens=120, temperature=0)
    whole = api.chat.completions.create(**args)
    jsonschema.validate(json.loads(whole.choices[0].message.content), PERSON)
    assert whole.choices[0].finish_reason == "stop"
    text, finish = streamed_content(api.chat.completions.create(**args, stream=True))
    assert (text, finish) == (whole.choices[0].message.content, "stop")
    sampled = api.chat.completions.create(**{**args, "temperature": 1.0, "seed": 4, "n": 3})
    for choice in sampled.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    obj = api.chat.completions.create(**{**args, "response_format": {"type": "json_object"}, "max_tokens": 400})
    assert obj.choices[0].message.content.startswith("{")


def test_the_clients_parse_helper_gets_a_parsed_object(api, model):
    class Person(BaseModel):
        name: str = Field(max_length=12)
        age: int = Field(ge=0, le=150)

    out = api.chat.completions.parse(model=model, messages=USER, response_format=Person, max_tokens=100, temperature=0)
    assert isinstance(out.choices[0].message.parsed, Person)


def test_regex_choice_and_grammar_outputs_match(api, model):
    def complete(so: dict, **kw) -> list[str]:
        out = api.completions.create(
            model=model, prompt="Once upon a time", max_tokens=40, extra_body={"structured_outputs": so}, **kw
        )
        return [c.text for c in out.choices]

    for text in complete({"regex": r"[a-z]{3}-\d{3}"}, temperature=1.0, seed=1, n=3):
        assert re.fullmatch(r"[a-z]{3}-\d{3}", text)
    assert set(complete({"choice": ["red", "green", "blue"]}, temperature=1.0, seed=2, n=4)) <= {"red", "green", "blue"}
    assert re.fullmatch(r"(ab)+", complete({"grammar": 'root ::= "ab" root | "ab"'}, temperature=0)[0])


def test_constrained_and_free_requests_in_one_batch(api, llm, model):
    """Free requests running beside constrained ones return exactly the offline engine's greedy text."""
    prompts = ["Once upon a time", "The river ran past", "Seven small boats", "A stream can end"]
    refs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)

    def free(prompt: str) -> str:
        extra = {"ignore_eos": True}
        return (
            api.completions.create(model=model, prompt=prompt, max_tokens=32, temperature=0, extra_body=extra)
            .choices[0]
            .text
        )

    def constrained(prompt: str) -> str:
        extra = {"structured_outputs": {"json": PERSON}}
        return (
            api.completions.create(model=model, prompt=prompt, max_tokens=120, temperature=0, extra_body=extra)
            .choices[0]
            .text
        )

    with ThreadPoolExecutor(8) as pool:
        frees = [pool.submit(free, p) for p in prompts]
        jsons = [pool.submit(constrained, p) for p in prompts]
        assert [f.result() for f in frees] == [r.text for r in refs]
        for f in jsons:
            jsonschema.validate(json.loads(f.result()), PERSON)


def test_an_invalid_schema_or_grammar_is_a_400(http, model):
    base = {"model": model, "messages": USER, "max_tokens": 8}
    cases = [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
            "structured_outputs",
            "not a valid JSON schema",
        ),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "not a valid regular expression"),
        ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs", "not a valid EBNF grammar"),
        ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs", "exactly one of"),
        ({"structured_outputs": {"pattern": "a"}}, "structured_outputs", "no field 'pattern'"),
        (
            {"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}},
            "structured_outputs",
            "give only one",
        ),
    ]
    for extra, param, fragment in cases:
        for stream in (False, True):
            assert_400(http.post("/v1/chat/completions", json={**base, **extra, "stream": stream}), param, fragment)


# ---- tools --------------------------------------------------------------------------------------


def calls_of(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def test_required_and_named_tool_choice_give_calls_that_validate(api, model):
    # (A random model may go on calling tools in parallel until max_tokens; the grammar of parallel calls is
    # checked in test_tool_parsers.py.)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        args = dict(
            model=model,
            messages=USER,
            tools=TOOLS,
            tool_choice=choice,
            parallel_tool_calls=False,
            max_tokens=200,
            temperature=0,
        )
        whole = api.chat.completions.create(**args)
        message, finish = whole.choices[0].message, whole.choices[0].finish_reason
        assert message.tool_calls and finish == "tool_calls" and message.content is None
        for call in message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
            jsonschema.validate(json.loads(call.function.arguments), schema)
        assert len(message.tool_calls) == 1
        if choice != "required":
            assert message.tool_calls[0].function.name == "get_weather"
        with api.chat.completions.stream(**args) as stream:  # the client's helper assembles the deltas
            final = stream.get_final_completion()
        assert calls_of(final.choices[0].message) == calls_of(message)
        assert final.choices[0].finish_reason == "tool_calls"


def test_a_forced_call_goes_before_a_response_format_and_a_bad_format_is_still_refused(api, model):
    # An agent framework sends its output type as response_format on every turn, tool_choice "required" on the
    # first: OpenAI's API takes both, and the reply is the call.
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"enum": ["sunny", "rainy"]}}}
    args = dict(model=model, messages=USER, tools=TOOLS, parallel_tool_calls=False, max_tokens=200, temperature=0)
    whole = api.chat.completions.create(**args, tool_choice="required", response_format=fmt)
    assert whole.choices[0].finish_reason == "tool_calls" and len(whole.choices[0].message.tool_calls) == 1
    answer = api.chat.completions.create(**args, tool_choice="none", response_format=fmt)
    assert json.loads(answer.choices[0].message.content) in ("sunny", "rainy")
    broken = {"type": "json_schema"}  # (no json_schema)
    with pytest.raises(openai.BadRequestError, match="needs its json_schema"):
        api.chat.completions.create(**args, tool_choice="required", response_format=broken)


def test_a_scripted_tool_call_under_auto_is_parsed_streamed_and_not(api, http, model):
    reply = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
    )
    args = dict(model=model, messages=USER, tools=TOOLS, max_tokens=120, temperature=0)
    raw = {**args, **forced(reply)}  # read raw: every field of the openai models checked there
    whole = ChatCompletion.model_validate(checked_reply(http, "/v1/chat/completions", raw))
    message = whole.choices[0].message
    assert message.content == "Let me check.\n"
    assert calls_of(message) == [("get_weather", '{"city": "Paris", "unit": "C"}')]
    assert whole.choices[0].finish_reason == "tool_calls"
    chunks = [ChatCompletionChunk.model_validate(e) for e in checked_events(http, "/v1/chat/completions", raw)]
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and all(d.index == 0 for d in deltas)
    assert len(deltas) > 1 and all(d.type == "function" for d in deltas)  # (the client's helper reads each one's)
    assert "".join(d.function.arguments or "" for d in deltas) == message.tool_calls[0].function.arguments
    none = api.chat.completions.create(**args, tool_choice="none", extra_body=forced(reply))
    assert none.choices[0].message.content == reply and not none.choices[0].message.tool_calls


def test_a_tool_history_renders_as_the_template_renders_it(api, http, llm, model):
    history = [
        {"role": "system", "content": "You help with weather."},
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'},
                },
                {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
    ]
    text = llm.tokenizer.apply_chat_template(history, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    expected = len(llm.tokenizer(text, add_special_tokens=False).input_ids)
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text and '"arguments": {"city": "Paris"' in text
    out = api.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=2)
    assert out.usage.prompt_tokens == expected
    counted = http.post("/tokenize", json={"messages": history, "tools": TOOLS}).json()
    assert counted["count"] == expected


def test_langchain_runs_its_tool_and_structured_output_paths(url, model):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str = Field(max_length=16), unit: str = Field(pattern="^[CF]$")) -> str:
        """The weather in a city."""
        return f"18 {unit} in {city}"

    chat = ChatOpenAI(base_url=url + "/v1", api_key=API_KEY, model=model, temperature=0, max_tokens=150, max_retries=0)
    question = [HumanMessage("Weather in Paris?")]
    ai = chat.bind_tools([get_weather], tool_choice="required").invoke(question)
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "get_weather"
    result = get_weather.invoke(ai.tool_calls[0])  # runs the tool on the model's arguments
    assert isinstance(result, ToolMessage)
    second = chat.bind_tools([get_weather]).invoke([*question, ai, result])  # the agent loop's second turn
    assert second.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")

    class Person(BaseModel):
        name: str = Field(max_length=12)
        age: int = Field(ge=0, le=150)

    out = chat.with_structured_output(Person, include_raw=True).invoke("Describe someone.")
    assert isinstance(out["parsed"], Person) and out["parsing_error"] is None


# ---- n, template options, reasoning -----------------------------------------------------------


def test_n_samples_reproducible_by_seed_sharing_the_prompt(api, engine, model):
    prompt = "The engine keeps a pool of key and value blocks. Each request owns a table of blocks, and every step"
    args = dict(model=model, prompt=prompt, max_tokens=12, temperature=1.0, extra_body={"ignore_eos": True})

    async def hits() -> int:
        async with AsyncClient(engine) as client:
            return (await client.stats()).engine.prefix_cache_hits

    before = run_in_thread(hits)
    three = api.completions.create(**args, n=3, seed=7)
    shared = run_in_thread(hits) - before
    assert [c.index for c in three.choices] == [0, 1, 2]
    for i, choice in enumerate(three.choices):
        assert choice.text == api.completions.create(**args, seed=7 + i).choices[0].text
    one = api.completions.create(**args, seed=7)
    assert three.usage.prompt_tokens == one.usage.prompt_tokens and three.usage.completion_tokens == 36
    full_blocks = (one.usage.prompt_tokens - 1) // 16
    assert shared >= 2 * full_blocks * 16 > 0, "samples 1 and 2 reuse the prompt's full blocks"
    streamed: dict[int, str] = {}
    for chunk in api.completions.create(**args, n=3, seed=7, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {c.index: c.text for c in three.choices}


def test_enable_thinking_false_changes_the_prompt_as_the_template_does(api, llm, model):
    def prompt_tokens(**kwargs) -> int:
        text = llm.tokenizer.apply_chat_template(USER, tokenize=False, add_generation_prompt=True, **kwargs)
        return len(llm.tokenizer(text, add_special_tokens=False).input_ids)

    off = api.chat.completions.create(
        model=model, messages=USER, max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    on = api.chat.completions.create(model=model, messages=USER, max_tokens=1)
    assert off.usage.prompt_tokens == prompt_tokens(enable_thinking=False) > on.usage.prompt_tokens == prompt_tokens()


def test_the_think_block_is_reasoning_content_streamed_and_not(reasoning_api, model):
    reply = "<think>\nThe user wants weather.\n</think>\n\nIt is sunny."
    args = dict(model=model, messages=USER, max_tokens=80, temperature=0, extra_body=forced(reply))
    message = reasoning_api.chat.completions.create(**args).choices[0].message
    assert (message.reasoning_content, message.content) == ("\nThe user wants weather.\n", "It is sunny.")
    reasoning, content = [], []
    for chunk in reasoning_api.chat.completions.create(**args, stream=True):
        delta = chunk.choices[0].delta
        reasoning.append(getattr(delta, "reasoning_content", None) or "")
        content.append(delta.content or "")
    assert ("".join(reasoning), "".join(content)) == (message.reasoning_content, message.content)


def test_with_a_reasoning_parser_a_json_answer_still_validates(reasoning_api, llm, model):
    """The parser lets the model reason before its constrained answer (tests/test_llm_options.py scripts
    that); kept from opening a block, the tiny model answers at once, and the answer validates."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    no_block = {str(llm.tokenizer.encode("<think>", add_special_tokens=False)[0]): -100}  # the start tag's first
    args = dict(model=model, messages=USER, response_format=fmt, max_tokens=120, temperature=0, logit_bias=no_block)
    message = reasoning_api.chat.completions.create(**args).choices[0].message
    jsonschema.validate(json.loads(message.content), PERSON)
    assert message.reasoning_content is None


# ---- the rest of the request surface ---------------------------------------------------------


def test_prompt_lists_echo_and_logprobs(api, llm, model):
    prompts = ["Once upon a time", "The river"]
    out = api.completions.create(model=model, prompt=prompts, n=2, max_tokens=4, temperature=0, echo=True, logprobs=1)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for c in out.choices:
        assert c.text.startswith(prompts[c.index // 2])
        lp = c.logprobs
        ids = llm.tokenizer(prompts[c.index // 2]).input_ids
        assert lp.token_logprobs[0] is None and len(lp.tokens) == len(ids) + 4
        assert lp.text_offset[len(ids)] == len(prompts[c.index // 2])
    assert out.usage.prompt_tokens == sum(len(llm.tokenizer(p).input_ids) for p in prompts)
    extra = {"prompt_logprobs": 1}
    with_prompt = api.completions.create(model=model, prompt=prompts[0], max_tokens=1, extra_body=extra)
    plps = with_prompt.choices[0].model_extra["prompt_logprobs"]
    assert plps[0] is None and len(plps) == len(llm.tokenizer(prompts[0]).input_ids)


def test_logit_bias_applies_and_is_checked(api, http, model):
    token = 300
    out = api.completions.create(
        model=model,
        prompt="Once",
        max_tokens=3,
        temperature=0,
        logit_bias={str(token): 100},
        extra_body={"ignore_eos": True},
    )
    assert out.usage.completion_tokens == 3
    ids = http.post("/tokenize", json={"prompt": out.choices[0].text, "add_special_tokens": False}).json()["tokens"]
    assert ids == [token] * 3
    assert_400(
        http.post("/v1/completions", json={"prompt": "a", "logit_bias": {"10000000": 1}}),
        "logit_bias",
        "outside the vocabulary",
    )
    assert_400(http.post("/v1/completions", json={"prompt": "a", "logit_bias": {"x": 1}}), "logit_bias", "token ids")


def test_tokenize_and_detokenize_round_trip(http, llm):
    text = "The keeper read the sand as answers."
    got = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert got["tokens"] == llm.tokenizer(text).input_ids and got["count"] == len(got["tokens"])
    assert got["token_strs"] == llm.tokenizer.convert_ids_to_tokens(got["tokens"]) and got["max_model_len"] > 0
    assert http.post("/detokenize", json={"tokens": got["tokens"]}).json() == {"prompt": text}
    assert_400(http.post("/detokenize", json={"tokens": [1, 10**7]}), "tokens", "tokens[1]")
    assert http.get("/version").json()["version"]


def test_fields_this_server_does_not_implement_are_a_400_naming_them(http, model):
    base = {"model": model, "messages": USER, "max_tokens": 4}
    cases = [
        ({"functions": [{"name": "f"}]}, "functions", "use tools"),
        ({"reasoning_effort": "high"}, "reasoning_effort", "not supported"),
        ({"guided_json": {"type": "object"}}, "guided_json", "structured_outputs"),
        ({"modalities": ["text", "audio"]}, "modalities", "text only"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed with stream"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not among the tools",
        ),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "may not set tools"),
    ]
    for extra, param, fragment in cases:
        assert_400(http.post("/v1/chat/completions", json={**base, **extra}), param, fragment)
    assert_400(http.post("/v1/completions", json={"prompt": "a", "suffix": "b"}), "suffix", "not supported")


def test_the_async_client_has_the_same_options(engine):
    """n samples, a grammar and a reasoning parser straight from AsyncClient (what the frontend builds on)."""

    async def main() -> None:
        async with AsyncClient(engine) as client:
            out = await client.generate("Once upon a time", n=2, seed=3, temperature=1.0, max_tokens=8, ignore_eos=True)
            assert [o.index for o in out.outputs] == [0, 1] and out.text == out.outputs[0].text
            assert out.usage.completion_tokens == 16 and out.outputs[0].text != out.outputs[1].text
            person = await client.generate("Hi", structured_outputs={"json": PERSON}, max_tokens=120, temperature=0)
            jsonschema.validate(json.loads(person.text), PERSON)
            reply = {"choice": ["<think>\nhmm\n</think>\n\nHello."], "enable_in_reasoning": True}
            chunks = [
                c async for c in client.chat(USER, reasoning_parser="qwen3", structured_outputs=reply, max_tokens=40)
            ]
            assert "".join(c.reasoning_content for c in chunks) == "\nhmm\n"
            assert "".join(c.text for c in chunks) == "Hello."

    run_in_thread(main)


# ---- vLLM's extensions, and every field of OpenAI's response models --------------------------------

PREFILL = [*USER, {"role": "assistant", "content": "In Paris it is"}]
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}


def sse_events(http: httpx.Client, path: str, body: dict) -> list[dict]:
    """The decoded ``data:`` events of a streamed reply, read raw (the openai client hides null from missing)."""
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        lines = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_continuous_usage_stats_put_usage_on_every_chunk(api, model):
    both = {"include_usage": True, "continuous_usage_stats": True}
    args = dict(model=model, n=2, max_tokens=5, temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    prompts = ["Once upon a time", "The river ran"]
    for chunks in (
        list(api.completions.create(prompt=prompts, stream=True, stream_options=both, **args)),
        list(api.chat.completions.create(messages=USER, stream=True, stream_options=both, **args)),
    ):
        *events, last = chunks
        so_far: dict[int, int] = {}
        for chunk in events:  # each chunk's usage: its choice's prompt and tokens so far
            (choice,) = chunk.choices
            usage, before = chunk.usage, so_far.get(choice.index, 0)
            assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens and usage.prompt_tokens > 0
            assert usage.completion_tokens >= before
            so_far[choice.index] = usage.completion_tokens
        assert so_far == {i: 5 for i in range(len(so_far))} and len(so_far) in (2, 4)
        assert last.choices == [] and last.usage.completion_tokens == 5 * len(so_far)
        assert last.usage.prompt_tokens == sum(
            {c.choices[0].index // 2: c.usage.prompt_tokens for c in events}.values()
        )
    roles = [c for c in chunks[:-1] if c.choices[0].delta.role == "assistant"]  # the chat's role chunks: no token yet
    assert [c.usage.completion_tokens for c in roles] == [0, 0]
    # vLLM's rule: continuous usage only with include_usage; include_usage alone keeps its one usage chunk
    alone = list(
        api.completions.create(prompt=prompts[0], stream=True, stream_options={"continuous_usage_stats": True}, **args)
    )
    assert all(c.usage is None for c in alone)
    final = list(api.completions.create(prompt=prompts[0], stream=True, stream_options={"include_usage": True}, **args))
    assert all(c.usage is None for c in final[:-1]) and final[-1].usage.completion_tokens == 10


def test_continue_final_message_leaves_it_open_and_echo_repeats_it(api, http, llm, model):
    text = llm.tokenizer.apply_chat_template(PREFILL, tokenize=False, continue_final_message=True)
    assert text.endswith("In Paris it is")  # open: no end of turn after the prefilled words
    expected = llm.tokenizer(text, add_special_tokens=False).input_ids
    assert http.post("/tokenize", json={"messages": PREFILL, **CONTINUE}).json()["tokens"] == expected
    args = dict(model=model, messages=PREFILL, max_tokens=6, temperature=0, extra_body=CONTINUE)
    plain = api.chat.completions.create(**args)
    assert plain.usage.prompt_tokens == len(expected)
    offline = llm.generate([expected], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].text
    assert plain.choices[0].message.content == offline
    echo = {**CONTINUE, "echo": True}
    whole = api.chat.completions.create(**{**args, "extra_body": echo})
    assert whole.choices[0].message.content == "In Paris it is" + offline
    chunks = list(api.chat.completions.create(**{**args, "extra_body": echo, "n": 2}, stream=True))
    assert [(c.choices[0].index, c.choices[0].delta.content) for c in chunks[2:4]] == [
        (0, "In Paris it is"),
        (1, "In Paris it is"),
    ]
    for i in (0, 1):
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i)
        assert streamed == whole.choices[0].message.content
    # the final message is the user's: a new assistant message, nothing echoed
    new = dict(model=model, messages=USER, max_tokens=4, temperature=0)
    assert api.chat.completions.create(**new, extra_body={"echo": True}).choices[0].message.content == (
        api.chat.completions.create(**new).choices[0].message.content
    )


def test_continue_final_message_errors_say_what_to_change(http, model):
    body = {"model": model, "messages": PREFILL, "max_tokens": 2, "continue_final_message": True}
    assert_400(http.post("/v1/chat/completions", json=body), "continue_final_message", "add_generation_prompt to false")
    tokenize = {"messages": PREFILL, "continue_final_message": True}
    assert_400(http.post("/tokenize", json=tokenize), "continue_final_message", "add_generation_prompt to false")
    assert_400(http.post("/tokenize", json={"prompt": "a", **CONTINUE}), "continue_final_message", "with messages")
    assert_400(
        http.post("/v1/completions", json={"prompt": "a", "continue_final_message": True}),
        "continue_final_message",
        "/v1/chat/completions",
    )


def test_truncate_prompt_tokens_keeps_the_last_tokens(api, http, llm, model):
    prompt = "The engine keeps a pool of key and value blocks, and every request owns a table of them."
    ids = llm.tokenizer(prompt).input_ids
    args = dict(model=model, max_tokens=4, temperature=0)
    cut = api.completions.create(prompt=prompt, echo=True, extra_body={"truncate_prompt_tokens": 6}, **args)
    last6 = api.completions.create(prompt=ids[-6:], echo=True, **args)
    assert cut.usage.prompt_tokens == 6 and cut.choices[0].text == last6.choices[0].text
    assert cut.choices[0].text.startswith(llm.tokenizer.decode(ids[-6:]))  # echo: the prompt the model saw
    whole = api.completions.create(prompt=prompt, extra_body={"truncate_prompt_tokens": -1}, **args)
    assert whole.usage.prompt_tokens == len(ids)
    chat = api.chat.completions.create(messages=USER, extra_body={"truncate_prompt_tokens": 5}, **args)
    assert chat.usage.prompt_tokens == 5
    max_model_len = http.get("/v1/models").json()["data"][0]["max_model_len"]
    for keep, fragment in ((0, ">= 1"), (-2, ">= 1"), (max_model_len - 3, f"= {max_model_len - 4}")):
        for path, body in (("/v1/completions", {"prompt": prompt}), ("/v1/chat/completions", {"messages": USER})):
            reply = http.post(path, json={**body, "max_tokens": 4, "truncate_prompt_tokens": keep})
            assert_400(reply, "truncate_prompt_tokens", fragment)


def _models_in(annotation: object) -> list[type[BaseModel]]:
    """The pydantic models a field's annotation may hold (through Optional, List, Annotated, unions)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def missing_fields(value: dict, model: type[BaseModel], where: str = "") -> list[str]:
    """Every field of ``model`` (and of the models nested in it that ``value`` fills) absent from ``value``."""
    extra = {CompletionChoice: ["prompt_logprobs"], ChatCompletion: ["prompt_logprobs"]}.get(model, [])  # vLLM's
    fields = {f.alias or name: f for name, f in model.model_fields.items()}
    out = [f"{where}.{name}" for name in [*fields, *extra] if name not in value]
    for name, f in fields.items():
        kinds, got = _models_in(f.annotation), value.get(name)  # no kinds: plain values (a dict of top logprobs)
        for i, item in enumerate(got) if isinstance(got, list) else [(None, got)]:
            if kinds and isinstance(item, dict):
                at = f"{where}.{name}" + ("" if i is None else f"[{i}]")
                out += missing_fields(item, kinds[0] if len(kinds) == 1 else _of_type(kinds, item.get("type")), at)
    return out


def _of_type(kinds: list[type[BaseModel]], type_: str) -> type[BaseModel]:
    """The one of a union of models (tool calls: function or custom) whose ``type`` is ``type_``."""
    (kind,) = [k for k in kinds if type_ in typing.get_args(k.model_fields["type"].annotation)]
    return kind


def checked_reply(http: httpx.Client, path: str, body: dict) -> dict:
    """A whole reply, read raw: every field of the openai package's model is in it (null where the reply has
    nothing), and a chat reply validates as one."""
    reply = http.post(path, json=body)
    assert reply.status_code == 200, reply.text
    chat = path == "/v1/chat/completions"
    assert missing_fields(reply.json(), ChatCompletion if chat else Completion) == [], body
    return ChatCompletion.model_validate(reply.json()).model_dump() if chat else reply.json()


def checked_events(http: httpx.Client, path: str, body: dict) -> list[dict]:
    """The streamed events, each checked as checked_reply checks a reply."""
    chat = path == "/v1/chat/completions"
    events = sse_events(http, path, body)
    for event in events:
        assert missing_fields(event, ChatCompletionChunk if chat else Completion) == [], (body, event)
        if chat:  # (completions validate less strictly than OpenAI sends them: an echoed prompt's first token
            ChatCompletionChunk.model_validate(event)  # has a null logprob, a streamed choice a null finish_reason)
    return events


def test_every_field_of_the_openai_response_models_is_in_the_replies(http, model):
    """Raw JSON, whole and streamed (usage on every chunk or none), both endpoints, with n > 1, logprobs,
    echo and prompt logprobs (tools: test_a_scripted_tool_call_under_auto_is_parsed_streamed_and_not)."""
    usage = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chats = [
        {"messages": USER, "max_tokens": 4},
        {"messages": USER, "max_tokens": 4, "n": 2, "logprobs": True, "top_logprobs": 2, "temperature": 1.0},
        {"messages": PREFILL, "max_tokens": 3, "echo": True, **CONTINUE},
    ]
    completions = [
        {"prompt": "Once upon a time", "max_tokens": 4},
        {"prompt": ["Once", "The river"], "n": 2, "max_tokens": 3, "logprobs": 2, "echo": True},
        {"prompt": "Once upon a time", "max_tokens": 2, "prompt_logprobs": 1},
    ]
    for path, bodies in (("/v1/chat/completions", chats), ("/v1/completions", completions)):
        for body in bodies:
            checked_reply(http, path, {"model": model, **body})
            assert all(e["usage"] is None for e in checked_events(http, path, {"model": model, **body}))
            assert all(e["usage"] for e in checked_events(http, path, {"model": model, **body, **usage}))
    absent = missing_fields({"choices": [{"logprobs": {}}]}, Completion)  # the check itself finds them
    assert {".usage", ".choices[0].prompt_logprobs", ".choices[0].logprobs.tokens"} <= set(absent)
