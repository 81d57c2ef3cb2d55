"""The FastAPI app: routes, JSON and SSE responses, disconnects, and ``create_app``."""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio
import jinja2
import msgspec
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from nanostream.client import AsyncClient
from nanostream.client.stream import Stream
from nanostream.errors import NanostreamError
from nanostream.frontends.openai_server.logprobs import TextOffsets, TokenText, chat_logprobs, completion_logprobs
from nanostream.frontends.openai_server.metrics import Metrics
from nanostream.frontends.openai_server.protocol import (
    APIError,
    BaseRequest,
    ChatRequest,
    CompletionRequest,
    api_error,
    bad_request,
)
from nanostream.outputs import Completion, StreamChunk
from nanostream.protocol import Usage

log = logging.getLogger(__name__)
T = TypeVar("T")


# ---- responses ------------------------------------------------------------------------------------


def _usage(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


@dataclasses.dataclass
class _Reply:
    """How one request's output becomes OpenAI's JSON: a chat completion or a text completion."""

    chat: bool
    model: str
    request_id: str
    tokens: TokenText
    top_logprobs: int | None  # None: no logprobs asked for
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    offsets: TextOffsets = dataclasses.field(default_factory=TextOffsets)  # for completions' logprobs

    def whole(self, chunk: Completion) -> dict[str, Any]:
        """The non-streaming response, from every chunk merged into one."""
        return self._object([self._choice(chunk, "message")], usage=chunk.usage)

    def event(self, chunk: StreamChunk) -> dict[str, Any]:
        return self._object([self._choice(chunk, "delta")], streamed=True)

    def role_event(self) -> dict[str, Any]:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return self._object([choice], streamed=True)

    def usage_event(self, usage: Usage) -> dict[str, Any]:
        return self._object([], streamed=True, usage=usage)

    def _object(self, choices: list[dict], *, streamed: bool = False, usage: Usage | None = None) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if streamed else "chat.completion") if self.chat else "text_completion"
        prefix = "chatcmpl-" if self.chat else "cmpl-"
        out = {"id": prefix + self.request_id, "object": kind, "created": self.created, "model": self.model}
        out["choices"] = choices
        if usage is not None:
            out["usage"] = _usage(usage)
        return out

    def _choice(self, chunk: StreamChunk | Completion, key: str) -> dict[str, Any]:
        if self.chat:
            message = {"role": "assistant", "content": chunk.text} if key == "message" else {"content": chunk.text}
            choice: dict[str, Any] = {"index": 0, key: message, "logprobs": None}
        else:
            choice = {"index": 0, "text": chunk.text, "logprobs": None}
        if self.top_logprobs is not None and chunk.logprobs is not None:
            if self.chat:
                choice["logprobs"] = chat_logprobs(self.tokens, chunk.token_ids, chunk.logprobs, self.top_logprobs)
            else:
                choice["logprobs"] = completion_logprobs(self.tokens, chunk.token_ids, chunk.logprobs, self.offsets)
        choice["finish_reason"] = chunk.finish_reason
        return choice


def _sse(data: dict[str, Any] | str) -> bytes:
    # msgspec's encoder: a third of json.dumps's time per event, and UTF-8 as is (ensure_ascii=False)
    return b"data: " + (data.encode() if isinstance(data, str) else msgspec.json.encode(data)) + b"\n\n"


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


# ---- the app --------------------------------------------------------------------------------------


