"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (Anthropic's Messages API): a thin
translation onto the chat route. The body becomes a ``ChatRequest`` (messages_protocol.py), runs as a
chat stream, and its reply's blocks (turn.py) become content blocks: ``thinking``, ``text``,
``tool_use``. Streamed as Anthropic's events::

    message_start, per block: content_block_start, content_block_delta (text_delta | thinking_delta |
    input_json_delta) …, content_block_stop; message_delta (stop_reason, usage), message_stop

Errors, before or during a stream, are in Anthropic's shape (``{"type": "error", "error": {...}}``).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError

from nanostream.client.stream import Stream
from nanostream.frontends.openai_server.messages_protocol import CountTokensRequest, MessagesRequest, error_body
from nanostream.frontends.openai_server.protocol import api_error
from nanostream.frontends.openai_server.sse import chained, deliver, named_event
from nanostream.frontends.openai_server.turn import Block, Step, Turn, new_id
from nanostream.outputs import StreamChunk

log = logging.getLogger(__name__)


def _block(block: Block, whole: bool) -> dict[str, Any]:
    if block.kind == "text":
        return {"type": "text", "text": block.text if whole else ""}
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": block.text if whole else "", "signature": ""}
    return {"type": "tool_use", "id": block.call_id, "name": block.name, "input": _input(block.text) if whole else {}}


def _input(arguments: str) -> Any:
    """A call's arguments as the object ``input`` is (a call cut short by max_tokens: what parses, else {})."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _delta(step: Step) -> dict[str, Any]:
    kind = step.block.kind
    if kind == "text":
        return {"type": "text_delta", "text": step.text}
    if kind == "reasoning":
        return {"type": "thinking_delta", "thinking": step.text}
    return {"type": "input_json_delta", "partial_json": step.text}


class MessageRender:
    def __init__(self, body: MessagesRequest, model: str, turn: Turn, stream: Stream) -> None:
        self.body, self.model, self.turn, self.stream = body, model, turn, stream
        self.id = new_id("msg_")

    def message(self, whole: bool) -> dict[str, Any]:
        reason, stop = self.stop_reason() if whole else (None, None)
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [_block(b, True) for b in self.turn.blocks] if whole else [],
            "stop_reason": reason,
            "stop_sequence": stop,
            "usage": self.usage(whole),
        }

    def stop_reason(self) -> tuple[str | None, str | None]:
        reason = self.turn.finish_reason
        if reason == "tool_calls":
            return "tool_use", None
        if reason == "length":
            return "max_tokens", None
        matched = self.stream.group.samples[0].processor.stop_reason
        if isinstance(matched, str) and matched in (self.body.stop_sequences or []):
            return "stop_sequence", matched
        return "end_turn", None

    def usage(self, whole: bool) -> dict[str, Any]:
        u = self.turn.usage
        prompt = u.prompt_tokens if u else len(self.stream.prompt_token_ids)
        cached = u.cached_tokens if u else 0
        return {
            "input_tokens": prompt - cached,  # Anthropic's input_tokens leave out what came from the cache
            "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0,
            "output_tokens": u.completion_tokens if u and whole else 0,
        }

    def step_event(self, step: Step) -> dict[str, Any]:
        index = step.block.index
        if step.op == "open":
            return {"type": "content_block_start", "index": index, "content_block": _block(step.block, False)}
        if step.op == "delta":
            return {"type": "content_block_delta", "index": index, "delta": _delta(step)}
        return {"type": "content_block_stop", "index": index}


class MessagesAPI:
    """The Messages routes of the server (``self.chat_stream``, ``self.chat_inputs`` come from it)."""

    def _chat(self, body: MessagesRequest):
        self.check_model(body.model)
        body.check(self.reasoning_parser is not None)
        try:
            return body.chat_request()
        except ValidationError as exc:
            raise RequestValidationError(exc.errors()) from None

    async def count_tokens(self, body: CountTokensRequest) -> dict[str, int]:
        ids, *_ = await self.chat_inputs(self._chat(body))  # (images prepared: their tokens counted)
        return {"input_tokens": len(ids)}

    async def create_message(self, body: MessagesRequest, request: Request) -> Response:
        stream, plan = await self.chat_stream(self._chat(body))
        turn = Turn(self.tool_parser if plan.parse else None)
        render = MessageRender(body, self.served_model_name, turn, stream)
        chunks = self.metrics.timed(stream, "messages")

        def whole(got: list[StreamChunk]) -> dict[str, Any]:
            for chunk in got:
                turn.feed(chunk)
            return render.message(True)

        async def events(first: StreamChunk) -> AsyncIterator[bytes]:
            async with contextlib.aclosing(chunks):
                yield named_event({"type": "message_start", "message": render.message(False)})
                try:
                    async for chunk in chained(first, chunks):
                        for step in turn.feed(chunk):
                            yield named_event(render.step_event(step))
                    reason, stop = render.stop_reason()
                    usage = render.usage(True)
                    delta = {"stop_reason": reason, "stop_sequence": stop}
                    yield named_event({"type": "message_delta", "delta": delta, "usage": usage})
                    yield named_event({"type": "message_stop"})
                except Exception as exc:
                    error = api_error(exc)
                    if error.status == 500:
                        log.error("error in a stream", exc_info=exc)
                    yield named_event(error_body(error))

        return await deliver(request, chunks, stream=body.stream, whole=whole, events=events)
