"""An OpenAI-compatible HTTP server over ``AsyncClient``: ``nanostream frontend openai``.

    nanostream serve /models/Qwen3-0.6B &              # prints the engine's address
    nanostream frontend openai --engine ipc://... --port 8000 --api-key sk-local

    from openai import OpenAI
    api = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="sk-local")
    api.chat.completions.create(model="Qwen3-0.6B", messages=[{"role": "user", "content": "Hi"}])

Endpoints (routes.py): ``GET /v1/models``, ``POST /v1/completions`` and ``POST /v1/chat/completions`` (JSON, or
server-sent events with ``"stream": true``), OpenAI's Responses API (``/v1/responses``, openai_responses.py) and
Anthropic's Messages API (``/v1/messages``, anthropic_messages.py) translated onto the chat route,
``POST /tokenize`` and ``POST /detokenize`` (vLLM's
shapes), ``GET /version``, ``GET /health`` (a round trip to the engine) and ``GET /metrics``
(Prometheus). One AsyncClient, connected in the app's lifespan, carries every request.

Beyond plain text: ``n`` choices, ``response_format`` and vLLM's ``structured_outputs`` (structured.py),
``tools`` and ``tool_choice`` (tool_parsers.py), ``--reasoning-parser qwen3`` (``reasoning_content``),
``chat_template_kwargs``, ``logit_bias``, ``echo`` and ``prompt_logprobs``. A field this server does not
implement and that would change the result is a 400 naming it (unsupported.py).

A request's life: pydantic validates the body → ``SamplingParams`` → ``client.stream``/``client.chat``
→ the server waits for the first chunk, so a request the engine rejects is an HTTP 400 and not a
broken stream → one JSON response, or one SSE event per chunk. An HTTP client that disconnects
cancels the handler; that closes the nanostream ``Stream``, which aborts the request in the engine.

Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for a request that
can never run (the message says what to change), 401 for a wrong API key, 404 for an unknown model,
503 when the engine cannot be reached, and while the server waits for it at start
(``--engine-wait``, frontends/engine_wait.py). An error after a stream started is sent as an SSE
event ``data: {"error": ...}``, then ``data: [DONE]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import anyio

from nanostream.client.reasoning import REASONING_PARSERS
from nanostream.frontends import Frontend
from nanostream.frontends.engine_wait import EngineWait, add_engine_wait_argument
from nanostream.frontends.openai_server.app import create_app
from nanostream.frontends.openai_server.response_store import DEFAULT_MAX_BYTES, DEFAULT_MAX_RESPONSES, ResponseStore
from nanostream.frontends.openai_server.tool_parsers import TOOL_PARSERS
from nanostream.multimodal.policy import ImagePolicy

__all__ = ["OpenAIServer", "create_app"]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
API_KEY_ENV = "NANOSTREAM_API_KEY"
PROG = "nanostream frontend openai"


def app_options(args: argparse.Namespace, worker: bool = False) -> dict:
    """create_app's keyword arguments from the command line (one server process, or a worker of
    several: they wait for the engine until the same moment, and the parent says what for)."""
    wait = EngineWait(args.engine, args.engine_wait, PROG, announce=not worker, start=args.started)
    return dict(
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=None if args.tool_call_parser == "none" else args.tool_call_parser,
        engine_wait=wait,
        response_store=ResponseStore(args.max_stored_responses, args.max_stored_response_bytes),
        image_policy=ImagePolicy(
            allowed_domains=frozenset(args.allowed_media_domains or ()),
            allowed_local_path=args.allowed_local_media_path,
        ),
    )


class OpenAIServer(Frontend):
    """``nanostream frontend openai``: the OpenAI-compatible HTTP API on uvicorn."""

    description = (
        "OpenAI-compatible HTTP API: /v1/chat/completions, /v1/completions, /v1/responses, /v1/messages "
        "(Anthropic's), /v1/models, /health, /metrics"
    )

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--host", default=DEFAULT_HOST, help="interface to listen on (default %(default)s)")
        parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (default %(default)s)")
        parser.add_argument(
            "--api-key",
            default=os.environ.get(API_KEY_ENV),
            help=f"require 'Authorization: Bearer KEY' on /v1 requests (default: ${API_KEY_ENV}, else none)",
        )
        parser.add_argument(
            "--served-model-name", help="the model name requests use (default: the engine's model directory name)"
        )
        parser.add_argument(
            "--workers",
            type=int,
            default=1,
            help="server processes on the one port, each with its own engine connection: one serves about "
            "5,000 streamed events/s; use several for hundreds of concurrent streams (default %(default)s)",
        )
        add_engine_wait_argument(parser)
        parser.add_argument(
            "--reasoning-parser",
            choices=sorted(REASONING_PARSERS),
            help="return the <think> part of replies as reasoning_content (default: none, all is content)",
        )
        parser.add_argument(
            "--tool-call-parser",
            default="hermes",
            choices=[*sorted(TOOL_PARSERS), "none"],
            help="read tool calls out of replies in this format (default %(default)s: Qwen's <tool_call> JSON)",
        )
        parser.add_argument(
            "--allowed-media-domains",
            nargs="+",
            metavar="DOMAIN",
            help="images may come from http(s) URLs of these hosts (and their subdomains); default: none, data: "
            "URLs only",
        )
        parser.add_argument(
            "--allowed-local-media-path",
            metavar="DIR",
            help="images may come from file:// URLs and paths under this directory (default: none)",
        )
        parser.add_argument(
            "--max-stored-responses",
            type=int,
            default=DEFAULT_MAX_RESPONSES,
            help="the Responses API's stored responses (store: true) kept in this process's memory, the least "
            "recently used leaving first; 0 keeps none (default %(default)s)",
        )
        parser.add_argument(
            "--max-stored-response-bytes",
            type=int,
            default=DEFAULT_MAX_BYTES,
            help="the bytes (as JSON) those stored responses may take at most (default %(default)s: 64 MiB)",
        )

    def run(self, args: argparse.Namespace) -> int:
        import uvicorn

        from nanostream.frontends.openai_server.workers import listen, serve_workers

        if args.workers < 1:
            print(f"{PROG}: --workers must be at least 1", file=sys.stderr)
            return 2
        args.started = time.monotonic()  # the engine wait's start, for every worker
        try:
            app = create_app(args.engine, **app_options(args))  # (checks the options; a worker makes its own)
        except ValueError as exc:
            print(f"{PROG}: {exc}", file=sys.stderr)
            return 2
        if args.engine_wait == 0:  # fail at once: one line, before anything is served
            wait = app_options(args)["engine_wait"]
            try:
                address = anyio.run(wait.find)
            except ValueError as exc:  # no local engine, or several: pass --engine
                print(f"{PROG}: {exc}", file=sys.stderr)
                return 2
            if not anyio.run(wait.until_reachable, address):
                print(f"{PROG}: {wait.no_engine(address)}", file=sys.stderr)
                return 1
        sock = listen(args.host, args.port)
        if sock is None:
            return 2
        if args.workers > 1:
            app_options(args)["engine_wait"].announce_if_absent()  # for every worker (they say nothing)
            return serve_workers(args, sock)
        server = uvicorn.Server(uvicorn.Config(app))
        state = app.state.server
        state.on_give_up = lambda: setattr(server, "should_exit", True)
        server.run(sockets=[sock])  # until Ctrl-C or SIGTERM, or until the engine wait gives up
        if state.gave_up is not None:
            print(f"{PROG}: {state.gave_up}", file=sys.stderr)
            return 1
        return 0 if server.started else 1
