"""Errors in OpenAI's JSON shape, and the request bodies the server accepts (pydantic)."""

from __future__ import annotations

import dataclasses
import re
from typing import Annotated, Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException

from nanostream.errors import (
    ClientClosedError,
    EngineBusyError,
    EngineDeadError,
    InvalidRequestError,
    RequestFailedError,
    RequestTimeoutError,
)
from nanostream.sampling_params import MAX_LOGPROBS, SamplingParams

# ---- errors ---------------------------------------------------------------------------------------


class APIError(Exception):
    """An HTTP error with OpenAI's body: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


RETRY_AFTER_S = 1  # what a 429 tells the HTTP client to wait: the engine's queues drain in about that

_PARAM = re.compile(r"^(\w+) must\b")  # SamplingParams' messages start with the field at fault


def bad_request(message: str, param: str | None = None) -> APIError:
    if param is None and (m := _PARAM.match(message)):
        param = m.group(1)
    return APIError(400, message, param=param)


def api_error(exc: BaseException) -> APIError:
    """The HTTP error for an exception from validation, the client or the engine."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestValidationError):
        return _validation_error(exc)
    if isinstance(exc, HTTPException):
        return APIError(exc.status_code, str(exc.detail), type="invalid_request_error")
    if isinstance(exc, InvalidRequestError):
        return bad_request(str(exc))
    if isinstance(exc, EngineBusyError):
        headers = {"Retry-After": str(RETRY_AFTER_S)}
        return APIError(429, str(exc), type="rate_limit_error", code="engine_busy", headers=headers)
    if isinstance(exc, RequestTimeoutError):
        return APIError(504, str(exc), type="timeout_error", code="request_timeout")
    if isinstance(exc, RequestFailedError):
        return APIError(500, str(exc), type="server_error", code="request_failed")
    if isinstance(exc, (EngineDeadError, ClientClosedError, TimeoutError)):
        why = str(exc) or "it did not answer in time"
        return APIError(503, f"the engine is unavailable: {why}", type="service_unavailable", code="engine_unavailable")
    return APIError(500, f"internal server error ({type(exc).__name__}); see the server's log", type="server_error")


def _validation_error(exc: RequestValidationError) -> APIError:
    """One readable message from pydantic's list: the first problem, named by its field."""
    err = exc.errors()[0]
    where = [str(part) for part in err["loc"] if part != "body"]
    if err["type"] == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}")
    if not where:
        return bad_request(f"the request body must be a JSON object: {err['msg']}")
    param, message = ".".join(where), err["msg"].removeprefix("Value error, ")
    return bad_request(message if message.startswith(param) else f"{param}: {message}", param)


# ---- requests -------------------------------------------------------------------------------------


Int64 = Annotated[int, Field(ge=-(2**63), lt=2**63)]  # what the wire format carries


class StreamOptions(BaseModel):
    include_usage: bool = False


# Request fields passed to SamplingParams as they are, when given (max_tokens and logprobs differ by endpoint).
_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)} - {"max_tokens", "logprobs"}


class BaseRequest(BaseModel):
    """Fields both generation endpoints take. Unknown fields (``user``, ...) are ignored, as OpenAI does."""

    model_config = ConfigDict(allow_inf_nan=False)

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Int64 = 1
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: Int64 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # vLLM's extra sampling fields (send them with the openai package's `extra_body`)
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int64 | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[Int64] | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if self.n != 1:
            raise bad_request(f"n must be 1, got {self.n}: this server returns one choice; send n requests", "n")
        given = {name: value for name, value in self if name in _SAMPLING_FIELDS and value is not None}
        try:
            return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **given)
        except ValueError as exc:
            raise bad_request(str(exc)) from None


class CompletionRequest(BaseRequest):
    prompt: Any
    max_tokens: Int64 | None = 16
    logprobs: Int64 | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Int64 | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> str | list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and all(type(t) is int and -(2**63) <= t < 2**63 for t in prompt):
            return prompt
        raise ValueError(
            "prompt must be a string or a list of token ids (or a list of one of them); "
            "for several prompts send one request each"
        )

    def check_supported(self) -> None:
        if self.echo:
            raise bad_request("echo is not supported; leave it false (prepend the prompt yourself)", "echo")
        if self.suffix:
            raise bad_request("suffix is not supported (no fill-in-the-middle); leave it out", "suffix")
        if self.best_of not in (None, 1):
            raise bad_request(f"best_of must be 1, got {self.best_of}; send several requests and pick", "best_of")


class ContentPart(BaseModel):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    role: str
    content: str | list[ContentPart] | None = None

    def text(self, index: int) -> str:
        """The content as one string; text parts are joined with newlines (as vLLM does)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise bad_request(
                    f"messages[{index}].content has a {part.type!r} part; this server takes only text parts",
                    f"messages[{index}].content",
                )
        return "\n".join(part.text for part in self.content)


class ChatRequest(BaseRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: set logprobs to true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None
