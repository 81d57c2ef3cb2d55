"""``POST /v1/responses`` (OpenAI's Responses API), ``GET`` and ``DELETE /v1/responses/{id}``: a thin
translation onto the chat route. The body becomes a ``ChatRequest`` (responses_protocol.py), runs as
a chat stream, and its reply's blocks (turn.py) become output items: ``reasoning``, ``message``,
``function_call``. Streamed, as the API's events in its order, each with its ``sequence_number``::

    response.created, response.in_progress,
    per item: response.output_item.added, [response.content_part.added,]
              response.output_text.delta | response.reasoning_text.delta | response.function_call_arguments.delta …,
              response.output_text.done | response.reasoning_text.done | response.function_call_arguments.done,
              [response.content_part.done,] response.output_item.done
    response.completed (response.incomplete when max_output_tokens ended it)
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError

from nanostream.frontends.openai_server.chat_protocol import tool_call
from nanostream.frontends.openai_server.protocol import APIError, api_error
from nanostream.frontends.openai_server.response_store import ResponseStore
from nanostream.frontends.openai_server.responses_protocol import ResponsesRequest
from nanostream.frontends.openai_server.sse import chained, deliver, named_event
from nanostream.frontends.openai_server.turn import Block, Step, Turn, new_id
from nanostream.outputs import StreamChunk

log = logging.getLogger(__name__)
_PREFIX = {"text": "msg_", "reasoning": "rs_", "call": "fc_"}


def _item(block: Block, item_id: str, opaque: bool = False) -> dict[str, Any]:
    """The output item of ``block``; ``opaque``: a reasoning item carries its text as encrypted_content too."""
    status = "completed" if block.done else "in_progress"
    if block.kind == "call":
        call = dict(call_id=block.call_id, name=block.name, arguments=block.text)
        return dict(type="function_call", id=item_id, **call, status=status)
    if block.kind == "reasoning":
        content = [{"type": "reasoning_text", "text": block.text}] if block.done else []
        encrypted = block.text if opaque and block.done else None
        return dict(
            type="reasoning", id=item_id, summary=[], content=content, encrypted_content=encrypted, status=status
        )
    content = [_text_part(block.text)] if block.done else []
    return dict(type="message", id=item_id, status=status, role="assistant", content=content)


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def as_chat_message(turn: Turn) -> dict[str, Any]:
    """The reply as the chat template's assistant message (what ``previous_response_id`` continues)."""
    message: dict[str, Any] = {"role": "assistant", "content": "".join(b.text for b in turn.blocks if b.kind == "text")}
    reasoning = "".join(b.text for b in turn.blocks if b.kind == "reasoning")
    if reasoning:
        message["reasoning_content"] = reasoning
    if turn.calls:
        message["tool_calls"] = [tool_call(b.call_id, b.name, b.text) for b in turn.calls]
    return message


