"""What the APIs return, one type each: ``RequestOutput`` (``LLM.generate``, offline), ``StreamChunk``
(each item of ``AsyncClient.stream``) and ``Completion`` (``AsyncClient.generate``, all chunks
merged); with ``n`` > 1 each holds every sample as a ``CompletionOutput``. The engine's per-step
progress is ``protocol.RequestDelta``; the output processor (client/output_processor.py) turns
deltas into chunks, and a sample group (client/samples.py) merges those into the others."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

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
    embedding: bytes | None = None  # SamplingParams.embed: the prompt's pooled hidden state (float32), raw

    @classmethod
    def of(
        cls, index: int, chunks: list[StreamChunk], logprobs: bool, stop_reason: str | int | None = None
    ) -> CompletionOutput:
        """One sample's chunks merged: all its text, ids and (when ``logprobs``) logprobs, the last finish
        reason. The one merge of chunks into an output, for ``LLM`` and ``AsyncClient`` alike."""
        reasoning = "".join(c.reasoning_content for c in chunks) or None
        finish = next((c.finish_reason for c in reversed(chunks) if c.finish_reason is not None), None)
        return cls(
            index,
            "".join(c.text for c in chunks),
            [t for c in chunks for t in c.token_ids],
            finish,
            stop_reason,
            [lp for c in chunks for lp in c.logprobs or ()] if logprobs else None,
            reasoning,
            next((c.embedding for c in chunks if c.embedding is not None), None),
        )


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

    @classmethod
    def of(
        cls,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        outputs: list[CompletionOutput],
        num_cached_tokens: int,
        prompt_logprobs: PromptLogprobs | None,
    ) -> RequestOutput:
        """The result of one prompt from its samples' outputs (the top-level fields are the first one's)."""
        first = outputs[0]
        return cls(
            request_id,
            prompt,
            prompt_token_ids,
            first.token_ids,
            first.text,
            first.finish_reason,
            num_cached_tokens,
            first.logprobs,
            first.stop_reason,
            first.reasoning_content,
            prompt_logprobs,
            outputs,
        )


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
    embedding: bytes | None = None  # SamplingParams.embed: the prompt's pooled hidden state (float32), raw


@dataclass
class Embeddings:
    """What ``AsyncClient.embed`` returns: one vector per prompt (float32, normalised as the model says),
    in order, and the tokens of the prompts."""

    vectors: list[np.ndarray]
    prompt_tokens: int


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
    def of(
        cls,
        request_id: str,
        outputs: list[CompletionOutput],
        usage: Usage | None,
        prompt_logprobs: PromptLogprobs | None,
    ) -> Completion:
        """The whole output from its samples' outputs (the top-level fields are the first one's)."""
        first = outputs[0]
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
