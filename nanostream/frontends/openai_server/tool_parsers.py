"""Tool-call parsers: a model's text turned into OpenAI ``tool_calls``, streamed or whole, and the grammar
that makes a model call a tool (``tool_choice`` "required" or a named function).

    parser = get_tool_parser("hermes")()
    parser.feed('Sure.<tool_call>\\n{"name": "f", "arguments": {"x"', final=False)
        -> [Content("Sure."), CallStart(0, "call_…", "f"), CallArguments(0, '{"x"')]
    parser.feed(': 1}}\\n</tool_call>', final=True)   -> [CallArguments(0, ': 1}')]

One parser object per choice. The whole-text form (``parse``) is the streamed one fed at once, so a
streamed reply assembled by the client equals the non-streamed one. A parser is a small registered
class (``TOOL_PARSERS``): ``feed`` for its format, ``constraint`` for the grammar of its format.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, ClassVar

from nanostream.structured_outputs import StructuredOutputsParams


@dataclass
class Content:
    text: str


@dataclass
class CallStart:
    index: int
    id: str
    name: str


@dataclass
class CallArguments:
    index: int
    text: str


Event = Content | CallStart | CallArguments


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""  # JSON text, as the model wrote it


@dataclass
class Parsed:
    content: str | None
    calls: list[ToolCall] = field(default_factory=list)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def assemble(events: list[Event]) -> Parsed:
    """The content and tool calls that ``events`` add up to (what the client's stream helpers build)."""
    content, calls = [], {}
    for e in events:
        if isinstance(e, Content):
            content.append(e.text)
        elif isinstance(e, CallStart):
            calls[e.index] = ToolCall(e.id, e.name)
        else:
            calls[e.index].arguments += e.text
    return Parsed("".join(content) or None, [calls[i] for i in sorted(calls)])


class ToolParser:
    """Base class: ``feed`` turns the next piece of text into events; ``constraint`` is the grammar of
    one or more calls in this format."""

    name: ClassVar[str]

    def feed(self, text: str, final: bool) -> list[Event]:
        raise NotImplementedError

    def parse(self, text: str) -> Parsed:
        return assemble(self.feed(text, final=True))

    @classmethod
    def constraint(cls, tools: list[dict[str, Any]], parallel: bool) -> StructuredOutputsParams:
        raise NotImplementedError


_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


class HermesToolParser(ToolParser):
    """Qwen's and Hermes' format (what their chat templates teach):
    ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, calls one after another.

    Text before the first call is content (held back while it is only whitespace, so a reply that is
    only calls has none); text after a call is not. A call whose name comes first streams its
    arguments as they arrive; any other call is sent whole once it closes. A call that is not JSON
    of that shape stays content.
    """

    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self.buffer = ""  # text not handled yet
        self.in_call = False
        self.body = ""  # the open call's text so far
        self.calls = 0  # calls started
        self.header_sent = False  # the open call's CallStart went out
        self.args_sent = 0  # characters of the open call's arguments sent
        self.held = ""  # leading whitespace of the content, not sent yet
        self.content_started = False

    def feed(self, text: str, final: bool) -> list[Event]:
        self.buffer += text
        events: list[Event] = []
        while True:
            if not self.in_call:
                at = self.buffer.find(self.start)
                if at < 0:
                    keep = 0 if final else _partial_suffix(self.buffer, self.start)
                    self._content(self.buffer[: len(self.buffer) - keep], events)
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    break
                self._content(self.buffer[:at], events)
                self.buffer, self.in_call, self.body = self.buffer[at + len(self.start) :], True, ""
                self.header_sent, self.args_sent = False, 0
            at = self.buffer.find(self.end)
            if at < 0:
                keep = 0 if final else _partial_suffix(self.buffer, self.end)
                self.body += self.buffer[: len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep :]
                self._stream_call(events, closed=final, tagged=False)
                break
            self.body += self.buffer[:at]
            self.buffer = self.buffer[at + len(self.end) :]
            self._stream_call(events, closed=True, tagged=True)
            self.in_call = False
        if final and self.held and not self.calls:
            events.append(Content(self.held))
            self.held = ""
        return events

    def _content(self, text: str, events: list[Event]) -> None:
        if not text or self.calls:  # after the first call: not content
            return
        if not self.content_started and not (self.held + text).strip():
            self.held += text  # leading whitespace: content only if something follows that is not a call
            return
        events.append(Content(self.held + text))
        self.held, self.content_started = "", True

    def _stream_call(self, events: list[Event], closed: bool, tagged: bool) -> None:
        """Events for the open call's body so far; ``closed``: it is complete (``tagged``: by its end tag)."""
        if not self.header_sent:
            m = _NAME.match(self.body)
            if m is not None and m.end() < len(self.body):  # the arguments have begun
                self.header_sent, self.args_start = True, m.end()
                events.append(CallStart(self.calls, new_call_id(), json.loads(f'"{m.group(1)}"')))
                self.calls += 1
        if self.header_sent:
            args = self.body[self.args_start :]
            if args[:1] in ("{", "["):  # an object or array: streamed as it comes, up to where it closes
                end = _json_value_end(args)
                upto = end if end is not None else len(args)
                if upto > self.args_sent:
                    events.append(CallArguments(self.calls - 1, args[self.args_sent : upto]))
                    self.args_sent = upto
            elif closed:  # another kind of value: whole, as JSON
                events.append(CallArguments(self.calls - 1, _arguments_json(self.body, args)))
            return
        if not closed:
            return
        try:  # no streamable header: the whole call at once, or content if it is no call
            call = json.loads(self.body)
            name, arguments = call["name"], call.get("arguments", {})
            if not isinstance(name, str):
                raise TypeError(name)
        except (ValueError, KeyError, TypeError):
            self._content(self.start + self.body + (self.end if tagged else ""), events)
            return
        events.append(CallStart(self.calls, new_call_id(), name))
        events.append(CallArguments(self.calls, json.dumps(arguments, ensure_ascii=False)))
        self.calls += 1

    @classmethod
    def constraint(cls, tools: list[dict[str, Any]], parallel: bool) -> StructuredOutputsParams:
        def call(tool: dict[str, Any]) -> dict[str, Any]:
            function = tool["function"]
            params = function.get("parameters") or {"type": "object"}
            return {
                "type": "object",
                "properties": {"name": {"const": function["name"]}, "arguments": params},
                "required": ["name", "arguments"],
            }

        schemas = [call(t) for t in tools]
        tag = {
            "type": "tag",
            "begin": cls.start + "\n",
            "content": {"type": "json_schema", "json_schema": schemas[0] if len(schemas) == 1 else {"anyOf": schemas}},
            "end": "\n" + cls.end,
        }
        fmt = {"type": "tags_with_separator", "tags": [tag], "separator": "\n", "at_least_one": True}
        fmt["stop_after_first"] = not parallel
        return StructuredOutputsParams(structural_tag=json.dumps({"type": "structural_tag", "format": fmt}))


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _arguments_json(body: str, args: str) -> str:
    """A call's arguments that are no object or array, as JSON text (the raw text if the call is no JSON)."""
    try:
        return json.dumps(json.loads(body)["arguments"], ensure_ascii=False)
    except (ValueError, KeyError, TypeError):
        return args.rstrip().removesuffix("}").rstrip()


def _json_value_end(text: str) -> int | None:
    """Where the JSON object or array that ``text`` starts with ends, or None if it has not ended."""
    depth, in_string, escaped = 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser}


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"tool_call_parser must be one of {', '.join(sorted(TOOL_PARSERS))}, got {name!r}") from None
