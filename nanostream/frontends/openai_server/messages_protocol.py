"""Anthropic's Messages API request body (``POST /v1/messages`` and ``/v1/messages/count_tokens``), its
translation into the chat route's request, and Anthropic's error shape. ``tool_use`` blocks become an
assistant's ``tool_calls``, ``tool_result`` blocks ``tool`` messages, ``thinking`` blocks its
``reasoning_content``, ``image`` blocks (a user's, or in a tool result) image parts in order with the text
(base64 as a data: URL, a url source as given); ``thinking`` itself sets the chat template's reasoning
switch (``enable_thinking``).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from nanostream.frontends.openai_server.chat_protocol import ChatRequest, function_tool, image_part, tool_call
from nanostream.frontends.openai_server.protocol import APIError, Int64, bad_request
from nanostream.frontends.openai_server.unsupported import check_extra_fields

UNSUPPORTED = {
    "container": "this server runs no code-execution containers",
    "mcp_servers": "this server connects to no MCP servers; give the tools as tools",
    "context_management": "this server does not edit the context; send the messages to use",
}
IGNORED = {"metadata", "service_tier", "anthropic_version"}
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error(error: APIError) -> JSONResponse:
    """An error in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``."""
    return JSONResponse(error_body(error), status_code=error.status, headers=error.headers)


def error_body(error: APIError) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(error.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


class Thinking(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Int64 | None = None  # a target, as in Anthropic's API: checked against max_tokens, not enforced


class OutputFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: OutputFormat | None = None  # structured output: the engine's grammar for the schema
    effort: None = None  # no effort levels here: a value is refused, naming the field


class MessagesRequest(BaseModel):
    """The body of ``POST /v1/messages``; ``count_tokens`` takes it without ``max_tokens``."""

    model_config = ConfigDict(allow_inf_nan=False, extra="allow")

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: Annotated[int, Field(ge=1, lt=2**63)]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    # vLLM's extensions (the anthropic package's extra_body)
    structured_outputs: dict[str, Any] | None = None
    ignore_eos: bool | None = None  # (benchmarks: every request its max_tokens)

    def check(self, reasoning: bool) -> None:
        check_extra_fields(self.model_extra, UNSUPPORTED, IGNORED, "Messages")
        t = self.thinking
        if t is not None and t.type != "disabled" and not reasoning:
            raise bad_request(
                "thinking needs a server started with --reasoning-parser (to tell thinking from text)", "thinking"
            )
        bound = self.max_tokens if "max_tokens" in self.model_fields_set else 2**63  # (count_tokens has none)
        if t is not None and t.budget_tokens is not None and not 1024 <= t.budget_tokens < bound:
            raise bad_request("thinking.budget_tokens must be >= 1024 and less than max_tokens", "thinking")

    def chat_request(self) -> ChatRequest:
        system = self.system if isinstance(self.system, str) or self.system is None else _text(self.system, "system")
        messages = [{"role": "system", "content": system}] if system else []
        for i, message in enumerate(self.messages):
            messages += _chat_messages(message, f"messages[{i}]")
        fields: dict[str, Any] = dict(
            messages=messages,
            max_tokens=self.max_tokens,
            stop=self.stop_sequences,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            ignore_eos=self.ignore_eos,
            structured_outputs=self.structured_outputs,
            tools=self.chat_tools(),
        )
        choice = self.tool_choice or {"type": "auto"}
        kinds = {"auto": "auto", "any": "required", "none": "none", "tool": None}
        if choice.get("type") not in kinds:
            raise bad_request("tool_choice.type must be auto, any, tool or none", "tool_choice")
        if self.tools:
            named = {"type": "function", "function": {"name": choice.get("name")}}
            fields["tool_choice"] = kinds[choice["type"]] or named
            fields["parallel_tool_calls"] = not choice.get("disable_parallel_tool_use", False)
        fmt = self.output_config.format if self.output_config is not None else None
        if fmt is not None:
            fields["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": fmt.schema_},
            }
        if self.thinking is not None:
            fields["chat_template_kwargs"] = {"enable_thinking": self.thinking.type != "disabled"}
        return ChatRequest.model_validate(fields)

    def chat_tools(self) -> list[dict[str, Any]] | None:
        out = []
        for i, tool in enumerate(self.tools or []):
            if tool.get("type") not in (None, "custom"):
                raise bad_request(
                    f"tools[{i}] is the built-in tool {tool.get('type')!r}: this server runs none; give client "
                    "tools (name, description, input_schema)",
                    "tools",
                )
            schema = tool.get("input_schema")
            if not isinstance(schema, dict) or not isinstance(tool.get("name"), str):
                raise bad_request(f"tools[{i}] needs a name and an input_schema (a JSON Schema object)", "tools")
            out.append(function_tool(name=tool["name"], description=tool.get("description"), parameters=schema))
        return out or None


def _text(blocks: list[dict[str, Any]], where: str) -> str:
    texts = []
    for block in blocks:
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else None
            raise bad_request(f"{where} has a block of type {kind!r} where only text blocks may be", where)
        texts.append(block["text"])
    return "\n".join(texts)


def _content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Chat text and image parts as a message's content: the texts joined with newlines when there is no image."""
    if any(part["type"] != "text" for part in parts):
        return parts
    return "\n".join(part["text"] for part in parts)


