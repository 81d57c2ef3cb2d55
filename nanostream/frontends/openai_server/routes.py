"""The routes the OpenAI-compatible server serves: ``create_app`` registers these, ``nanostream serve`` and
``nanostream frontend openai`` list them when they start (no FastAPI import here: a listing is cheap)."""

from __future__ import annotations

from typing import NamedTuple


class Route(NamedTuple):
    method: str
    path: str
    handler: str  # the server's method that answers it
    v1: bool = True  # behind the API key, and 503 until the engine answers


ROUTES = (
    Route("GET", "/v1/models", "models"),
    Route("GET", "/v1/models/{model:path}", "model"),
    Route("POST", "/v1/completions", "completions"),
    Route("POST", "/v1/chat/completions", "chat_completions"),
    Route("POST", "/v1/responses", "create_response"),
    Route("GET", "/v1/responses/{response_id}", "get_response"),
    Route("DELETE", "/v1/responses/{response_id}", "delete_response"),
    Route("POST", "/v1/messages", "create_message"),
    Route("POST", "/v1/messages/count_tokens", "count_tokens"),
    Route("POST", "/v1/embeddings", "embeddings"),
    Route("POST", "/tokenize", "tokenize"),
    Route("POST", "/detokenize", "detokenize"),
    Route("GET", "/version", "version", v1=False),
    Route("GET", "/health", "health", v1=False),
    Route("GET", "/metrics", "prometheus", v1=False),
)


def describe_routes(indent: str = "  ") -> str:
    """The routes, a line each: ``POST /v1/chat/completions``."""
    return "\n".join(f"{indent}{r.method:6} {r.path.replace(':path', '')}" for r in ROUTES)
