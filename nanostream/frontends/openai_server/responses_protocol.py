"""The Responses API's request body (``POST /v1/responses``) and its translation into the chat route's
request: input items become chat messages (a ``function_call`` an assistant's ``tool_calls``, a
``function_call_output`` a ``tool`` message, a ``reasoning`` item its ``reasoning_content``, an
``input_image`` part an image part in order with the text), tools and ``text.format`` their chat forms.
What the API has and this server does not run is a 400 naming it.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from nanostream.frontends.openai_server.chat_protocol import ChatRequest, function_tool, image_part, tool_call
from nanostream.frontends.openai_server.protocol import Int64, bad_request
from nanostream.frontends.openai_server.unsupported import check_extra_fields

# Fields of the API that would change the result and that this server does not implement: why, by name.
UNSUPPORTED = {
    "background": "this server runs no background responses; leave background out or false",
    "conversation": "this server keeps no conversations; pass previous_response_id instead",
    "prompt": "this server has no stored prompt templates; send instructions and input",
    "top_logprobs": "this server's Responses route returns no logprobs; use /v1/chat/completions",
    "max_tool_calls": "this server cannot bound the number of tool calls; leave it out",
}
IGNORED = {"user", "safety_identifier", "prompt_cache_key", "service_tier", "stream_options", "prompt_cache_retention"}
"""Fields that change nothing a client sees from this server (as OpenAI ignores ``user``): accepted."""
_INPUT_ITEMS = {"message", "function_call", "function_call_output", "reasoning"}


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the only one a model without the knob has


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    # No summarizer here: "auto" (the best one available) gives none; another value is refused, naming it.
    summary: Literal["auto"] | None = None
    generate_summary: Literal["auto"] | None = None


class ResponsesRequest(BaseModel):
    """The body of ``POST /v1/responses``. Unknown fields are a 400 naming them (``check``)."""

    model_config = ConfigDict(allow_inf_nan=False, extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] | None = None
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    truncation: Literal["disabled"] | None = None  # "auto" (drop the conversation's start) is not done here
    # "reasoning.encrypted_content" (what store: false agents such as Codex ask): a reasoning item carries its
    # text there, opaque, and reads it back as input; nothing else is added to the output on request
    include: list[Literal["reasoning.encrypted_content"]] | None = None
    # vLLM's extensions (the openai package's extra_body)
    seed: Int64 | None = None
    top_k: Int64 | None = None
    ignore_eos: bool | None = None  # (benchmarks: every request its max_output_tokens)
    structured_outputs: dict[str, Any] | None = None

    def check(self) -> None:
        check_extra_fields(self.model_extra, UNSUPPORTED, IGNORED, "Responses")

    def chat_request(self, history: list[dict[str, Any]]) -> ChatRequest:
        """The chat request this is: ``history`` (a stored conversation) + the input, the options."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        fields: dict[str, Any] = dict(
            messages=system + history + self.messages(),
            max_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            top_k=self.top_k,
            ignore_eos=self.ignore_eos,
            structured_outputs=self.structured_outputs,
            parallel_tool_calls=self.parallel_tool_calls,
            tools=self.chat_tools(),
            tool_choice=self.chat_tool_choice(),
        )
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type != "text":
            schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}
            fields["response_format"] = {"type": fmt.type, "json_schema": schema if fmt.type == "json_schema" else None}
            if fmt.type == "json_schema" and fmt.schema_ is None:
                raise bad_request('text.format of type "json_schema" needs its schema', "text.format")
        if self.reasoning is not None and self.reasoning.effort is not None:
            fields["chat_template_kwargs"] = {"enable_thinking": self.reasoning.effort != "none"}
        return ChatRequest.model_validate(fields)

    def messages(self) -> list[dict[str, Any]]:
        """The input as chat messages (what the store keeps of it, too)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return input_messages(self.input)

    def chat_tools(self) -> list[dict[str, Any]] | None:
        if not self.tools:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            kind = tool.get("type")
            if kind != "function":
                raise bad_request(
                    f"tools[{i}] is of type {kind!r}: this server runs no built-in tools, only tools of type "
                    "function (which your code runs)",
                    "tools",
                )
            parameters = tool.get("parameters")
            if parameters is not None and not isinstance(parameters, dict):
                raise bad_request(f"tools[{i}].parameters must be a JSON Schema object", "tools")
            fields = ("name", "description", "parameters", "strict")
            out.append(function_tool(**{k: tool.get(k) for k in fields}))
        return out

    def chat_tool_choice(self) -> Any:
        choice = self.tool_choice
        if choice is None or isinstance(choice, str):
            return choice
        if choice.get("type") == "function" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
        raise bad_request(
            f"tool_choice of type {choice.get('type')!r} is not supported: give none, auto, required or "
            '{"type": "function", "name": ...}',
            "tool_choice",
        )


_TEXT_PARTS = ("input_text", "output_text", "text", "reasoning_text")


def _text_of(content: Any, where: str) -> str:
    """An assistant's or a reasoning item's content as text: a string, or text parts joined with newlines."""
    text = _content_of(content, where, images=False)
    assert isinstance(text, str)
    return text


def _content_of(content: Any, where: str, images: bool = True) -> str | list[dict[str, Any]]:
    """A message's or an output's content as the chat route takes it: a string, text parts joined with newlines,
    or, with an ``input_image`` among them (where ``images``), text and image parts in order."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of parts", "input")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image" and images:
            parts.append(image_part(_image_url(part, f"{where}.content[{j}]")))
        elif kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            taken = "text parts (input_text, output_text) and input_image" if images else "text parts only"
            raise bad_request(f"{where}.content has a part of type {kind!r}; this server takes {taken} here", "input")
    if any(p["type"] != "text" for p in parts):
        return parts
    return "\n".join(p["text"] for p in parts)