class ResponseRender:
    """One response: the turn's steps as the API's events, and the response object."""

    def __init__(self, body: ResponsesRequest, model: str, turn: Turn, prompt_tokens: int, tokenizer: Any) -> None:
        self.body, self.model, self.turn, self.tokenizer = body, model, turn, tokenizer
        self.id, self.created = new_id("resp_"), int(time.time())
        self.prompt_tokens = prompt_tokens
        self.ids: dict[int, str] = {}  # block index -> item id
        self.opaque = "reasoning.encrypted_content" in (body.include or [])
        self.sequence = 0

    def item_id(self, block: Block) -> str:
        return self.ids.setdefault(block.index, new_id(_PREFIX[block.kind]))

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def step_events(self, step: Step) -> list[dict[str, Any]]:
        block = step.block
        where = dict(item_id=self.item_id(block), output_index=block.index)
        text_kind = "reasoning_text" if block.kind == "reasoning" else "output_text"
        if step.op == "delta":  # (the hot path: one event per chunk)
            if block.kind == "call":
                return [self.event("response.function_call_arguments.delta", **where, delta=step.text)]
            extra = {"logprobs": []} if block.kind == "text" else {}
            return [self.event(f"response.{text_kind}.delta", **where, content_index=0, delta=step.text, **extra)]
        item = _item(block, where["item_id"], self.opaque)
        part = {"type": "reasoning_text", "text": ""} if block.kind == "reasoning" else _text_part("")
        if step.op == "open":
            added = [self.event("response.output_item.added", output_index=block.index, item=item)]
            if block.kind != "call":
                added.append(self.event("response.content_part.added", **where, content_index=0, part=part))
            return added
        if block.kind == "call":
            done = [self.event("response.function_call_arguments.done", **where, name=block.name, arguments=block.text)]
        else:
            extra = {"logprobs": []} if block.kind == "text" else {}
            done = [
                self.event(f"response.{text_kind}.done", **where, content_index=0, text=block.text, **extra),
                self.event("response.content_part.done", **where, content_index=0, part={**part, "text": block.text}),
            ]
        return [*done, self.event("response.output_item.done", output_index=block.index, item=item)]

    def response(self, status: str) -> dict[str, Any]:
        body, turn = self.body, self.turn
        incomplete = status == "completed" and turn.finish_reason == "length"
        fmt = body.text.format if body.text is not None and body.text.format is not None else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": "incomplete" if incomplete else status,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": None,
            "model": self.model,
            "output": [_item(b, self.item_id(b), self.opaque) for b in turn.blocks] if status != "in_progress" else [],
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
            "store": body.store,
            "temperature": body.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [],
            "top_p": body.top_p,
            "truncation": "disabled",
            "usage": self.usage() if status != "in_progress" else None,
            "user": None,
            "metadata": body.metadata or {},
        }

    def usage(self) -> dict[str, Any]:
        u = self.turn.usage
        prompt, cached = (u.prompt_tokens, u.cached_tokens) if u else (self.prompt_tokens, 0)
        output = u.completion_tokens if u else 0
        reasoning = "".join(b.text for b in self.turn.blocks if b.kind == "reasoning")
        thought = len(self.tokenizer(reasoning, add_special_tokens=False).input_ids) if reasoning else 0
        return {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": min(thought, output)},
            "total_tokens": prompt + output,
        }


class ResponsesAPI:
    """The Responses routes of the server (``self.chat_stream``, ``self.check_model`` come from it)."""

    response_store: ResponseStore

    async def create_response(self, body: ResponsesRequest, request: Request) -> Response:
        self.check_model(body.model)
        body.check()
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            history = self._stored(body.previous_response_id, "previous_response_id").messages
        try:
            chat = body.chat_request(history)
        except ValidationError as exc:
            raise RequestValidationError(exc.errors()) from None
        stream, plan = await self.chat_stream(chat, where="input")
        turn = Turn(self.tool_parser if plan.parse else None)
        render = ResponseRender(body, self.served_model_name, turn, len(stream.prompt_token_ids), self.client.tokenizer)
        conversation = history + body.messages()
        chunks = self.metrics.timed(stream, "responses")

        def finished() -> dict[str, Any]:
            response = render.response("completed")
            if body.store:
                self.response_store.put(response, [*conversation, as_chat_message(turn)])
            return response

        def whole(got: list[StreamChunk]) -> dict[str, Any]:
            for chunk in got:
                turn.feed(chunk)
            return finished()

        async def events(first: StreamChunk) -> AsyncIterator[bytes]:
            async with contextlib.aclosing(chunks):
                yield named_event(render.event("response.created", response=render.response("in_progress")))
                yield named_event(render.event("response.in_progress", response=render.response("in_progress")))
                try:
                    async for chunk in chained(first, chunks):
                        for step in turn.feed(chunk):
                            for event in render.step_events(step):
                                yield named_event(event)
                    response = finished()
                    yield named_event(render.event(f"response.{response['status']}", response=response))
                except Exception as exc:
                    error = api_error(exc)
                    if error.status == 500:
                        log.error("error in a stream", exc_info=exc)
                    yield named_event(render.event("error", code=error.code, message=error.message, param=error.param))
                    failed = {**render.response("failed"), "error": {"code": error.code, "message": error.message}}
                    yield named_event(render.event("response.failed", response=failed))

        return await deliver(request, chunks, stream=body.stream, whole=whole, events=events)

    def _stored(self, response_id: str, param: str | None = None):
        stored = self.response_store.get(response_id)
        if stored is None:
            raise APIError(
                404,
                f"no stored response {response_id!r}: it was never stored (store: false), was deleted, or left this "
                "server's bounded store (--max-stored-responses, --max-stored-response-bytes)",
                type="invalid_request_error",
                param=param,
                code="response_not_found",
            )
        return stored

    async def get_response(self, response_id: str) -> dict[str, Any]:
        return self._stored(response_id).response

    async def delete_response(self, response_id: str) -> dict[str, Any]:
        self._stored(response_id)
        self.response_store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}
