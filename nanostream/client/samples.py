"""``n`` samples of one prompt: one engine request each, seeded apart, sharing the prompt's KV blocks.

The engine runs one sample per request. ``LLM`` and ``Stream`` send the first sample alone and
the others once its first token is back: by then the prompt's full blocks are in the prefix cache,
so the other samples reuse them (each computes only the prompt's last, partial block) instead of
computing the prompt n times side by side.
"""

from __future__ import annotations

import dataclasses

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