def _tool_result(blocks: Any, where: str) -> str | list[dict[str, Any]]:
    """A tool_result's content: a string, or text and image blocks (a tool's screenshot) in order."""
    if not isinstance(blocks, list):
        return blocks or ""
    parts = []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "image":
            parts.append(image_part(_image_url(block, f"{where}[{j}]")))
        elif kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        else:
            raise bad_request(f"{where} has a block of type {kind!r}; a tool_result takes text and image blocks", where)
    return _content(parts)


def _image_url(block: dict[str, Any], where: str) -> str:
    """An image block's source as a URL: base64 data as a data: URL; a url source as given (the server's
    --allowed-media-domains decides)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media, data = source.get("media_type"), source.get("data")
        if not isinstance(media, str) or not media.startswith("image/") or not isinstance(data, str) or not data:
            raise bad_request(
                f"{where}.source (base64) needs media_type (image/png, image/jpeg, image/gif or image/webp) and "
                "data (the image's base64)",
                "messages",
            )
        return f"data:{media};base64,{data}"
    if kind == "url" and isinstance(source.get("url"), str) and source["url"]:
        return source["url"]
    raise bad_request(
        f"{where}.source is of type {kind!r}; this server takes image sources of type base64 and url (it has no "
        "Files API): send the image's bytes as base64",
        "messages",
    )


def _chat_messages(message: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user's tool results come first, as ``tool`` messages."""
    role, content = message.get("role"), message.get("content")
    if role not in ("user", "assistant"):
        raise bad_request(f"{where}.role must be user or assistant, got {role!r}", "messages")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of content blocks", "messages")
    out: list[dict[str, Any]] = []
    parts, calls, thinking = [], [], []  # parts: text and (a user's) image parts, in order
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content[{j}]"
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and role == "user":
            parts.append(image_part(_image_url(block, at)))
        elif kind == "tool_result" and role == "user" and isinstance(block.get("tool_use_id"), str):
            result = _tool_result(block.get("content"), at + ".content")
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
        elif kind == "tool_use" and role == "assistant" and isinstance(block.get("id"), str):
            arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
            calls.append(tool_call(block["id"], block.get("name"), arguments))
        elif kind == "thinking" and role == "assistant":
            thinking.append(block.get("thinking") or "")
        elif kind == "redacted_thinking" and role == "assistant":
            continue  # encrypted by another server: nothing this model can read
        else:
            raise bad_request(
                f"{at} is a block of type {kind!r} this server does not take in a {role} message (it takes text, "
                "tool_use and thinking from the assistant, text, image and tool_result from the user)",
                "messages",
            )
    if parts or calls or thinking or not out:
        chat: dict[str, Any] = {"role": role, "content": _content(parts)}
        if calls:
            chat["tool_calls"] = calls
        if thinking:
            chat["reasoning_content"] = "".join(thinking)
        out.append(chat)
    return out


class CountTokensRequest(MessagesRequest):
    max_tokens: Annotated[int, Field(ge=1, lt=2**63)] = 1  # (not part of a count_tokens body)
