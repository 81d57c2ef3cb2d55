"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) over real HTTP with the
official ``anthropic`` client, a real engine process and a tiny random model (a scripted reply is
forced with structured outputs): text whole and streamed (the event order, the accumulated message),
stop sequences, a tool round trip, thinking blocks, token counts, and errors in Anthropic's shape."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import jsonschema
import pytest
from helpers import API_KEY, forced, serve_http

from nanostream.frontends.openai_server import create_app

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
}
TOOL = {"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}


def scripted(text: str) -> dict:
    return forced(text, temperature=0)


@pytest.fixture(scope="module")
def url(engine) -> Iterator[str]:
    base, stop = serve_http(create_app(engine, api_key=API_KEY, reasoning_parser="qwen3"))
    yield base
    stop()


@pytest.fixture(scope="module")
def claude(url) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0, timeout=120)


def test_text_whole_and_streamed(claude, model):
    args = dict(model=model, max_tokens=30, messages=ASK, extra_body=scripted("It is sunny."))
    whole = claude.messages.create(**args)
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text == "It is sunny."
    assert (whole.stop_reason, whole.role, whole.type) == ("end_turn", "assistant", "message")
    assert whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0) > 0 and whole.usage.output_tokens > 0
    with claude.messages.stream(**args) as stream:
        events = [e.type for e in stream if e.type in ("message_start", "content_block_start", "content_block_stop")]
        final = stream.get_final_message()
    assert final.content[0].text == "It is sunny." and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert events == ["message_start", "content_block_start", "content_block_stop"]


def test_raw_event_order(http, model):
    body = dict(model=model, max_tokens=30, messages=ASK, stream=True, **scripted("Sunny."))
    with http.stream("POST", "/v1/messages", json=body) as r:
        names = [line.removeprefix("event: ") for line in r.iter_lines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "content_block_start"] and set(names[2:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_max_tokens_and_stop_sequences(claude, model):
    cut = claude.messages.create(model=model, max_tokens=3, messages=ASK)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    stopped = claude.messages.create(
        model=model,
        max_tokens=30,
        messages=ASK,
        stop_sequences=["sun"],
        extra_body=scripted("It is sunny."),
    )
    assert (stopped.content[0].text, stopped.stop_reason, stopped.stop_sequence) == ("It is ", "stop_sequence", "sun")


def test_a_tool_round_trip(claude, model):
    args = dict(model=model, max_tokens=200, messages=ASK, tools=[TOOL], extra_body={"temperature": 0})
    forced_tool = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    first = claude.messages.create(**args, tool_choice=forced_tool)
    use = next(b for b in first.content if b.type == "tool_use")
    assert first.stop_reason == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER)
    with claude.messages.stream(**args, tool_choice=forced_tool) as stream:
        streamed = stream.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(use.name, use.input)]
    result = {"type": "tool_result", "tool_use_id": use.id, "content": json.dumps({"temp": 21})}
    history = [*ASK, {"role": "assistant", "content": first.content}, {"role": "user", "content": [result]}]
    answer = claude.messages.create(**{**args, "messages": history, "extra_body": scripted("21 C in Paris.")})
    assert answer.content[0].text == "21 C in Paris."
    counted = claude.messages.count_tokens(model=model, messages=history, tools=[TOOL])
    assert counted.input_tokens == answer.usage.input_tokens + (answer.usage.cache_read_input_tokens or 0)


def test_a_json_schema_output_validates(claude, model):
    fmt = {"type": "json_schema", "schema": WEATHER}
    whole = claude.messages.create(
        model=model, max_tokens=200, messages=ASK, output_config={"format": fmt}, extra_body={"temperature": 0}
    )
    jsonschema.validate(json.loads(whole.content[0].text), WEATHER)


def test_thinking_blocks(claude, model):
    script = scripted("<think>\nA question.\n</think>\n\nSunny.")
    args = dict(model=model, max_tokens=2000, messages=ASK, thinking={"type": "enabled", "budget_tokens": 1024})
    whole = claude.messages.create(**args, extra_body=script)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in whole.content] == [
        ("thinking", "\nA question.\n"),
        ("text", "Sunny."),
    ]
    with claude.messages.stream(**args, extra_body=script) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "thinking_delta" in deltas and final.content[0].thinking == "\nA question.\n"
    off = claude.messages.count_tokens(model=model, messages=ASK, thinking={"type": "disabled"})
    on = claude.messages.count_tokens(model=model, messages=ASK, thinking={"type": "enabled", "budget_tokens": 1024})
    assert off.input_tokens != on.input_tokens  # the template's reasoning switch


def test_x_api_key_is_checked(url, model):
    wrong = anthropic.Anthropic(base_url=url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        wrong.messages.create(model=model, max_tokens=2, messages=ASK)
    assert err.value.body["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"messages": ASK}, "max_tokens"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": [IMAGE]}]}, "takes no images"),
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "base64 and url",
        ),
        ({"max_tokens": 5, "messages": [{"role": "assistant", "content": [IMAGE]}]}, "'image'"),
        ({"max_tokens": 5, "messages": ASK, "tools": [{"name": "f", "input_schema": "not a schema"}]}, "input_schema"),
        ({"max_tokens": 5, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "s"}]}, "built-in"),
        ({"max_tokens": 5, "messages": ASK, "mcp_servers": [{"url": "x"}]}, "mcp_servers"),
        ({"max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}, "role"),
    ],
)
def test_errors_in_anthropics_shape(http, model, body, fragment):
    r = http.post("/v1/messages", json={"model": model, **body})
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert fragment in error["error"]["message"], error


def test_an_unknown_model_is_a_not_found_error(claude):
    with pytest.raises(anthropic.NotFoundError) as err:
        claude.messages.create(model="claude-opus-4", max_tokens=2, messages=ASK)
    assert "claude-opus-4" in err.value.body["error"]["message"]