def _image_url(part: dict[str, Any], where: str) -> str:
    url = part.get("image_url")
    if url is None and part.get("file_id") is not None:
        raise bad_request(
            f"{where} names an image by file_id; this server has no Files API: send the image as image_url "
            "(a data:image/...;base64, URL, or an http(s) URL the server allows)",
            "input",
        )
    if not isinstance(url, str) or not url:
        raise bad_request(f"{where} (an input_image) needs image_url: a data: URL or an http(s) URL", "input")
    return url


def input_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages; an assistant's text, reasoning and calls in a row make one message."""
    out: list[dict[str, Any]] = []

    def assistant() -> dict[str, Any]:
        if not out or out[-1]["role"] != "assistant" or out[-1].get("_closed"):
            out.append({"role": "assistant", "content": ""})
        return out[-1]

    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind not in _INPUT_ITEMS:
            raise bad_request(
                f"{where} is an item of type {kind!r}; this server takes {', '.join(sorted(_INPUT_ITEMS))}", "input"
            )
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}.role must be user, system, developer or assistant, got {role!r}", "input")
            if role == "assistant":
                message = assistant()
                if message.get("tool_calls"):  # text after a call: a new message
                    message["_closed"] = True
                    message = assistant()
                message["content"] += _text_of(item.get("content"), where)
            else:
                content = _content_of(item.get("content"), where)
                out.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "reasoning":
            parts = item.get("content") or []
            opaque = item.get("encrypted_content")  # (this server's own: the text, as `include` asked for it)
            assistant()["reasoning_content"] = opaque if isinstance(opaque, str) and opaque else _text_of(parts, where)
        elif kind == "function_call":
            if not isinstance(item.get("call_id"), str) or not isinstance(item.get("name"), str):
                raise bad_request(f"{where} (a function_call) needs its call_id and name", "input")
            arguments = item.get("arguments", "{}")
            try:
                json.loads(arguments)
            except (TypeError, ValueError):
                raise bad_request(f"{where}.arguments must be JSON text, got {arguments!r}", "input") from None
            assistant().setdefault("tool_calls", []).append(tool_call(item["call_id"], item["name"], arguments))
        else:
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where} (a function_call_output) needs the call_id it answers", "input")
            output = item.get("output")
            output = _content_of(output, where)  # (a tool's screenshot: input_image parts)
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
    for message in out:
        message.pop("_closed", None)
    return out
