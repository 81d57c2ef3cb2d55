"""What a step gives back (``StepResult``): one ``RequestDelta`` per request that moved, with its ``Usage``.

A request's first delta carries its usage (prompt and cached tokens) and the prompt logprobs it asked
for; its last one the finish reason and the usage again; an ended request's delta the reason, and for
"error" the message and its code ("invalid": the request's fault, "internal": the engine's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from nanostream.engine.sequence import PENDING, Sequence
from nanostream.protocol import RequestDelta, Usage

if TYPE_CHECKING:
    from nanostream.engine.runner.sampling_batch import SampledToken


@dataclass
class StepResult:
    deltas: list[RequestDelta]
    num_prefill_tokens: int  # prompt tokens computed this step (chunks that did not only decode)
    num_decode_tokens: int
    num_requests: int = 0  # requests in the step


def token_delta(seq: Sequence, token: SampledToken) -> RequestDelta:
    """The delta of a request for the token its step sampled (the scheduler has resolved it into ``seq``):
    keeps the token's logprobs on ``seq``, and marks ``seq`` reported."""
    if token.logprobs is not None:
        seq.logprobs.append(token.logprobs)
    delta = RequestDelta(seq.request_id, [token.token_id], [token.logprobs] if token.logprobs else [])
    if not seq.reported and seq.params.prompt_logprobs is not None:
        delta.prompt_logprobs = seq.prompt_logprobs
    if seq.embedding is not None and not seq.reported:
        delta.embedding = seq.embedding
    if not seq.reported or seq.finish_reason is not None:
        delta.usage, seq.reported = usage(seq), True  # on the first (prompt, cached tokens) and the last
    if seq.finish_reason == "error":
        delta.error, delta.code = seq.error, "internal"
    delta.finish_reason = seq.finish_reason
    return delta


def ended_delta(seq: Sequence, reason: str, error: str | None = None, code: str | None = None) -> RequestDelta:
    """The last delta of a request ended outside a step's samples (aborted, failed), with no new token."""
    return RequestDelta(seq.request_id, finish_reason=reason, error=error, code=code, usage=usage(seq))


def usage(seq: Sequence) -> Usage:
    # Output tokens still PENDING (sampled by a step in flight) are not counted.
    generated = sum(1 for t in seq.output_token_ids if t != PENDING)
    return Usage(seq.num_prompt_tokens, generated, seq.num_cached_tokens)