class _Server:
    """The routes' shared state: one AsyncClient, the served name, the API key, the metrics."""

    def __init__(self, client: AsyncClient, api_key: str | None, served_model_name: str | None) -> None:
        self.client = client
        self.api_key = api_key
        self.served_model_name = served_model_name
        self.metrics = Metrics()
        self.tokens: TokenText | None = None
        self.started = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        async with self.client:
            self.served_model_name = self.served_model_name or Path(self.client.model).name or self.client.model
            self.tokens = TokenText(self.client.tokenizer)
            yield

    def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise APIError(401, "no API key: send the header 'Authorization: Bearer KEY'", code="invalid_api_key")
        if not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            raise APIError(401, "incorrect API key: use the server's --api-key", code="invalid_api_key")

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_model_name:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {self.served_model_name!r} (GET /v1/models)",
                param="model",
                code="model_not_found",
            )

    # ---- routes

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._model_card()]}

    async def model(self, model: str) -> dict[str, Any]:
        self.check_model(model)
        return self._model_card()

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.served_model_name,
            "object": "model",
            "created": self.started,
            "owned_by": "nanostream",
            "root": self.client.model,
            "max_model_len": self.client.max_model_len,
        }

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        body.check_supported()
        params = body.sampling_params(body.max_tokens, body.logprobs)
        stream = self.client.stream(body.prompt, params)
        return await self._respond(request, body, stream, chat=False, top_logprobs=body.logprobs)

    async def chat_completions(self, body: ChatRequest, request: Request) -> Response:
        self.check_model(body.model)
        logprobs = body.num_logprobs()
        params = body.sampling_params(body.max_completion_tokens or body.max_tokens, logprobs)
        messages = [{"role": m.role, "content": m.text(i)} for i, m in enumerate(body.messages)]
        try:
            stream = self.client.chat(messages, params)
        except jinja2.TemplateError as exc:
            raise bad_request(f"the model's chat template refused these messages: {exc}", "messages") from None
        return await self._respond(request, body, stream, chat=True, top_logprobs=logprobs)

    async def _respond(
        self, request: Request, body: BaseRequest, stream: Stream, *, chat: bool, top_logprobs: int | None
    ) -> Response:
        reply = _Reply(chat, self.served_model_name, stream.request_id, self.tokens, top_logprobs)
        chunks = self.metrics.timed(stream, "chat" if chat else "completions")
        if not body.stream:
            got = await _unless_disconnected(request, lambda: _merged(stream, chunks))
            return JSONResponse(reply.whole(got)) if got is not None else Response(status_code=499)
        # The first chunk before the first byte: a rejected request is still a plain HTTP error.
        first = await _unless_disconnected(request, chunks.__anext__)
        if first is None:
            return Response(status_code=499)
        return StreamingResponse(
            self._events(reply, first, chunks, body.include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    async def _events(
        self, reply: _Reply, first: StreamChunk, chunks: AsyncIterator[StreamChunk], include_usage: bool
    ) -> AsyncIterator[bytes]:
        async with contextlib.aclosing(chunks):  # a cancelled response closes the stream: abort
            try:
                if reply.chat:
                    yield _sse(reply.role_event())
                chunk = first
                yield _sse(reply.event(chunk))
                async for chunk in chunks:
                    yield _sse(reply.event(chunk))
                if include_usage:
                    yield _sse(reply.usage_event(chunk.usage))
            except Exception as exc:
                error = api_error(exc)
                if error.status == 500:
                    log.error("error in a stream", exc_info=exc)
                yield _sse(error.body())
            yield _sse("[DONE]")

    async def health(self) -> dict[str, Any]:
        stats = await self.client.stats()  # raises when the engine does not answer: 503
        self.metrics.engine_stats(stats)
        return {
            "status": "ok",
            "model": self.served_model_name,
            "running": stats.running,
            "waiting": stats.waiting,
            "kv_cache_usage": 1 - stats.free_kv_blocks / max(stats.total_kv_blocks, 1),
        }

    async def prometheus(self) -> Response:
        try:
            self.metrics.engine_stats(await self.client.stats())
        except (NanostreamError, TimeoutError):
            self.metrics.engine_stats(None)
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def _merged(stream: Stream, chunks: AsyncIterator[StreamChunk]) -> Completion:
    """Every chunk of a stream as one, as ``AsyncClient.generate`` merges them."""
    return Completion.of(stream.request_id, [chunk async for chunk in chunks], stream.params.logprobs is not None)


def create_app(
    client: str | Callable[[], AsyncClient] | None = None,
    *,
    api_key: str | None = None,
    served_model_name: str | None = None,
) -> FastAPI:
    """The OpenAI-compatible app; its lifespan connects one AsyncClient and closes it at shutdown.

    ``client`` is the engine's address (None: ``NANOSTREAM_ADDRESS``) or a function that returns an
    unconnected AsyncClient (to choose its timeout, say). With ``api_key`` every ``/v1`` request
    needs ``Authorization: Bearer KEY``. ``served_model_name`` is the model name that requests give
    and ``/v1/models`` lists (default: the name of the engine's model directory). Example::

        uvicorn.run(create_app("ipc:///run/nanostream.sock", api_key="sk-local"), port=8000)
    """
    server = _Server(client() if callable(client) else AsyncClient(client), api_key, served_model_name)
    app = FastAPI(title="nanostream OpenAI-compatible API", lifespan=server.lifespan)
    app.state.server = server

    async def error(request: Request, exc: Exception) -> JSONResponse:
        return api_error(exc).response()

    # Exception: an unexpected error still gets OpenAI's JSON (a 500); Starlette logs its traceback.
    for kind in (APIError, RequestValidationError, HTTPException, NanostreamError, TimeoutError, Exception):
        app.add_exception_handler(kind, error)

    v1 = {"dependencies": [Depends(server.check_key)]}
    app.get("/v1/models", **v1)(server.models)
    app.get("/v1/models/{model:path}", **v1)(server.model)
    app.post("/v1/completions", **v1)(server.completions)
    app.post("/v1/chat/completions", **v1)(server.chat_completions)
    app.get("/health")(server.health)
    app.get("/metrics")(server.prometheus)
    return app
