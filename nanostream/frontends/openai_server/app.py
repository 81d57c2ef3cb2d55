"""The FastAPI app: the server's state (one AsyncClient, connected in the lifespan or once the engine
answers), the checks every route shares, the models, health and metrics routes, and ``create_app``.
The generating routes are generation.py's, the tokenizer routes tokenization.py's."""

from __future__ import annotations

import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from nanostream.client import AsyncClient
from nanostream.client.reasoning import get_reasoning_parser
from nanostream.errors import EngineDeadError, NanostreamError
from nanostream.frontends.engine_wait import EngineWait
from nanostream.frontends.openai_server.anthropic_messages import MessagesAPI
from nanostream.frontends.openai_server.embeddings import EmbeddingsAPI
from nanostream.frontends.openai_server.generation import Generation
from nanostream.frontends.openai_server.logprobs import TokenText
from nanostream.frontends.openai_server.messages_protocol import anthropic_error
from nanostream.frontends.openai_server.metrics import Metrics
from nanostream.frontends.openai_server.openai_responses import ResponsesAPI
from nanostream.frontends.openai_server.protocol import APIError, api_error
from nanostream.frontends.openai_server.response_store import ResponseStore
from nanostream.frontends.openai_server.routes import ROUTES
from nanostream.frontends.openai_server.tokenization import Tokenization, version
from nanostream.frontends.openai_server.tool_parsers import ToolParser, get_tool_parser
from nanostream.multimodal.policy import ImagePolicy

log = logging.getLogger(__name__)


class _Server(Generation, ResponsesAPI, MessagesAPI, EmbeddingsAPI, Tokenization):
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
        if "x-api-key" in request.headers:  # Anthropic's clients' header
            scheme, key = "bearer", request.headers["x-api-key"]
        if scheme.lower() != "bearer" or not key.strip():
            how = "send the header 'Authorization: Bearer KEY' (or 'x-api-key: KEY')"
            raise APIError(401, f"no API key: {how}", code="invalid_api_key")
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
            "input_modalities": ["text", "image"] if self.client.image_preparer()[0] is not None else ["text"],
        }

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


def create_app(
    client: str | Callable[[], AsyncClient] | None = None,
    *,
    api_key: str | None = None,
    served_model_name: str | None = None,
    reasoning_parser: str | None = None,
    tool_call_parser: str | None = "hermes",
    engine_wait: EngineWait | None = None,
    response_store: ResponseStore | None = None,
    image_policy: ImagePolicy | None = None,
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
    ``tool_call_parser`` (default "hermes", None: none) reads tool calls out of replies.
    ``response_store`` keeps the Responses API's stored responses (default: a ``ResponseStore()``). ``image_policy``:
    where a vision-language model's images may come from (default: data URLs only). Example::

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
    server.response_store = response_store if response_store is not None else ResponseStore()
    server.image_policy = image_policy if image_policy is not None else ImagePolicy()
    app = FastAPI(title="nanostream OpenAI-compatible API", lifespan=server.lifespan)
    app.state.server = server

    async def error(request: Request, exc: Exception) -> JSONResponse:
        if request.url.path.startswith("/v1/messages"):  # Anthropic's clients read Anthropic's shape
            return anthropic_error(api_error(exc))
        return api_error(exc).response()

    # Exception: an unexpected error still gets OpenAI's JSON (a 500); Starlette logs its traceback.
    for kind in (APIError, RequestValidationError, HTTPException, NanostreamError, TimeoutError, Exception):
        app.add_exception_handler(kind, error)

    v1 = {"dependencies": [Depends(server.check_key), Depends(server.check_engine)]}
    for route in ROUTES:  # (routes.py: what `nanostream serve` lists)
        handler = version if route.handler == "version" else getattr(server, route.handler)
        app.add_api_route(route.path, handler, methods=[route.method], **(v1 if route.v1 else {}))
    return app
