"""One request's output on the client side, for the offline ``LLM`` and for ``Stream`` alike.

    RequestDelta ──put()──▶ pending (merged: a consumer that falls behind takes everything at once)
                 ──take()─▶ StreamChunk: final text only, stop strings cut, finish reason and usage
                            on the last one; an engine-side error raised as its exception

No torch, no I/O: the caller feeds deltas (from ``LLMEngine.step()`` or the client's socket) and acts
on what ``take()`` says: stop now (a stop string ended the output before the engine did: tell the
engine to stop).
With a reasoning parser the final text is split into reasoning and content last of all.
"""

from __future__ import annotations

from typing import Any

from nanostream.client.detokenizer import IncrementalDetokenizer, decode_output
from nanostream.client.reasoning import ReasoningParser, get_reasoning_parser
from nanostream.errors import REQUEST_ERRORS, EngineDeadError, InvalidRequestError
from nanostream.outputs import StreamChunk
from nanostream.protocol import RequestDelta, Usage
from nanostream.sampling_params import SamplingParams

_PROMPT_TAIL_TOKENS = 16  # decoded for a reasoning parser: has the prompt opened the reasoning already?


def has_reasoning_tokens(tokenizer: Any, parser: ReasoningParser) -> bool:
    """The tokenizer has the parser's tags as tokens of their own, as a model trained to reason has. Only
    then may a constrained request reason first: another model, spelling a tag out character by character
    into the reasoning's free text, would leave its constraint behind."""
    return all(len(tokenizer.encode(tag, add_special_tokens=False)) == 1 for tag in (parser.start_tag, parser.end_tag))


class OutputProcessor:
    """``incremental=False`` (the offline API's fast path) decodes the text once, at the end, unless
    stop strings must be watched for: two tokenizer calls per token would cost more host time than a
    GPU decode step."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        incremental: bool = True,
        reasoning_parser: str | None = None,
        index: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.index = index  # which sample of its request (n > 1)
        self.reasoning: ReasoningParser | None = None
        if reasoning_parser is not None:
            tail = tokenizer.decode(prompt_token_ids[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
            self.reasoning = get_reasoning_parser(reasoning_parser)(tail)
            if params.structured_outputs is not None and has_reasoning_tokens(tokenizer, self.reasoning):
                params = self.reasoning.constrain(params)  # a model that reasons: its grammar holds after
        self.prompt_token_ids = prompt_token_ids
        self.params = params  # what the engine is to run
        self.detok = (
            IncrementalDetokenizer(
                tokenizer,
                prompt_token_ids,
                stop=params.stop,
                skip_special_tokens=params.skip_special_tokens,
                min_tokens=params.min_tokens,
            )
            if incremental or params.stop
            else None
        )
        self.pending: RequestDelta | None = None  # what arrived and was not taken yet
        self.token_ids: list[int] = []  # every output token taken so far
        self.usage: Usage | None = None
        self.finish_reason: str | None = None  # once the last chunk was taken
        self.stop_reason: str | int | None = None  # the stop string, or the stop token id, that ended it

    @property
    def ends_pending(self) -> bool:
        """The request's last delta has arrived (and may not be taken yet)."""
        return self.finish_reason is not None or (self.pending is not None and self.pending.finish_reason is not None)

    def put(self, delta: RequestDelta) -> None:
        if self.pending is None:
            self.pending = delta
        else:
            self.pending.merge(delta)

    def take(self) -> tuple[StreamChunk | None, bool]:
        """Everything pending as one chunk (None if that adds nothing: no tokens, not the end), and whether
        the engine must stop the request now (a stop string ended the output while it still runs it)."""
        delta = self.pending
        if delta is None or (self.detok is None and delta.finish_reason is None):
            return None, False  # (not incremental: decoded once, at the end; the deltas merge until then)
        self.pending = None
        if self.finish_reason is not None:
            return None, False
        self.usage = delta.usage or self.usage
        prompt_logprobs = delta.prompt_logprobs if self.params.prompt_logprobs is not None else None
        finish = delta.finish_reason
        if finish == "error" or (finish == "abort" and delta.error):
            # The engine ended the request for a reason of its own: raise it as its type.
            default = InvalidRequestError if finish == "error" else EngineDeadError
            self.finish_reason = finish
            raise REQUEST_ERRORS.get(delta.code or "", default)(delta.error or "the engine rejected the request")
        ids, logprobs, text, stop_now = delta.token_ids, delta.logprobs, "", False
        if self.detok is not None:
            seen = self.detok.num_output_tokens
            text = self.detok.add(ids)
            if self.detok.stopped_by is not None:
                # The output ends with the token that completed the stop string, whatever else the
                # engine sent meanwhile.
                used = self.detok.num_output_tokens - seen
                ids, logprobs = ids[:used], logprobs[:used]
                stop_now, self.stop_reason, finish = finish is None, self.detok.stopped_by, "stop"
        self.token_ids += ids
        lps = logprobs if self.params.logprobs is not None else None
        if finish is None:
            return (self._chunk(text, ids, None, None, lps, prompt_logprobs, False) if ids else None), False
        self.finish_reason = finish
        if self.detok is not None:
            text += self.detok.finish()
        else:
            text = decode_output(
                self.tokenizer,
                self.prompt_token_ids,
                self.token_ids,
                skip_special_tokens=self.params.skip_special_tokens,
            )
        if finish == "stop" and self.stop_reason is None and self.token_ids:
            self.stop_reason = self.token_ids[-1]  # EOS or one of stop_token_ids
        usage = self.usage or Usage(len(self.prompt_token_ids), 0)
        self.usage = Usage(usage.prompt_tokens, len(self.token_ids), usage.cached_tokens)
        chunk = self._chunk(text, ids, finish, self.usage, lps, prompt_logprobs, True)
        chunk.embedding = delta.embedding or None
        return chunk, stop_now

    def _chunk(self, text: str, ids: list[int], finish, usage, logprobs, prompt_logprobs, last: bool) -> StreamChunk:
        reasoning = ""
        if self.reasoning is not None:
            reasoning, text = self.reasoning.feed(text)
            if last:
                more_reasoning, more_text = self.reasoning.finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
        return StreamChunk(text, ids, finish, usage, logprobs, self.index, reasoning, prompt_logprobs or None)
