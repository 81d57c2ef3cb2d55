"""Errors in OpenAI's JSON shape, and the request bodies the server accepts (pydantic)."""

from __future__ import annotations

import dataclasses
import re
from typing import Annotated, Any, Literal

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
from nanostream.sampling_params import SamplingParams
from nanostream.structured_outputs import StructuredOutputsParams

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

# SamplingParams' and the engine's messages start with the field at fault ("n must ...", "logit_bias names ...").
_PARAM = re.compile(r"^(\w+)(?:\.\w+)* (?:must|is not|names|takes|cannot)\b")


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
    include_usage: bool = False  # a last event with the request's usage and no choices
    # vLLM's: every event also carries usage so far (its choice's tokens); only with include_usage, as in vLLM
    continuous_usage_stats: bool = False


class JSONSchemaFormat(BaseModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


# Request fields passed to SamplingParams as they are, when given (max_tokens and logprobs differ by endpoint).
_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)} - {
    "max_tokens",
    "logprobs",
    "logit_bias",
    "structured_outputs",
    "embed",  # (/v1/embeddings')
}


class BaseRequest(BaseModel):
    """Fields both generation endpoints take. Unknown fields (``user``, ...) are ignored, as OpenAI does,
    except those that would change the result (unsupported.py): those are a 400 naming the field."""

    model_config = ConfigDict(allow_inf_nan=False, extra="allow", populate_by_name=True)

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
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extra fields (send them with the openai package's `extra_body`)
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int64 | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[Int64] | None = None
    skip_special_tokens: bool | None = None
    prompt_logprobs: Int64 | None = None
    structured_outputs: dict[str, Any] | None = None
    truncate_prompt_tokens: Int64 | None = None  # keep the prompt's last k tokens; -1: all the context allows
    return_token_ids: bool = False  # the prompt's and each choice's token ids beside the text (vLLM's)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats

    def truncated(self, ids: list[int], max_model_len: int, max_tokens: int | None) -> list[int]:
        """``ids`` cut to the last ``truncate_prompt_tokens`` (vLLM's left truncation); -1 keeps as many as
        ``max_model_len`` leaves beside ``max_tokens``, and no more may be asked for."""
        keep, room = self.truncate_prompt_tokens, max_model_len - (max_tokens or 0)
        if keep is None:
            return ids
        if keep == -1:
            keep = room
        elif keep < 1:
            raise bad_request(
                f"truncate_prompt_tokens must be a number of tokens >= 1 (the prompt's last ones are kept), or -1 "
                f"for as many as the context allows; got {keep}",
                "truncate_prompt_tokens",
            )
        elif keep > room:
            raise bad_request(
                f"truncate_prompt_tokens cannot be over max_model_len ({max_model_len}) less max_tokens "
                f"({max_tokens or 0}) = {room}; got {keep}: ask for fewer, or -1 for that many",
                "truncate_prompt_tokens",
            )
        return ids[-keep:] if keep > 0 else []

    def check(self) -> None:
        """What pydantic cannot see alone: fields that need others."""
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream: true; leave it out", "stream_options")

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, structured: StructuredOutputsParams | None = None
    ) -> SamplingParams:
        given = {name: value for name, value in self if name in _SAMPLING_FIELDS and value is not None}
        if self.logit_bias:
            given["logit_bias"] = _token_ids(self.logit_bias)
        try:
            return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, structured_outputs=structured, **given)
        except ValueError as exc:
            raise bad_request(str(exc)) from None


def _token_ids(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias ({"token id": bias}, JSON keys being strings) with integer keys."""
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
    return out


Prompt = str | list[int]
MAX_PROMPTS = 1024  # of a completions request's prompt list


class CompletionRequest(BaseRequest):
    prompt: Any
    max_tokens: Int64 | None = 16
    logprobs: Int64 | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Int64 | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt: Any) -> list[Prompt]:
        """A string, a list of token ids, or a list of either (several prompts): always a list of prompts."""

        def one(p: Any) -> bool:
            return isinstance(p, str) or (
                isinstance(p, list) and bool(p) and all(type(t) is int and -(2**63) <= t < 2**63 for t in p)
            )

        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)):
            prompt = [prompt]
        if isinstance(prompt, list) and prompt and all(one(p) for p in prompt):
            if len(prompt) > MAX_PROMPTS:
                raise ValueError(f"prompt takes at most {MAX_PROMPTS} prompts in one request, got {len(prompt)}")
            return prompt
        raise ValueError(
            "prompt must be a string, a list of token ids, or a list of several of either (one choice each)"
        )

    def prompts_kept(self, tokenizer: Any, max_model_len: int) -> list[Prompt]:
        """The prompts, as token ids cut to ``truncate_prompt_tokens`` when it is given."""
        if self.truncate_prompt_tokens is None:
            return self.prompt
        ids = [p if isinstance(p, list) else tokenizer(p).input_ids for p in self.prompt]  # as AsyncClient.stream
        return [self.truncated(p, max_model_len, self.max_tokens) for p in ids]

    def check(self) -> None:
        super().check()
        if self.suffix:
            raise bad_request("suffix is not supported (no fill-in-the-middle); leave it out", "suffix")
        if self.best_of not in (None, 1):
            raise bad_request(f"best_of must be 1, got {self.best_of}; ask for n samples and pick", "best_of")
