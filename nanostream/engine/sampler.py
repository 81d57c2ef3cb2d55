"""Batched sampling on the device: penalties, temperature, top-k / top-p / min-p, logprobs.

Every row has a seed (the request's own, or one the engine drew for it). The random numbers of a
row come from a counter-based hash of (seed, output position, token id), so a seeded request
samples the same tokens whatever else shares its batch, and the whole batch is one pass of tensor
ops: no per-request loop, no host synchronisation, no torch.Generator state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2**32 for 0 <= x < 2**32 without overflowing int64: split c into 16-bit halves.
    hi, lo = c >> 16, c & 0xFFFF
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # A 32-bit integer finaliser (xorshift-multiply rounds) with good avalanche.
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def exponential_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) noise [B, V] that depends only on each row's (seed, step) and the token id."""
    # seeds, steps: [B] int64
    row = _mix32((seeds & _M32) ^ _mix32(((seeds >> 32) & _M32) + 0x9E3779B9))
    row = _mix32(row ^ _mix32(steps & _M32))  # [B]
    cols = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    bits = _mix32(row[:, None] ^ _mix32(cols + 0x632BE5AB)[None, :])  # [B, V] in [0, 2**32)
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # (0, 1), never 0 or 1
    return -torch.log(uniform)


@dataclass
class SamplingBatch:
    """Per-row sampling settings of one step, as device tensors ([B] unless noted)."""

    temperature: torch.Tensor  # float32; 0 = greedy
    top_k: torch.Tensor  # int64; vocab_size = off
    top_p: torch.Tensor  # float32; 1 = off
    min_p: torch.Tensor  # float32; 0 = off
    seeds: torch.Tensor  # int64
    steps: torch.Tensor  # int64: output tokens generated so far (the position of this sample)
    all_greedy: bool
    needs_top_k_p: bool
    needs_min_p: bool
    # Penalties, only when some row uses them.
    repetition_penalty: torch.Tensor | None = None  # float32
    presence_penalty: torch.Tensor | None = None  # float32
    frequency_penalty: torch.Tensor | None = None  # float32
    output_counts: torch.Tensor | None = None  # [B, V] float32 count of each token in the output
    prompt_mask: torch.Tensor | None = None  # [B, V] bool, token occurs in the prompt
    banned: torch.Tensor | None = None  # [B, V] bool, tokens that may not be sampled (min_tokens)
    max_logprobs: int = -1  # -1: no row asked for logprobs


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32, of the sampled token
    top_ids: torch.Tensor | None  # [B, N] int64
    top_logprobs: torch.Tensor | None  # [B, N] float32


def apply_penalties(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """vLLM's semantics: repetition over prompt and output tokens, presence and frequency over output."""
    if b.output_counts is None:
        return logits
    seen = b.prompt_mask | (b.output_counts > 0)
    rep = b.repetition_penalty[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - b.frequency_penalty[:, None] * b.output_counts
    return logits - b.presence_penalty[:, None] * (b.output_counts > 0).to(logits.dtype)


def apply_top_k_top_p_min_p(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Mask (to -inf) the tokens that top-k, top-p and min-p exclude; logits are already temperature-scaled."""
    if b.needs_min_p:
        probs = logits.softmax(-1)
        threshold = b.min_p[:, None] * probs.amax(-1, keepdim=True)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if b.needs_top_k_p:
        sorted_logits, order = logits.sort(-1, descending=True)
        rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
        drop = rank >= b.top_k[:, None]
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)  # top-p sees the top-k mass, as vLLM
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it does.
        # top_p = 1 keeps all: a float32 cumsum over a large vocabulary can pass 1 before the tail ends.
        drop |= ((probs.cumsum(-1) - probs) >= b.top_p[:, None]) & (b.top_p[:, None] < 1)
        drop[:, 0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, b: SamplingBatch) -> SamplerOutput:
    """logits: [B, V] float32 from the model. Returns the sampled ids and the asked-for logprobs."""
    raw = logits
    if b.banned is not None:
        logits = logits.masked_fill(b.banned, float("-inf"))
    logits = apply_penalties(logits, b)
    greedy_ids = logits.argmax(-1)
    if b.all_greedy:
        token_ids = greedy_ids
    else:
        # Exponential race: argmax(p / E) with E ~ Exp(1) samples from p (the Gumbel-max trick).
        temp = torch.where(b.temperature > 0, b.temperature, 1.0)[:, None]
        scaled = apply_top_k_top_p_min_p(logits / temp, b)
        probs = scaled.softmax(-1)
        noise = exponential_noise(b.seeds, b.steps, logits.shape[-1])
        sampled = (probs / noise).argmax(-1)
        token_ids = torch.where(b.temperature > 0, sampled, greedy_ids)
    if b.max_logprobs < 0:
        return SamplerOutput(token_ids, None, None, None)
    logprobs = raw.log_softmax(-1)
    top_logprobs, top_ids = logprobs.topk(b.max_logprobs, -1) if b.max_logprobs else (None, None)
    return SamplerOutput(token_ids, logprobs.gather(-1, token_ids[:, None])[:, 0], top_ids, top_logprobs)
