"""A step's sampling parameters as device tensors (``SamplingBatch``), and its samples read back per request."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanostream.engine.sampler import SamplerOutput, SamplingBatch
from nanostream.engine.sequence import Sequence
from nanostream.engine.step_inputs import to_device, to_device_packed


@dataclass
class SampledToken:
    token_id: int
    logprobs: dict[int, float] | None  # sampled token and the top-N, when the request asked


def make_sampling_batch(seqs: list[Sequence], vocab_size: int, device: torch.device) -> SamplingBatch:
    """One row per sequence that samples this step, in order."""
    p = [s.params for s in seqs]
    greedy = [x.greedy for x in p]
    vocab = vocab_size
    top_ks = [x.top_k if 0 < x.top_k < vocab else vocab for x in p]  # k >= the vocabulary keeps every token
    f32, i64 = torch.float32, torch.int64
    temperature, top_p, min_p = to_device_packed(
        device,
        f32,
        [0.0 if g else x.temperature for g, x in zip(greedy, p)],
        [x.top_p for x in p],
        [x.min_p for x in p],
    )
    top_k, seeds, steps = to_device_packed(
        device, i64, top_ks, [s.sampling_seed for s in seqs], [s.num_output_tokens for s in seqs]
    )
    batch = SamplingBatch(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seeds=seeds,
        steps=steps,
        all_greedy=all(greedy),
        needs_top_k_p=any(k < vocab for k in top_ks) or any(x.top_p < 1 for x in p),
        needs_min_p=any(x.min_p > 0 for x in p),
        max_logprobs=max((x.logprobs for x in p if x.logprobs is not None), default=-1),
    )
    if any(x.has_penalties for x in p):
        batch.repetition_penalty = to_device([x.repetition_penalty for x in p], f32, device)
        batch.presence_penalty = to_device([x.presence_penalty for x in p], f32, device)
        batch.frequency_penalty = to_device([x.frequency_penalty for x in p], f32, device)
        batch.output_counts = _token_rows([s.output_token_ids for s in seqs], vocab, device).float()
        batch.prompt_mask = _token_rows([s.prompt_token_ids for s in seqs], vocab, device) > 0
    banned = [s.stop_token_ids if s.num_output_tokens < s.params.min_tokens else () for s in seqs]
    if any(banned):
        batch.banned = _token_rows([list(b) for b in banned], vocab, device) > 0
    if any(x.logit_bias for x in p):
        triples = [(i, t, v) for i, x in enumerate(p) for t, v in x.logit_bias]
        rows, ids, values = zip(*triples)
        batch.bias_rows, batch.bias_ids = to_device_packed(device, i64, list(rows), list(ids))
        batch.bias_values = to_device(list(values), f32, device)
    return batch


def add_token_bitmask(batch: SamplingBatch, rows: list[int], bitmask: torch.Tensor, device: torch.device) -> None:
    """Set the grammar masks of ``rows`` (bitmask [len(rows), W] int32, on the host) on ``batch``."""
    if not rows:
        return
    batch.mask_rows = to_device(rows, torch.int64, device)
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
