"""OpenAI's Responses API (``/v1/responses``) over real HTTP with the official ``openai`` client, a real
engine process and a tiny random model (a scripted reply is forced with structured outputs): text
whole and streamed (the events in the API's order, the client's stream helper assembling them), a
function tool round trip, a JSON schema, reasoning items, stored responses across three turns,
``store: false``, and every refusal in OpenAI's error shape."""

from __future__ import annotations

import json
import typing
from collections.abc import Iterator

import jsonschema
import openai
import pytest
from helpers import API_KEY, forced, serve_http

from nanostream.frontends.openai_server import create_app
from nanostream.frontends.openai_server.response_store import ResponseStore

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}


@pytest.fixture(scope="module")
def url(engine) -> Iterator[str]:
    base, stop = serve_http(create_app(engine, api_key=API_KEY, response_store=ResponseStore(max_responses=3)))
    yield base
    stop()


@pytest.fixture(scope="module")
def reasoning_api(engine) -> Iterator[openai.OpenAI]:
    base, stop = serve_http(create_app(engine, api_key=API_KEY, reasoning_parser="qwen3"))
    yield openai.OpenAI(base_url=base + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    stop()


def event_types(events) -> list[str]:
    return [e.type for e in events]


def test_text_whole_and_streamed_in_the_apis_order(api, model):
    args = dict(model=model, input="Say hi", max_output_tokens=20, extra_body=forced("Hello there."))
    whole = api.responses.create(**args)
    assert (whole.status, whole.output_text, whole.object) == ("completed", "Hello there.", "response")
    assert (
        whole.usage.input_tokens > 0
        and whole.usage.output_tokens == whole.usage.total_tokens - whole.usage.input_tokens
    )
    with api.responses.stream(**args) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output_text == "Hello there." and final.id == events[-1].response.id
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = event_types(events)
    assert types[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello there."


def test_max_output_tokens_ends_incomplete(api, model):
    r = api.responses.create(model=model, input="Go on", max_output_tokens=3, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


def test_a_function_tool_round_trip(api, model):
    forced_call = dict(tools=[TOOL], tool_choice="required", parallel_tool_calls=False, temperature=0)
    ask = dict(model=model, input="What is the weather in Paris?", max_output_tokens=200, **forced_call)
    first = api.responses.create(**ask)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    with api.responses.stream(**ask) as stream:
        events = list(stream)
        assert events[-1].type == "response.completed"
        streamed = stream.get_final_response()
    assert "response.function_call_arguments.delta" in event_types(events)
    streamed_call = next(i for i in streamed.output if i.type == "function_call")
    jsonschema.validate(json.loads(streamed_call.arguments), WEATHER)
    # the output goes back as a function_call_output: through the stored response, or with the whole history
    output = {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temp": 21}'}
    answer = api.responses.create(
        model=model, previous_response_id=first.id, input=[output], max_output_tokens=20, extra_body=forced("21 C.")
    )
    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        calls[0].model_dump(exclude_none=True),
        output,
    ]
    again = api.responses.create(model=model, input=history, max_output_tokens=20, extra_body=forced("21 C."))
    assert answer.output_text == again.output_text == "21 C."
    assert answer.usage.input_tokens == again.usage.input_tokens  # the same prompt, rendered the same


def test_a_json_schema_validates(api, model):
    fmt = {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}
    r = api.responses.create(
        model=model, input="JSON please", text={"format": fmt}, max_output_tokens=200, temperature=0
    )
    jsonschema.validate(json.loads(r.output_text), WEATHER)


def test_reasoning_items(reasoning_api, model):
    args = dict(
        model=model, input="Hi", max_output_tokens=40, extra_body=forced("<think>\nA greeting.\n</think>\n\nHi!")
    )
    r = reasoning_api.responses.create(**args)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert (r.output[0].content[0].text, r.output_text) == ("\nA greeting.\n", "Hi!")
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    with reasoning_api.responses.stream(**args) as stream:
        events = list(stream)
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == "\nA greeting.\n"
    assert stream.get_final_response().output_text == "Hi!"
    # store: false agents (Codex) ask for the reasoning as encrypted_content and send it back as input
    opaque = reasoning_api.responses.create(
        **args, store=False, include=["reasoning.encrypted_content"], reasoning={"summary": "auto"}
    )
    assert opaque.output[0].encrypted_content == "\nA greeting.\n" and opaque.output[0].summary == []
    # read back: a reasoning item after the last user message (the template shows it there), before a call
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"}
    tail = [call, {"type": "function_call_output", "call_id": "call_1", "output": "21"}]

    def input_tokens(*reasoning: dict) -> int:
        items = [{"role": "user", "content": "Hi"}, *reasoning, *tail]
        return reasoning_api.responses.create(model=model, input=items, max_output_tokens=1).usage.input_tokens

    thought = "Weather, then an answer."
    as_text = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": thought}],
    }
    as_opaque = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": thought}
    assert input_tokens(as_opaque) == input_tokens(as_text) > input_tokens()


def test_previous_response_id_across_three_turns_get_and_delete(api, model, http):
    one = api.responses.create(model=model, input="One", max_output_tokens=5, temperature=0)
    two = api.responses.create(model=model, input="Two", previous_response_id=one.id, max_output_tokens=5)
    three = api.responses.create(model=model, input="Three", previous_response_id=two.id, max_output_tokens=5)
    assert one.usage.input_tokens < two.usage.input_tokens < three.usage.input_tokens
    assert three.previous_response_id == two.id
    assert api.responses.retrieve(three.id).output_text == three.output_text
    api.responses.delete(three.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(three.id)
    unstored = api.responses.create(model=model, input="Secret", max_output_tokens=2, store=False)
    assert http.get(f"/v1/responses/{unstored.id}").status_code == 404
    # the store keeps 3 responses here: the least recently used leave
    made = [api.responses.create(model=model, input="x", max_output_tokens=1).id for _ in range(4)]
    assert http.get(f"/v1/responses/{made[0]}").status_code == 404
    assert http.get(f"/v1/responses/{made[-1]}").status_code == 200


@pytest.mark.parametrize(
    ("extra", "param", "fragment"),
    [
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input", "web_search_call"),
        ({"tools": [{"type": "web_search"}]}, "tools", "'web_search'"),
        ({"background": True}, "background", "background"),
        ({"tools": [{**TOOL, "parameters": "not a schema"}]}, "tools", "JSON Schema"),
        ({"previous_response_id": "resp_missing"}, "previous_response_id", "resp_missing"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input",
            "takes no images",
        ),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input", "input_file"),
        ({"frobnicate": 1}, "frobnicate", "not a field"),
        ({"reasoning": {"summary": "detailed"}}, "reasoning.summary", ""),
        ({"include": ["message.output_text.logprobs"]}, "include.0", ""),
    ],
)
def test_refusals_in_openais_shape(http, model, extra, param, fragment):
    body = {"model": model, "input": "Hi", "max_output_tokens": 2, **extra}
    r = http.post("/v1/responses", json=body)
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert error["param"] == param and fragment in error["message"], error


def test_the_openai_agents_sdk_runs_a_tool_using_agent(url, model):
    """The Agents SDK's default model (the Responses API), the whole loop: the forced call is parsed, the SDK
    runs the tool and sends its output back (its tool choice reset to auto), and the model's answer ends the run,
    held to the agent's output type by the server's JSON schema (a random model's free text would not end
    before max_tokens)."""
    agents = pytest.importorskip("agents")
    calls = []

    @agents.function_tool
    def get_weather(city: typing.Literal["Paris", "Rome"]) -> str:  # (a random model's free string runs long)
        """The weather in a city."""
        calls.append(city)
        return "21 C"

    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    settings = agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=200, parallel_tool_calls=False)
    agent = agents.Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[get_weather],
        model=agents.OpenAIResponsesModel(model=model, openai_client=client),
        model_settings=settings,
        output_type=typing.Literal["sunny", "rainy"],
    )
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert len(calls) == 1 and calls[0] in ("Paris", "Rome")
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"], kinds
    assert result.final_output in ("sunny", "rainy")
