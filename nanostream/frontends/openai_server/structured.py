"""What a request constrains its output to: OpenAI's ``response_format``, vLLM's ``structured_outputs``
field, or a ``tool_choice`` that forces a tool call. At most one of them; each becomes the engine's
``StructuredOutputsParams``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nanostream.frontends.openai_server.chat_protocol import ChatRequest
from nanostream.frontends.openai_server.protocol import BaseRequest, bad_request
from nanostream.frontends.openai_server.tool_parsers import ToolParser
from nanostream.structured_outputs import StructuredOutputsParams

# vLLM's structured_outputs keys; disable_any_whitespace is vLLM's spelling of the opposite of any_whitespace.
# enable_in_reasoning (vLLM's name, a server setting there): with a reasoning parser, the constraint covers
# the reasoning too, rather than holding after it.
_KEYS = {"json", "regex", "choice", "grammar", "json_object", "structural_tag", "any_whitespace", "enable_in_reasoning"}


def from_response_format(body: BaseRequest) -> StructuredOutputsParams | None:
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None:
        raise bad_request('response_format of type "json_schema" needs its json_schema', "response_format")
    schema = fmt.json_schema.schema_
    if schema is None:
        return StructuredOutputsParams(json_object=True)
    return _checked(lambda: StructuredOutputsParams(json=schema), "response_format")


def from_field(body: BaseRequest) -> StructuredOutputsParams | None:
    given: dict[str, Any] | None = body.structured_outputs
    if given is None:
        return None
    unknown = sorted(set(given) - _KEYS - {"disable_any_whitespace", "backend"})
    if unknown:
        raise bad_request(
            f"structured_outputs has no field {unknown[0]!r}; it takes {', '.join(sorted(_KEYS))}", "structured_outputs"
        )
    if given.get("backend") not in (None, "auto", "xgrammar"):
        raise bad_request("structured_outputs.backend must be xgrammar (or left out)", "structured_outputs")
    fields = {k: v for k, v in given.items() if k in _KEYS and v is not None}
    if "disable_any_whitespace" in given and "any_whitespace" not in fields:
        fields["any_whitespace"] = not given["disable_any_whitespace"]
    return _checked(lambda: StructuredOutputsParams(**fields), "structured_outputs")


def _checked(build, param: str) -> StructuredOutputsParams:
    try:
        return build()
    except (TypeError, ValueError) as exc:
        raise bad_request(str(exc), param) from None


@dataclass
class ToolPlan:
    """How a chat request's tools are handled: shown to the template, parsed from the reply, forced."""

    tools: list[dict[str, Any]] | None  # for the chat template
    parse: bool  # turn the reply's calls into tool_calls
    constraint: StructuredOutputsParams | None  # tool_choice "required" or named: a call in the parser's format


def tool_plan(body: ChatRequest, parser: type[ToolParser] | None) -> ToolPlan:
    """Check ``tools`` and ``tool_choice`` against each other and the server's tool-call parser."""
    tools, choice = body.tools, body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools: give the functions it may call", "tool_choice")
        return ToolPlan(None, False, None)
    names = [t.function.name for t in tools]
    if len(set(names)) < len(names):
        raise bad_request("tools has two functions of one name; names must be unique", "tools")
    for_template = [t.for_template() for t in tools]
    choice = choice or "auto"
    if choice == "none":
        return ToolPlan(for_template, False, None)
    if parser is None:
        raise bad_request(
            "this server parses no tool calls (started with --tool-call-parser none); use tool_choice none",
            "tool_choice",
        )
    if choice == "auto":
        return ToolPlan(for_template, True, None)
    forced = for_template
    if choice != "required":
        forced = [t for t in for_template if t["function"]["name"] == choice.function.name]
        if not forced:
            raise bad_request(
                f"tool_choice names {choice.function.name!r}, which is not among the tools ({', '.join(names)})",
                "tool_choice",
            )
    parallel = body.parallel_tool_calls and choice == "required"
    return ToolPlan(for_template, True, parser.constraint(forced, parallel))


def constraint_of(body: BaseRequest, plan: ToolPlan | None = None) -> StructuredOutputsParams | None:
    """The request's one constraint, or a 400 naming the second one. A forced tool call goes before
    ``response_format``, as OpenAI's API takes the two: the reply is a call, and the format shapes a message
    (an agent framework sends its output type with every turn, its tool choice "required" on the first)."""
    forced, fmt = plan.constraint if plan else None, from_response_format(body)
    given = [
        (name, c)
        for name, c in (
            ("response_format", None if forced is not None else fmt),
            ("structured_outputs", from_field(body)),
            ("tool_choice", forced),
        )
        if c is not None
    ]
    if len(given) > 1:
        raise bad_request(
            f"{given[0][0]} and {given[1][0]} both constrain the output; give only one of them", given[1][0]
        )
    return given[0][1] if given else None
