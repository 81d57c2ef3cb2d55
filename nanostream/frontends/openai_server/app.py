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
import msgspec
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from nanostream.client import AsyncClient
from nanostream.client.chat_template import check_template_kwargs, render_chat
from nanostream.client.reasoning import get_reasoning_parser
from nanostream.client.stream import Stream
from nanostream.errors import EngineDeadError, InvalidRequestError, NanostreamError
from nanostream.frontends.engine_wait import EngineWait
from nanostream.frontends.openai_server.chat_protocol import ChatRequest, template_error
from nanostream.frontends.openai_server.logprobs import TokenText
from nanostream.frontends.openai_server.metrics import Metrics
from nanostream.frontends.openai_server.protocol import (
    APIError,
    BaseRequest,
    CompletionRequest,
    api_error,
    bad_request,
)
from nanostream.frontends.openai_server.responses import Reply, ReplyOptions
from nanostream.frontends.openai_server.structured import constraint_of, tool_plan
from nanostream.frontends.openai_server.tokenization import Tokenization, version
from nanostream.frontends.openai_server.tool_parsers import ToolParser, get_tool_parser
from nanostream.frontends.openai_server.unsupported import check_supported
from nanostream.outputs import StreamChunk

log = logging.getLogger(__name__)
T = TypeVar("T")


# ---- responses ------------------------------------------------------------------------------------


# Characters JSON may carry raw that str.splitlines() breaks a line at: a client that splits the stream
# that way (httpx's aiter_lines) would get half an event. In UTF-8 they occur only inside strings.
_LINE_BREAKS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def _sse(data: dict[str, Any] | str) -> bytes:
    # msgspec's encoder: a third of json.dumps's time per event, and UTF-8 as is (ensure_ascii=False)
    body = data.encode() if isinstance(data, str) else msgspec.json.encode(data)
    if b"\xc2\x85" in body or b"\xe2\x80" in body:
        for raw, escaped in _LINE_BREAKS:
            body = body.replace(raw, escaped)
    return b"data: " + body + b"\n\n"


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


class _Server(Tokenization):
    """The routes' shared state: one AsyncClient, the served name, the API key, the metrics, the parsers."""

    reasoning_parser: str | None = None
    tool_parser: type[ToolParser] | None = None

    def __init__(
        self,
        client: Callable[[str | None], AsyncClient],
        api_key: str | None,
        served_model_name: str | None,
        engine_wait: EngineWait | None,
    ) -> None:
        self._new_client = client
        self.client: AsyncClient | None = None if engine_wait is not None else client(None)
        self.api_key = api_key
        self.served_model_name = served_model_name
        self.metrics = Metrics()
        self.tokens: TokenText | None = None
        self.started = int(time.time())
        self.engine_wait = engine_wait
        self.connected = False  # True once the client is connected (from then on it reconnects on its own)
        self.gave_up: str | None = None  # why the engine wait ended without an engine (the one-line error)
        self.on_give_up: Callable[[], None] = lambda: log.error("%s", self.gave_up)  # the frontend stops its server

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        if self.engine_wait is None:  # connect now: without an engine the app does not start
            async with self.client:
                self._connected()
                yield
            return
        # Serve at once (/health answers 503) and connect once an engine answers, within the wait.
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._wait_and_connect, self.engine_wait)
            yield
            tg.cancel_scope.cancel()  # still waiting: stop; connected: close the client

    def _connected(self) -> None:
        self.served_model_name = self.served_model_name or Path(self.client.model).name or self.client.model
        self.tokens = TokenText(self.client.tokenizer)
        self.connected = True

    async def _wait_and_connect(self, wait: EngineWait) -> None:
        """Find the engine, wait for it to listen, connect: all within ``wait``; then hold the client
        open until the lifespan cancels this at shutdown. A failure is ``gave_up``, not raised (this
        task runs beside the lifespan)."""
        try:
            address = await wait.find()
            while True:
                if not await wait.until_reachable(address):
                    raise EngineDeadError(wait.no_engine(address))
                client = self._new_client(address)
                try:
                    await client.connect()
                    break
                except EngineDeadError:  # listening, but the hello went unanswered: try again within the wait
                    if wait.left() <= 0:
                        raise
            try:
                self.client = client
                self._connected()
                await anyio.sleep_forever()
            finally:
                await client.close()
        except Exception as exc:
            self.gave_up = str(exc)
            self.on_give_up()

    def check_engine(self) -> None:
        """503 while the server waits for its engine at start (a dependency of every route that needs it)."""
        if self.connected:
            return
        wait = self.engine_wait
        where = f"the engine at {wait.engine}" if wait is not None and wait.engine else "a local engine"
        within = f" (up to {wait.seconds:g} s from its start)" if wait is not None else ""
        raise APIError(
            503,
            f"this server is waiting for {where} to answer{within}; retry shortly",
            type="service_unavailable",
            code="engine_unavailable",
        )

    async def check_key(self, request: Request) -> None:
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

    def _checked(self, body: BaseRequest) -> None:
        self.check_model(body.model)
        check_supported(body)
        body.check()

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self._checked(body)
        params = body.sampling_params(body.max_tokens, body.logprobs, constraint_of(body))
        if body.echo and body.logprobs is not None and params.prompt_logprobs is None:
            params = dataclasses.replace(params, prompt_logprobs=body.logprobs)  # the echoed prompt's logprobs
        tokenizer = self.client.tokenizer
        prompts = body.prompts_kept(tokenizer, self.client.max_model_len)
        stream = self.client.stream(prompts if len(prompts) > 1 else prompts[0], params)
        echo = [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts] if body.echo else None
        options = self._options(stream, body, chat=False, top_logprobs=body.logprobs)
        options.echo = echo
        return await self._respond(request, body, stream, Reply(options))

    async def chat_completions(self, body: ChatRequest, request: Request) -> Response:
        self._checked(body)
        logprobs = body.num_logprobs()
        plan = tool_plan(body, self.tool_parser)
        max_tokens = body.max_new_tokens()
        params = body.sampling_params(max_tokens, logprobs, constraint_of(body, plan))
        try:
            kwargs = check_template_kwargs(body.chat_template_kwargs)
        except ValueError as exc:
            raise bad_request(str(exc), "chat_template_kwargs") from None
        try:  # rendered here, not by AsyncClient.chat: the prompt may be left open, and truncated
            ids = render_chat(
                self.client.tokenizer,
                body.template_messages(),
                tools=plan.tools,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                chat_template_kwargs=kwargs,
            )
        except InvalidRequestError as exc:
            raise template_error(exc) from None
        ids = body.truncated(ids, self.client.max_model_len, max_tokens)
        stream = Stream(self.client.connection, ids, params, reasoning_parser=self.reasoning_parser)
        options = self._options(stream, body, chat=True, top_logprobs=logprobs)
        options.tool_parser = self.tool_parser if plan.parse else None
        options.reasoning = self.reasoning_parser is not None
        echoed = body.echoed()
        options.role, options.echo = body.role, None if echoed is None else [echoed]
        return await self._respond(request, body, stream, Reply(options))

    def _options(self, stream: Stream, body: BaseRequest, *, chat: bool, top_logprobs: int | None) -> ReplyOptions:
        return ReplyOptions(
            chat,
            self.served_model_name,
            stream.request_id,
            self.tokens,
            stream.prompts,
            n=stream.params.n,
            top_logprobs=top_logprobs,
            prompt_logprobs=body.prompt_logprobs is not None,
            continuous_usage=body.continuous_usage,
        )

    async def _respond(self, request: Request, body: BaseRequest, stream: Stream, reply: Reply) -> Response:
        chunks = self.metrics.timed(stream, "chat" if reply.o.chat else "completions")
        if not body.stream:
            got = await _unless_disconnected(request, lambda: _collected(chunks))
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
        self, reply: Reply, first: StreamChunk, chunks: AsyncIterator[StreamChunk], include_usage: bool
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

    async def health(self) -> dict[str, Any]:
        self.check_engine()
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
            self.check_engine()
            self.metrics.engine_stats(await self.client.stats())
        except (APIError, NanostreamError, TimeoutError):
            self.metrics.engine_stats(None)
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def _collected(chunks: AsyncIterator[StreamChunk]) -> list[StreamChunk]:
    return [chunk async for chunk in chunks]


