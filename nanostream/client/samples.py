"""``n`` samples of each prompt of a request: one engine request each, seeded apart, sharing the
prompt's KV blocks; for ``Stream`` (over a connection) and ``LLM`` (over an engine in this process) alike.

The engine runs one sample per request. A ``SampleGroup`` sends each prompt's first sample (its
leader) alone and the others (its followers) once the leader's first token is back: by then the
prompt's full blocks are in the prefix cache, so the followers reuse them (each computes only the
prompt's last, partial block) instead of computing the prompt n times side by side. Each sample has
its own ``OutputProcessor``; the group merges what they output into ``CompletionOutput``s.

    group = SampleGroup(request_id, tokenizer, prompts, params)
    send(group.leaders)                        # then, per delta the engine sends for a sample:
    sample.processor.put(delta)
    send(group.followers_of(sample))           # the leader's first token: its followers go
    chunk, stop_now = group.take(sample)       # stop_now: a stop string ended it, stop the engine's request
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from nanostream.client.output_processor import OutputProcessor
from nanostream.outputs import Completion, CompletionOutput, StreamChunk
from nanostream.protocol import Usage
from nanostream.sampling_params import SamplingParams

_SEED_SPAN = 2**64  # seeds are 64-bit: signed or unsigned


def sample_params(params: SamplingParams) -> list[SamplingParams]:
    """One SamplingParams per sample, each with n = 1: sample i of a seeded request has ``seed + i``
    (wrapped to 64 bits), so each is reproducible on its own and sample 0 equals the n = 1 request;
    unseeded samples get seeds the engine draws. Prompt logprobs, the same for every sample, are
    computed for sample 0 only."""
    if params.n == 1:
        return [params]
    out = []
    for i in range(params.n):
        seed = params.seed
        if seed is not None:
            seed += i
            if seed >= _SEED_SPAN:  # past the largest unsigned seed: wrap around to 0, 1, ...
                seed -= _SEED_SPAN
        extra = {} if i == 0 else {"prompt_logprobs": None}
        out.append(dataclasses.replace(params, n=1, seed=seed, **extra))
    return out


def sample_request_id(request_id: str, index: int) -> str:
    """The engine request id of sample ``index`` (sample 0 keeps the request's own)."""
    return request_id if index == 0 else f"{request_id}#{index}"


class Sample:
    """One engine request of a group: sample ``index`` of its prompt."""

    __slots__ = ("chunks", "followers", "index", "params", "processor", "prompt", "request_id", "sent")

    def __init__(self, request_id: str, index: int, prompt: list[int], processor: OutputProcessor) -> None:
        self.request_id, self.index, self.prompt, self.processor = request_id, index, prompt, processor
        self.params = processor.params  # what the engine runs (a reasoning parser may have changed it)
        self.sent = False
        self.followers: list[Sample] = []  # the prompt's other samples, sent after this one's first token
        self.chunks: list[StreamChunk] = []  # what it output, when the group collects


class SampleGroup:
    """The samples of a request: ``params.n`` of each of ``prompts``; sample j of prompt p has index
    ``p * n + j``. ``collect``: keep every chunk taken, for ``outputs()`` and ``completion()``;
    ``incremental=False``: the processors decode once, at the end (see ``OutputProcessor``)."""

    def __init__(
        self,
        request_id: str,
        tokenizer: Any,
        prompts: Sequence[list[int]],
        params: SamplingParams,
        *,
        reasoning_parser: str | None = None,
        incremental: bool = True,
        collect: bool = False,
    ) -> None:
        self.request_id, self.params, self.collect = request_id, params, collect
        self.samples: list[Sample] = []
        self.leaders: list[Sample] = []  # each prompt's first sample, sent at the start
        per_prompt = sample_params(params)
        for p, prompt in enumerate(prompts):
            for j, sp in enumerate(per_prompt):
                index = p * len(per_prompt) + j
                proc = OutputProcessor(
                    tokenizer, prompt, sp, incremental=incremental, reasoning_parser=reasoning_parser, index=index
                )
                sample = Sample(sample_request_id(request_id, index), index, prompt, proc)
                self.samples.append(sample)
                if j == 0:
                    self.leaders.append(sample)
                else:
                    self.leaders[-1].followers.append(sample)
        self.processors = {s.request_id: s.processor for s in self.samples}  # engine request id -> its processor
        self.open = list(self.samples)  # samples that have not finished
        self._turn = 0  # where the next scan for a chunk starts: no sample starves the others

    @staticmethod
    def followers_of(sample: Sample) -> list[Sample]:
        """The followers to send now that ``sample`` has its first token (none after that)."""
        followers, sample.followers = sample.followers, []
        return followers

    def take(self, sample: Sample) -> tuple[StreamChunk | None, bool]:
        """``sample``'s pending output as a chunk (or None), and whether the engine must stop it now.
        A finished sample leaves ``open``; its last chunk has the finish reason."""
        chunk, stop_now = sample.processor.take()
        if chunk is not None:
            if self.collect:
                sample.chunks.append(chunk)
            if chunk.finish_reason is not None:
                self.open.remove(sample)
        return chunk, stop_now

    def take_any(self) -> tuple[Sample | None, StreamChunk | None, bool]:
        """The next chunk of any open sample that has one, taking turns; (None, None, False) if none has."""
        open_ = self.open
        n = len(open_)
        for k in range(n):
            sample = open_[(self._turn + k) % n]
            chunk, stop_now = self.take(sample)
            if chunk is not None:
                self._turn = (self._turn + k + 1) % n
                return sample, chunk, stop_now
        return None, None, False

    def outputs(self) -> list[CompletionOutput]:
        """Each sample's collected chunks merged, in index order."""
        logprobs = self.params.logprobs is not None
        return [CompletionOutput.of(s.index, s.chunks, logprobs, s.processor.stop_reason) for s in self.samples]

    def usage(self) -> Usage | None:
        """Every prompt counted once (with its cached tokens), the tokens of every sample; None before any
        sample finished."""
        usages = [s.processor.usage for s in self.samples if s.processor.finish_reason is not None]
        if not usages:
            return None
        leads = [s.processor.usage for s in self.leaders if s.processor.usage is not None]
        return Usage(
            sum(u.prompt_tokens for u in leads),
            sum(u.completion_tokens for u in usages),
            sum(u.cached_tokens for u in leads),
        )

    def prompt_logprobs(self) -> list | None:
        """The prompt logprobs of the first prompt, when asked for."""
        return next((c.prompt_logprobs for s in self.leaders for c in s.chunks if c.prompt_logprobs is not None), None)

    def completion(self) -> Completion:
        """The whole output: what ``AsyncClient.generate`` returns."""
        return Completion.of(self.request_id, self.outputs(), self.usage(), self.prompt_logprobs())
