"""``POST /tokenize``, ``POST /detokenize`` (vLLM's request and response shapes) and ``GET /version``.

    POST /tokenize {"prompt": "Hi there"}                          -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /tokenize {"messages": [...], "add_generation_prompt": true, "tools": [...], "chat_template_kwargs": {...}}
    POST /tokenize {"messages": [..., {"role": "assistant", "content": "Sure"}], "add_generation_prompt": false,
                    "continue_final_message": true}                # the final message left open
    POST /detokenize {"tokens": [9707, 1052]}                      -> {"prompt": "Hi there"}

A chat body is rendered exactly as /v1/chat/completions renders it (client/chat_template.py).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

import nanostream
from nanostream.client.chat_template import render_chat
from nanostream.errors import InvalidRequestError
from nanostream.frontends.openai_server.chat_protocol import ChatMessage, Tool, template_error
from nanostream.frontends.openai_server.protocol import Int64, bad_request


class TokenizeRequest(BaseModel):
    """Either ``prompt`` (text) or ``messages`` (a conversation through the chat template)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (the template adds them)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[Int64] = Field(max_length=10**6)


async def version() -> dict[str, str]:
    return {"version": nanostream.__version__}


class Tokenization:
    """The tokenizer routes of the server (``self.client``, ``self.check_model`` come from it)."""

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        tokenizer = self.client.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give either prompt (text) or messages (a conversation), not both or neither")
        if body.prompt is not None:
            for name in ("tools", "chat_template_kwargs", "continue_final_message"):
                if getattr(body, name) not in (None, False):
                    raise bad_request(f"{name} goes with messages, not with prompt", name)
            ids = tokenizer(body.prompt, add_special_tokens=body.add_special_tokens is not False).input_ids
        else:
            try:
                ids = render_chat(
                    tokenizer,
                    [m.for_template(i) for i, m in enumerate(body.messages)],
                    tools=[t.for_template() for t in body.tools] if body.tools else None,
                    add_generation_prompt=body.add_generation_prompt,
                    continue_final_message=body.continue_final_message,
                    chat_template_kwargs=body.chat_template_kwargs,
                    add_special_tokens=bool(body.add_special_tokens),
                )
            except (InvalidRequestError, ValueError) as exc:
                raise template_error(exc) from None
        strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.client.max_model_len, "tokens": ids, "token_strs": strs}

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, str]:
        self.check_model(body.model)
        tokenizer = self.client.tokenizer
        size = len(tokenizer)
        bad = next(((i, t) for i, t in enumerate(body.tokens) if not 0 <= t < size), None)
        if bad is not None:
            raise bad_request(f"tokens[{bad[0]}] is {bad[1]}, outside the tokenizer's vocabulary [0, {size})", "tokens")
        return {"prompt": tokenizer.decode(body.tokens)}
