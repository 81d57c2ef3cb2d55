"""A reply on the wire: server-sent events, or one JSON body when the request did not stream; and an HTTP
client's disconnect before the first byte.

    first chunk (awaited: a rejected request is still a plain HTTP error) ──▶ ``data: {...}`` per chunk
    ──▶ ``data: {usage}`` (``include_usage``) ──▶ ``data: [DONE]``; an error mid-stream ``data: {"error"}``
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from nanostream.frontends.openai_server.protocol import api_error
from nanostream.frontends.openai_server.responses import Reply
from nanostream.outputs import StreamChunk

log = logging.getLogger(__name__)
T = TypeVar("T")


async def respond(
    request: Request, chunks: AsyncIterator[StreamChunk], reply: Reply, *, stream: bool, include_usage: bool
) -> Response:
    """The HTTP response of ``chunks``: 499 (nothing sent) when the client disconnects before the first."""
    return await deliver(
        request,
        chunks,
        stream=stream,
        whole=reply.whole,
        events=lambda first: _events(reply, first, chunks, include_usage),
    )


async def deliver(
    request: Request,
    chunks: AsyncIterator[StreamChunk],
    *,
    stream: bool,
    whole: Callable[[list[StreamChunk]], dict[str, Any]],
    events: Callable[[StreamChunk], AsyncIterator[bytes]],
) -> Response:
    """Any dialect's response of ``chunks``: ``whole(all chunks)`` as JSON, or the bytes of ``events(first)``
    (which reads the rest of ``chunks`` and closes them) as server-sent events; 499 (nothing sent) when the
    client disconnects before the first chunk."""
    if not stream:
        got = await _unless_disconnected(request, lambda: _collected(chunks))
        return JSONResponse(whole(got)) if got is not None else Response(status_code=499)
    # The first chunk before the first byte: a rejected request is still a plain HTTP error.
    first = await _unless_disconnected(request, chunks.__anext__)
    if first is None:
        return Response(status_code=499)
    return StreamingResponse(events(first), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# Characters JSON may carry raw that str.splitlines() breaks a line at: a client that splits the stream
# that way (httpx's aiter_lines) would get half an event. In UTF-8 they occur only inside strings.
_LINE_BREAKS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def _sse(data: dict[str, Any] | str, event: str | None = None) -> bytes:
    # msgspec's encoder: a third of json.dumps's time per event, and UTF-8 as is (ensure_ascii=False)
    body = data.encode() if isinstance(data, str) else msgspec.json.encode(data)
    if b"\xc2\x85" in body or b"\xe2\x80" in body:
        for raw, escaped in _LINE_BREAKS:
            body = body.replace(raw, escaped)
    head = b"" if event is None else b"event: " + event.encode() + b"\n"
    return head + b"data: " + body + b"\n\n"


def named_event(data: dict[str, Any]) -> bytes:
    """A server-sent event named by its data's ``type`` (the Responses and Messages APIs' form)."""
    return _sse(data, data["type"])


async def _unless_disconnected(request: Request, work: Callable[[], Awaitable[T]]) -> T | None:
    """``await work()``, or cancel it and return None if the HTTP client disconnects first.

    Starlette notices a disconnect only while it streams a response; before that, this does.
    """
    result: list[T] = []
    failure: list[Exception] = []
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            try:
                result.append(await work())
            except Exception as exc:  # raised below, bare, rather than in an ExceptionGroup
                failure.append(exc)
            tg.cancel_scope.cancel()

        tg.start_soon(run)
        while (await request.receive())["type"] != "http.disconnect":
            pass
        tg.cancel_scope.cancel()
    if failure:
        raise failure[0]
    return result[0] if result else None


async def _events(
    reply: Reply, first: StreamChunk, chunks: AsyncIterator[StreamChunk], include_usage: bool
) -> AsyncIterator[bytes]:
    async with contextlib.aclosing(chunks):  # a cancelled response closes the stream: abort
        try:
            if reply.o.chat:
                for event in reply.role_events():
                    yield _sse(event)
            if (event := reply.event(first)) is not None:
                yield _sse(event)
            async for chunk in chunks:
                if (event := reply.event(chunk)) is not None:
                    yield _sse(event)
            if include_usage:
                yield _sse(reply.usage_event())
        except Exception as exc:
            error = api_error(exc)
            if error.status == 500:
                log.error("error in a stream", exc_info=exc)
            yield _sse(error.body())
        yield _sse("[DONE]")


async def chained(first: StreamChunk, chunks: AsyncIterator[StreamChunk]) -> AsyncIterator[StreamChunk]:
    """``first``, then the rest of ``chunks``: what an ``events`` function of ``deliver`` walks."""
    yield first
    async for chunk in chunks:
        yield chunk


async def _collected(chunks: AsyncIterator[StreamChunk]) -> list[StreamChunk]:
    return [chunk async for chunk in chunks]
