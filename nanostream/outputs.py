"""What the APIs return, one type each: ``RequestOutput`` (``LLM.generate``, offline), ``StreamChunk``
(each item of ``AsyncClient.stream``) and ``Completion`` (``AsyncClient.generate``, all chunks
merged). The engine's per-step progress is ``protocol.RequestDelta``; the output processor
(client/output_processor.py) turns deltas into these."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from nanostream.protocol import Usage


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


@dataclass
class StreamChunk:
    """New output of one stream: ``text`` and ``token_ids`` since the previous chunk."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last chunk, else None
    usage: Usage | None = None  # on the last chunk
    logprobs: list[dict[int, float]] | None = None  # one dict per new token, when asked for


@dataclass
class Completion:
    """A whole output, as ``AsyncClient.generate`` returns it: every chunk of a stream merged."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: Usage | None
    logprobs: list[dict[int, float]] | None = None

    @classmethod
    def of(cls, request_id: str, chunks: Iterable[StreamChunk], logprobs: bool) -> Completion:
        """All text, ids and (when ``logprobs``) logprobs of ``chunks``; the last one's finish reason and usage."""
        text, ids, lps, last = [], [], [], StreamChunk("", [])
        for last in chunks:
            text.append(last.text)
            ids += last.token_ids
            lps += last.logprobs or []
        return cls(request_id, "".join(text), ids, last.finish_reason, last.usage, lps if logprobs else None)
