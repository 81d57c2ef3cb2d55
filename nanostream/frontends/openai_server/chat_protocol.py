"""The chat endpoint's request body: messages as the chat template gets them, tools and tool_choice,
template options (pydantic)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from nanostream.errors import InvalidRequestError
from nanostream.frontends.openai_server.protocol import APIError, BaseRequest, Int64, bad_request
from nanostream.multimodal.chat import IMAGE_PART_TYPES  # the parts that carry an image
from nanostream.sampling_params import MAX_LOGPROBS


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    function: FunctionDefinition

    def for_template(self) -> dict[str, Any]:
        return self.model_dump(exclude_unset=True)


def function_tool(**function: Any) -> dict[str, Any]:
    """A chat request's tool from its function's fields (name, description, parameters, strict; None left out)."""
    return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


def tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """An assistant message's tool call as the chat template gets it (``arguments``: JSON text)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


def image_part(url: str) -> dict[str, Any]:
    """A chat message's image part (what the dialects translate theirs into): a data: URL, or an http(s) or file
    URL that the server's image policy then allows or refuses."""
    return {"type": "image_url", "image_url": {"url": url}}


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")  # an image part's image_url

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """A message as the chat template gets it: every field the client set, the content as text."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def text(self, index: int) -> str:
        """The content as one string; text parts are joined with newlines (as vLLM does)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.type not in IMAGE_PART_TYPES and (part.type != "text" or part.text is None):
                raise bad_request(
                    f"messages[{index}].content has a {part.type!r} part; this server takes text and image parts "
                    "(image_url): send the rest as text",
                    f"messages[{index}].content",
                )
        return "\n".join(part.text for part in self.content if part.type == "text")

    def for_template(self, index: int) -> dict[str, Any]:
        """The message as the chat template gets it: its text, or, with images, its text and image parts in order
        (each image part the template's to place; generation.py takes the images)."""
        content: str | list = self.text(index)
        if isinstance(self.content, list) and any(part.type in IMAGE_PART_TYPES for part in self.content):
            content = [part.model_dump(exclude_none=True) for part in self.content]
        return {**self.model_dump(exclude_unset=True), "content": content}


class ChatRequest(BaseRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's extra fields
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # leave the final message open: the reply continues it
    echo: bool = False  # the reply starts with the final message's content when it has the reply's role

    @property
    def role(self) -> str:
        """The reply's role: a new assistant message's, or (no generation prompt) the final message's, which
        the reply goes on with (vLLM's rule)."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    def echoed(self) -> str | None:
        """With ``echo``, the text the reply starts with: the final message's, if it has the reply's role."""
        last = self.messages[-1]
        if not self.echo or last.role != self.role:
            return None
        return last.text(len(self.messages) - 1) or None

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: set logprobs to true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template(i) for i, m in enumerate(self.messages)]


def template_error(exc: InvalidRequestError | ValueError) -> APIError:
    """The 400 of a conversation the chat template cannot render: naming the option at fault, else messages."""
    error = bad_request(str(exc))
    error.param = error.param or "messages"
    return error