def create_app(
    client: str | Callable[[], AsyncClient] | None = None,
    *,
    api_key: str | None = None,
    served_model_name: str | None = None,
    reasoning_parser: str | None = None,
    tool_call_parser: str | None = "hermes",
    engine_wait: EngineWait | None = None,
) -> FastAPI:
    """The OpenAI-compatible app; its lifespan connects one AsyncClient and closes it at shutdown.

    ``client`` is the engine's address (None: ``NANOSTREAM_ADDRESS``, else the one local engine) or a
    function that returns an unconnected AsyncClient (to choose its timeout, say). Without an engine
    the app does not start, unless ``engine_wait`` (frontends/engine_wait.py) is given: then it serves
    at once, answering 503 until it has connected, and gives up when the wait is over (its
    ``state.server.gave_up`` says why). With ``api_key`` every ``/v1`` request
    needs ``Authorization: Bearer KEY``. ``served_model_name`` is the model name that requests give
    and ``/v1/models`` lists (default: the name of the engine's model directory).
    ``reasoning_parser`` ("qwen3") returns a reply's ``<think>`` part as ``reasoning_content``;
    ``tool_call_parser`` (default "hermes", None: none) reads tool calls out of replies. Example::

        uvicorn.run(create_app("ipc:///run/nanostream.sock", api_key="sk-local"), port=8000)
    """
    if reasoning_parser is not None:
        get_reasoning_parser(reasoning_parser)  # ValueError naming the known ones
    parser = get_tool_parser(tool_call_parser) if tool_call_parser is not None else None
    if callable(client):
        factory = client
        new_client: Callable[[str | None], AsyncClient] = lambda address: factory()
        if engine_wait is not None and engine_wait.engine is None:
            engine_wait.engine = factory().address  # (a client that never connects: its address)
    else:
        new_client = lambda address: AsyncClient(address or client)
    server = _Server(new_client, api_key, served_model_name, engine_wait)
    server.reasoning_parser, server.tool_parser = reasoning_parser, parser
    app = FastAPI(title="nanostream OpenAI-compatible API", lifespan=server.lifespan)
    app.state.server = server

    async def error(request: Request, exc: Exception) -> JSONResponse:
        return api_error(exc).response()

    # Exception: an unexpected error still gets OpenAI's JSON (a 500); Starlette logs its traceback.
    for kind in (APIError, RequestValidationError, HTTPException, NanostreamError, TimeoutError, Exception):
        app.add_exception_handler(kind, error)

    v1 = {"dependencies": [Depends(server.check_key), Depends(server.check_engine)]}
    app.get("/v1/models", **v1)(server.models)
    app.get("/v1/models/{model:path}", **v1)(server.model)
    app.post("/v1/completions", **v1)(server.completions)
    app.post("/v1/chat/completions", **v1)(server.chat_completions)
    app.post("/tokenize", **v1)(server.tokenize)
    app.post("/detokenize", **v1)(server.detokenize)
    app.get("/version")(version)
    app.get("/health")(server.health)
    app.get("/metrics")(server.prometheus)
    return app
