"""Per-request sampling settings, with vLLM's names and defaults."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated

from msgspec import Meta

from nanostream.structured_outputs import StructuredOutputsParams

MAX_LOGPROBS = 20
MAX_N = 128
MAX_LOGIT_BIAS = 1024
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range: [-100, 100]
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256
MAX_INT = 2**63 - 1  # every integer must fit the engine's int64 tensors (and msgpack)
_FLOAT32_MAX = 3.4e38
GREEDY_BELOW = 1e-5
"""A temperature below this is greedy: dividing logits by it would overflow float32."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    Example::

        SamplingParams(temperature=0.7, top_p=0.9, max_tokens=128, stop=["\\n\\n"], seed=1)

    ``temperature=0`` (or any below 1e-5) is greedy decoding. ``top_k`` of 0 or -1, or at least
    the vocabulary size, keeps every token.
    ``max_tokens=None`` generates until the model's context (max_model_len) is full.
    ``logprobs=N`` returns the log-probability of each sampled token plus the N most likely ones,
    computed from the model's raw logits (before penalties and temperature); ``prompt_logprobs=N``
    the same for each prompt token after the first (the prompt's cached blocks are recomputed for it).

    ``n`` samples come from one prompt, seeded ``seed``, ``seed + 1``, ... when a seed is given; they
    share the prompt's KV blocks (``LLM`` and ``AsyncClient`` send the n requests). ``logit_bias``
    ({token id: bias in [-100, 100]}, kept as sorted pairs) is added to the logits before sampling.
    ``structured_outputs`` constrains the output to a JSON schema, regex, choice or grammar.
    """

    temperature: float = 1.0
    """Divides the logits; 0 (or below 1e-5) is greedy decoding."""
    top_k: int = 0
    """Sample from the k most likely tokens; 0 or -1 (or the vocabulary size or more) keeps every token."""
    top_p: float = 1.0
    """Sample from the smallest set of most likely tokens whose probabilities add up to this."""
    min_p: float = 0.0
    """Drop tokens less likely than this fraction of the most likely one."""
    seed: int | None = None
    """Seeds this request's sampling (its n samples: seed, seed + 1, ...): the same seed, the same output."""
    max_tokens: int | None = 16
    """Most tokens to generate (None, in the API: until max_model_len is full)."""
    min_tokens: int = 0
    """Tokens to generate before EOS, stop tokens or stop strings may end the output."""
    ignore_eos: bool = False
    """Go on past the model's end-of-sequence token (up to max_tokens)."""
    # The limits in the annotations also hold when the engine decodes a request: an array that is
    # too long is refused from its header, before any of it is allocated.
    stop: Annotated[
        tuple[Annotated[str, Meta(max_length=MAX_STOP_STRING_CHARS)], ...], Meta(max_length=MAX_STOP_STRINGS)
    ] = field(default=())
    """Strings that end the output (not included in it); matched in the client across chunks."""
    stop_token_ids: Annotated[tuple[int, ...], Meta(max_length=MAX_STOP_TOKEN_IDS)] = field(default=())
    """Token ids that end the output, besides the model's EOS."""
    repetition_penalty: float = 1.0
    """Above 1 makes tokens already in the prompt or output less likely (divides their logits)."""
    presence_penalty: float = 0.0
    """Subtracted from the logits of tokens the output already has."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time the output already has it."""
    logprobs: int | None = None
    """Return the log-probability of each sampled token and of the N most likely ones."""
    skip_special_tokens: bool = True
    """Leave special tokens (EOS, chat markers) out of the text."""
    n: int = 1
    """Samples of the one prompt (they share its KV blocks)."""
    logit_bias: Annotated[tuple[tuple[int, float], ...], Meta(max_length=MAX_LOGIT_BIAS)] = field(default=())
    """{token id: bias in [-100, 100]} added to the logits before sampling."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, any JSON object, a regex, a choice or a grammar."""
    prompt_logprobs: int | None = None
    """Return the log-probabilities of each prompt token (after the first) and of the N most likely ones."""
    embed: bool = False
    """Return the prompt's embedding (its pooled hidden state, ``StreamChunk.embedding``) with one token
    (max_tokens 1): an engine started with ``runner="pooling"`` only (``AsyncClient.embed`` sends these)."""

    def __post_init__(self) -> None:
        # Normalise the list-or-string fields so instances stay hashable and comparable.
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        stop = tuple(stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
            raise ValueError(
                f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_STRING_CHARS} characters each; "
                f"got {len(stop)}, the longest of {max(map(len, stop))} characters"
            )
        object.__setattr__(self, "stop", stop)
        ids = tuple(self.stop_token_ids or ())
        if not all(_is_int(i) and 0 <= i <= MAX_INT for i in ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
        object.__setattr__(self, "stop_token_ids", ids)

        def number(name: str) -> float:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value) or abs(value) > _FLOAT32_MAX:  # the sampler computes in float32
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            return float(value)

        def integer(name: str, low: int, what: str, optional: bool = False) -> None:
            value = getattr(self, name)
            if optional and value is None:
                return
            if not _is_int(value) or not low <= value <= MAX_INT:
                raise ValueError(f"{name} must be {what}, got {value!r}")

        if number("temperature") < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0.0 < number("top_p") <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= number("min_p") <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        integer("top_k", -1, "-1, 0 (both disable it) or a positive integer")
        if number("repetition_penalty") <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= number(name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        integer("max_tokens", 1, "a positive integer or None", optional=True)
        integer("min_tokens", 0, "a non-negative integer")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.seed is not None and (not _is_int(self.seed) or not -(2**63) <= self.seed < 2**64):
            raise ValueError(f"seed must be a 64-bit integer or None, got {self.seed!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}")
        for name in ("ignore_eos", "skip_special_tokens", "embed"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        integer("n", 1, f"an integer in [1, {MAX_N}]")
        if self.n > MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n}")
        lp = self.prompt_logprobs
        if lp is not None and (not _is_int(lp) or not 0 <= lp <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {lp!r}")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            if not isinstance(so, dict):
                raise ValueError(f"structured_outputs must be a StructuredOutputsParams or a dict, got {so!r}")
            object.__setattr__(self, "structured_outputs", StructuredOutputsParams(**so))
        if self.embed and (self.max_tokens != 1 or self.n != 1 or self.structured_outputs is not None):
            raise ValueError("embed needs max_tokens 1, n 1 and no structured_outputs (one forward of the prompt)")
        if self.structured_outputs is not None and self.min_tokens:
            raise ValueError(
                "min_tokens cannot be combined with structured_outputs (the grammar decides where the output "
                "may end); leave min_tokens at 0"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @property
    def constrained(self) -> bool:
        """The output must match a grammar (``structured_outputs``)."""
        return self.structured_outputs is not None

    @property
    def has_penalties(self) -> bool:
        """Sampling reads the request's own earlier tokens (repetition, presence or frequency penalty)."""
        return self.repetition_penalty != 1 or bool(self.presence_penalty) or bool(self.frequency_penalty)


def _logit_bias(bias: object) -> tuple[tuple[int, float], ...]:
    """{token id: bias} (or (id, bias) pairs) as pairs sorted by id, each checked."""
    if not bias:
        return ()
    pairs = list(bias.items()) if isinstance(bias, dict) else list(bias)
    if len(pairs) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(pairs)}")
    out: dict[int, float] = {}
    for pair in pairs:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"logit_bias must map token ids to numbers, got the entry {pair!r}")
        token, value = pair
        if not _is_int(token) or not 0 <= token <= MAX_INT:
            raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {token!r}")
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT
        ):
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {token}")
        if token in out:
            raise ValueError(f"logit_bias names token {token} twice")
        out[token] = float(value)
    return tuple(sorted(out.items()))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
