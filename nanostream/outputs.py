"""What the APIs return, one type each: ``RequestOutput`` (``LLM.generate``, offline), ``StreamChunk``
(each item of ``AsyncClient.stream``) and ``Completion`` (``AsyncClient.generate``, all chunks
merged); with ``n`` > 1 each holds every sample as a ``CompletionOutput``. The engine's per-step
progress is ``protocol.RequestDelta``; the output processor (client/output_processor.py) turns
deltas into these."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from nanostream.protocol import Usage

PromptLogprobs = list[dict[int, float] | None]
"""Per prompt token: its log-probability and the top N (token id -> logprob); None for the first."""


@dataclass
class CompletionOutput:
    """One sample of a request (``SamplingParams(n=...)`` asks for several), as ``index`` orders them."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None
    reasoning_content: str | None = None  # with a reasoning parser: the reasoning (``text`` is the rest)


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
    reasoning_content: str | None = None  # with a reasoning parser: the reasoning (``text`` is the rest)
    prompt_logprobs: PromptLogprobs | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)


@dataclass
class StreamChunk:
    """New output of one stream: ``text`` and ``token_ids`` since the previous chunk."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last chunk, else None
    usage: Usage | None = None  # on the last chunk
    logprobs: list[dict[int, float]] | None = None  # one dict per new token, when asked for
    index: int = 0  # which sample (``n`` > 1: the samples' chunks interleave)
    reasoning_content: str = ""  # with a reasoning parser: new reasoning (``text`` is new content)
    prompt_logprobs: PromptLogprobs | None = None  # on a sample's first chunk, when asked for


@dataclass
class Completion:
    """A whole output, as ``AsyncClient.generate`` returns it: every chunk of a stream merged.

    ``outputs`` holds every sample (``n``) in index order; the fields above are the first one's,
    except ``usage``, which counts the prompt once and the tokens of every sample.
    """

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: Usage | None
    logprobs: list[dict[int, float]] | None = None
    reasoning_content: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)

    @classmethod
    def of(cls, request_id: str, chunks: Iterable[StreamChunk], logprobs: bool) -> Completion:
        """All text, ids and (when ``logprobs``) logprobs of ``chunks``, per sample; each sample's last
        finish reason; usage summed over the samples (the prompt once)."""
        samples: dict[int, CompletionOutput] = {}
        texts: dict[int, list[str]] = {}
        reasoning: dict[int, list[str]] = {}
        usages: dict[int, Usage] = {}
        prompt_logprobs = None
        for chunk in chunks:
            out = samples.setdefault(chunk.index, CompletionOutput(chunk.index, logprobs=[] if logprobs else None))
            texts.setdefault(chunk.index, []).append(chunk.text)
            reasoning.setdefault(chunk.index, []).append(chunk.reasoning_content)
            out.token_ids += chunk.token_ids
            if logprobs:
                out.logprobs += chunk.logprobs or []
            out.finish_reason = chunk.finish_reason or out.finish_reason
            if chunk.usage is not None:
                usages[chunk.index] = chunk.usage
            prompt_logprobs = prompt_logprobs or chunk.prompt_logprobs
        outputs = [samples[i] for i in sorted(samples)] or [CompletionOutput(0, logprobs=[] if logprobs else None)]
        for out in outputs:
            out.text = "".join(texts.get(out.index, []))
            out.reasoning_content = "".join(reasoning.get(out.index, [])) or None
        first = outputs[0]
        usage = None
        if usages:
            lead = usages[min(usages)]
            usage = Usage(lead.prompt_tokens, sum(u.completion_tokens for u in usages.values()), lead.cached_tokens)
        return cls(
            request_id,
            first.text,
            first.token_ids,
            first.finish_reason,
            usage,
            first.logprobs,
            first.reasoning_content,
            prompt_logprobs,
            outputs,
        )
