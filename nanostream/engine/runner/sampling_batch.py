"""A step's sampling parameters as device tensors (``SamplingBatch``), and its samples read back per request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from nanostream.engine.runner.sampler import SamplerOutput, SamplingBatch
from nanostream.engine.runner.step_inputs import Uploads, to_device, to_device_packed
from nanostream.engine.sequence import Sequence


@dataclass
class SampledToken:
    token_id: int
    logprobs: dict[int, float] | None  # sampled token and the top-N, when the request asked


class SamplingRow(NamedTuple):
    """One sequence's sampling values that never change while it runs: computed once per sequence,
    so that a step of hundreds of rows transposes them (``zip``) instead of reading each parameter of
    each row again."""

    temperature: float  # 0 when greedy
    top_p: float
    min_p: float
    top_k: int  # the vocabulary size when it keeps every token
    seed: int
    greedy: bool
    narrows: bool  # its top-k or top-p cuts the distribution
    logprobs: int  # -1: none asked for
    rare: bool  # penalties, a logit bias or min_tokens over stop ids: read from its params each step


def _sampling_row(seq: Sequence, vocab_size: int) -> SamplingRow:
    """``seq``'s row, computed and kept on it (the first step that samples it)."""
    x = seq.params
    greedy, top_k = x.greedy, x.top_k if 0 < x.top_k < vocab_size else vocab_size  # k >= V keeps every token
    rare = x.has_penalties or bool(x.logit_bias) or (x.min_tokens > 0 and bool(seq.stop_token_ids))
    seq.sampling_row = SamplingRow(
        0.0 if greedy else x.temperature,
        x.top_p,
        x.min_p,
        top_k,
        seq.sampling_seed,
        greedy,
        top_k < vocab_size or x.top_p < 1,
        x.logprobs if x.logprobs is not None else -1,
        rare,
    )
    return seq.sampling_row


def make_sampling_batch(
    seqs: list[Sequence], vocab_size: int, device: torch.device, uploads: Uploads | None = None
) -> SamplingBatch:
    """One row per sequence that samples this step, in order (uploaded through ``uploads``, the runner's)."""
    rows = [s.sampling_row or _sampling_row(s, vocab_size) for s in seqs]
    temperature, top_p, min_p, top_k, seeds, greedy, narrows, logprobs, rare = zip(*rows)
    f32, i64 = torch.float32, torch.int64
    temperature_t, top_p_t, min_p_t = to_device_packed(device, f32, temperature, top_p, min_p, uploads=uploads)
    steps = [len(s.token_ids) - s.num_prompt_tokens for s in seqs]  # each row's output tokens so far
    top_k_t, seeds_t, steps_t = to_device_packed(device, i64, top_k, seeds, steps, uploads=uploads)
    batch = SamplingBatch(
        temperature=temperature_t,
        top_k=top_k_t,
        top_p=top_p_t,
        min_p=min_p_t,
        seeds=seeds_t,
        steps=steps_t,
        all_greedy=all(greedy),
        needs_top_k_p=any(narrows),
        needs_min_p=any(m > 0 for m in min_p),
        max_logprobs=max(logprobs),
    )
    if any(rare):
        _add_rare(batch, seqs, vocab_size, device, uploads)
    return batch


def _add_rare(
    batch: SamplingBatch, seqs: list[Sequence], vocab: int, device: torch.device, uploads: Uploads | None
) -> None:
    """Penalties, min_tokens bans and logit bias, for a step where some row has one."""
    p = [s.params for s in seqs]
    f32, i64 = torch.float32, torch.int64
    if any(x.has_penalties for x in p):
        batch.repetition_penalty = to_device([x.repetition_penalty for x in p], f32, device, uploads)
        batch.presence_penalty = to_device([x.presence_penalty for x in p], f32, device, uploads)
        batch.frequency_penalty = to_device([x.frequency_penalty for x in p], f32, device, uploads)
        batch.output_counts = _token_rows([s.output_token_ids for s in seqs], vocab, device).float()
        batch.prompt_mask = _token_rows([s.prompt_token_ids for s in seqs], vocab, device) > 0
    banned = [s.stop_token_ids if s.num_output_tokens < s.params.min_tokens else () for s in seqs]
    if any(banned):
        batch.banned = _token_rows([list(b) for b in banned], vocab, device) > 0
    if any(x.logit_bias for x in p):
        triples = [(i, t, v) for i, x in enumerate(p) for t, v in x.logit_bias]
        rows, ids, values = zip(*triples)
        batch.bias_rows, batch.bias_ids = to_device_packed(device, i64, list(rows), list(ids), uploads=uploads)
        batch.bias_values = to_device(list(values), f32, device, uploads)


def add_token_bitmask(
    batch: SamplingBatch, rows: list[int], bitmask: torch.Tensor, device: torch.device, uploads: Uploads | None = None
) -> None:
    """Set the grammar masks of ``rows`` (bitmask [len(rows), W] int32, on the host) on ``batch``."""
    if not rows:
        return
    batch.mask_rows = to_device(rows, torch.int64, device, uploads)
    batch.token_bitmask = bitmask.to(device, non_blocking=True) if device.type == "cuda" else bitmask


def _token_rows(rows: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[B, V] int32 counts of each token id in each row."""
    width = max(1, max(map(len, rows)))
    ids = to_device([r + [0] * (width - len(r)) for r in rows], torch.int64, device)
    ones = to_device([[1] * len(r) + [0] * (width - len(r)) for r in rows], torch.int32, device)
    counts = torch.zeros(len(rows), vocab_size, dtype=torch.int32, device=device)
    return counts.scatter_add_(1, ids, ones)


def read_samples(seqs: list[Sequence], out: SamplerOutput) -> dict[str, SampledToken]:
    """The sampled token (and logprobs) per request, from samples already on the host (row i: ``seqs[i]``)."""
    token_ids = out.token_ids.tolist()
    if out.logprobs is None:
        return {seq.request_id: SampledToken(t, None) for seq, t in zip(seqs, token_ids)}
    lps = out.logprobs.tolist()
    top_ids = out.top_ids.tolist() if out.top_ids is not None else [[] for _ in seqs]
    top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else [[] for _ in seqs]
    result = {}
    for i, seq in enumerate(seqs):
        n, logprobs = seq.params.logprobs, None
        if n is not None:  # the top-n and the sampled token (which may be among them)
            logprobs = dict(zip(top_ids[i][:n], top_lps[i][:n]))
            logprobs[token_ids[i]] = lps[i]
        result[seq.request_id] = SampledToken(token_ids[i], logprobs)
    return result
