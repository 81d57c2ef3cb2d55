"""The dialects' translations, without a server (the fast lane): a reply's chunks as blocks (turn.py), the
Responses API's input items and Anthropic's messages as the chat route's messages, and their refusals."""

from __future__ import annotations

import json

import pytest

from nanostream.frontends.openai_server.messages_protocol import MessagesRequest
from nanostream.frontends.openai_server.protocol import APIError
from nanostream.frontends.openai_server.responses_protocol import ResponsesRequest, input_messages
from nanostream.frontends.openai_server.tool_parsers import HermesToolParser
from nanostream.frontends.openai_server.turn import Turn
from nanostream.outputs import StreamChunk
from nanostream.protocol import Usage


def chunk(text: str = "", reasoning: str = "", finish: str | None = None) -> StreamChunk:
    c = StreamChunk(text, [0], finish, Usage(5, 3) if finish else None)
    c.reasoning_content = reasoning
    return c


def test_a_reply_becomes_reasoning_text_and_call_blocks_opened_grown_and_closed():
    turn = Turn(HermesToolParser)
    call = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    steps = []
    for c in (
        chunk(reasoning="Think"),
        chunk(reasoning="ing."),
        chunk("Sure. "),
        chunk(call[:30]),
        chunk(call[30:], finish="stop"),
    ):
        steps += turn.feed(c)
    assert [(b.kind, b.text, b.done) for b in turn.blocks] == [
        ("reasoning", "Thinking.", True),
        ("text", "Sure. ", True),
        ("call", '{"x": 1}', True),
    ]
    assert turn.blocks[2].name == "f" and turn.blocks[2].call_id.startswith("call_")
    ops = [(s.op, s.block.index) for s in steps]
    assert ops[:3] == [("open", 0), ("delta", 0), ("delta", 0)]
    assert ops.index(("close", 0)) < ops.index(("open", 1)) < ops.index(("close", 1)) < ops.index(("open", 2))
    assert ops[-1] == ("close", 2) and (turn.finish_reason, turn.usage) == ("tool_calls", Usage(5, 3))
    assert "".join(s.text for s in steps if s.block.index == 2) == '{"x": 1}'


def test_without_a_tool_parser_text_is_text_and_a_cut_reply_keeps_length():
    turn = Turn(None)
    turn.feed(chunk("<tool_call>"))
    turn.feed(chunk("x", finish="length"))
    assert [(b.kind, b.text) for b in turn.blocks] == [("text", "<tool_call>x")] and turn.finish_reason == "length"


def test_responses_input_items_become_chat_messages():
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Call."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "21"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "21 C."}]},
    ]
    assert input_messages(items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Call.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "21"},
        {"role": "assistant", "content": "21 C."},
    ]
    body = ResponsesRequest(input="Hi", instructions="Be brief.", text={"format": {"type": "json_object"}})
    chat = body.chat_request([{"role": "user", "content": "Before"}, {"role": "assistant", "content": "Ok"}])
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "user"]
    assert chat.response_format.type == "json_object"


@pytest.mark.parametrize(
    ("items", "fragment"),
    [
        ([{"type": "file_search_call", "id": "x"}], "'file_search_call'"),
        ([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}], "'input_file'"),
        ([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{not json"}], "JSON text"),
        ([{"type": "function_call_output", "output": "x"}], "call_id"),
        ([{"role": "tool", "content": "x"}], "role"),
    ],
)
def test_responses_input_refusals_say_what_to_change(items, fragment):
    with pytest.raises(APIError) as err:
        input_messages(items)
    assert err.value.status == 400 and fragment in err.value.message


def test_anthropic_messages_become_chat_messages():
    body = MessagesRequest(
        max_tokens=10,
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Call.", "signature": ""},
                    {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}},
                ],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "21"}]},
        ],
        tools=[{"name": "get_weather", "input_schema": {"type": "object"}}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        thinking={"type": "disabled"},
        stop_sequences=["\n\n"],
    )
    chat = body.chat_request()
    messages = chat.template_messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert messages[2]["reasoning_content"] == "Call."
    assert json.loads(messages[2]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert messages[3] == {"role": "tool", "tool_call_id": "t1", "content": "21"}
    assert (chat.tool_choice, chat.parallel_tool_calls, chat.stop) == ("required", False, ["\n\n"])
    assert chat.chat_template_kwargs == {"enable_thinking": False} and chat.max_tokens == 10
