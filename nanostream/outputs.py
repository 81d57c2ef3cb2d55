"""What the offline API returns."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """The result of one prompt.

    ``finish_reason`` is "stop" (EOS, a stop token or a stop string), "length" (max_tokens or
    max_model_len) or "abort". ``logprobs``, when asked for, has one dict per generated token mapping
    token id -> log-probability: the sampled token and the top-N.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: list[dict[int, float]] | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended the output
