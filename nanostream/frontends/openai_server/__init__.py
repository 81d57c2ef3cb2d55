"""An OpenAI-compatible HTTP server over ``AsyncClient``: ``nanostream frontend openai``.

    nanostream serve /models/Qwen3-0.6B &              # prints the engine's address
    nanostream frontend openai --engine ipc://... --port 8000 --api-key sk-local

    from openai import OpenAI
    api = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="sk-local")
    api.chat.completions.create(model="Qwen3-0.6B", messages=[{"role": "user", "content": "Hi"}])

Endpoints: ``GET /v1/models``, ``POST /v1/completions`` and ``POST /v1/chat/completions`` (JSON, or
server-sent events with ``"stream": true``), ``POST /tokenize`` and ``POST /detokenize`` (vLLM's
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
503 when the engine cannot be reached. An error after a stream started is sent as an SSE event
``data: {"error": ...}``, then ``data: [DONE]``.
"""

from __future__ import annotations

import argparse
import os
import sys

from nanostream.client.reasoning import REASONING_PARSERS
from nanostream.frontends import Frontend
from nanostream.frontends.openai_server.app import create_app
from nanostream.frontends.openai_server.tool_parsers import TOOL_PARSERS

__all__ = ["OpenAIServer", "create_app"]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
API_KEY_ENV = "NANOSTREAM_API_KEY"


def app_options(args: argparse.Namespace) -> dict:
    """create_app's keyword arguments from the command line (one server process, or each worker)."""
    return dict(
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=None if args.tool_call_parser == "none" else args.tool_call_parser,
    )


class OpenAIServer(Frontend):
    """``nanostream frontend openai``: the OpenAI-compatible HTTP API on uvicorn."""

    description = "OpenAI-compatible HTTP API: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics"

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

    def run(self, args: argparse.Namespace) -> int:
        import uvicorn

        if args.workers < 1:
            print("nanostream frontend openai: --workers must be at least 1", file=sys.stderr)
            return 2
        try:
            app = create_app(args.engine, **app_options(args))
        except ValueError as exc:
            print(f"nanostream frontend openai: {exc}", file=sys.stderr)
            return 2
        from nanostream.discovery import reachable
        from nanostream.frontends.openai_server.workers import listen, serve_workers

        address = app.state.server.client.address
        if not reachable(address):
            print(f"nanostream frontend openai: no engine answers at {address}: start one with `nanostream serve`, "
                  "or pass its --engine ADDR", file=sys.stderr)  # fmt: skip
            return 1
        sock = listen(args.host, args.port)
        if sock is None:
            return 2
        if args.workers > 1:
            return serve_workers(args, sock)
        server = uvicorn.Server(uvicorn.Config(app))
        server.run(sockets=[sock])  # until Ctrl-C or SIGTERM
        return 0 if server.started else 1
