"""``POST /v1/embeddings``: OpenAI's request and response shapes over ``AsyncClient.embed`` (the engine
pools each input's last hidden state in the steps it shares with generating requests; the client cuts
and normalises). A server on a generation model answers 400: start the engine with ``--runner pooling``.

    {"input": "a query" | ["several", "texts"] | [9707, 11] | [[9707], [11]], "dimensions": 256,
     "encoding_format": "float" | "base64"}
    -> {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [...]}], "model", "usage"}
"""

from __future__ import annotations

import base64
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator

from nanostream.frontends.openai_server.protocol import Int64, bad_request
from nanostream.frontends.openai_server.unsupported import check_extra_fields

MAX_INPUTS = 2048  # OpenAI's limit of one request's inputs
UNSUPPORTED = {"truncate_prompt_tokens": "an input longer than max_model_len is refused; shorten it"}


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="allow")

    model: str | None = None
    input: Any
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int64 | None = None

    @field_validator("input")
    @classmethod
    def _inputs(cls, value: Any) -> list[str | list[int]]:
        """A string, a list of token ids, or a list of either: always a list of inputs."""

        def ids(v: Any) -> bool:
            return isinstance(v, list) and bool(v) and all(type(t) is int and 0 <= t < 2**63 for t in v)

        if isinstance(value, str) or ids(value):
            value = [value]
        if isinstance(value, list) and value and all((isinstance(v, str) and v) or ids(v) for v in value):
            if len(value) > MAX_INPUTS:
                raise ValueError(f"input takes at most {MAX_INPUTS} inputs in one request, got {len(value)}")
            return value
        raise ValueError(
            "input must be a non-empty string, a list of token ids, or a non-empty list of several of either"
        )


class EmbeddingsAPI:
    """The embeddings route of the server (``self.client``, ``self.check_model`` come from it)."""

    async def embeddings(self, body: EmbeddingRequest) -> dict[str, Any]:
        self.check_model(body.model)
        check_extra_fields(body.model_extra, UNSUPPORTED, {"user"}, "Embeddings")
        if self.client.connection.welcome.pooling is None:
            raise bad_request(
                f"the model {self.served_model_name!r} is a generation model; this server embeds with an engine "
                "started as an embedding server (nanostream serve MODEL --runner pooling)",
                "model",
            )
        out = await self.client.embed(body.input if len(body.input) > 1 else body.input[0], dimensions=body.dimensions)

        def encoded(vector) -> list[float] | str:
            if body.encoding_format == "base64":  # little-endian float32, as OpenAI's clients decode it
                return base64.b64encode(vector.astype("<f4").tobytes()).decode()
            return vector.tolist()

        data = [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(out.vectors)]
        usage = {"prompt_tokens": out.prompt_tokens, "total_tokens": out.prompt_tokens}
        return {"object": "list", "data": data, "model": self.served_model_name, "usage": usage}
