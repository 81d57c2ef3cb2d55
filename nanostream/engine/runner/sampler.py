"""Batched sampling on the device: grammar masks, logit bias, penalties, temperature, top-k / top-p /
min-p, logprobs.

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
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # (0, 1]
    # float32 rounds (2**24 - 1) + 0.5 up to 2**24: clamp that u = 1, whose E = -0.0 would make a masked
    # token's score 0 / -0.0 = NaN, which argmax picks.
    return -torch.log(uniform.clamp_max(1.0 - 2.0**-24))


def exponential_race(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    use_kernel: bool | None = None,
) -> torch.Tensor:
    """Token ids [B] int64: argmax(logits) where temperature is 0, else a draw from softmax(logits / T).

    logits: [B, V] float32, -inf = masked; temperature [B] float32; seeds, steps [B] int64. The draw is
    argmax(p / E) with E = exponential_noise(seeds, steps, V): an exponential race (the Gumbel-max trick).
    ``use_kernel`` (default: on CUDA) runs the fused Triton kernel, which never materialises the [B, V]
    noise and picks the same tokens; the torch path serves the CPU (tests force the kernel there too).

    >>> exponential_race(torch.tensor([[0.0, 5.0]]), torch.zeros(1), torch.zeros(1, dtype=torch.int64),
    ...                  torch.zeros(1, dtype=torch.int64)).tolist()
    [1]
    """
    if use_kernel if use_kernel is not None else logits.is_cuda:
        from nanostream.kernels.sampling import race_sample  # imports triton: only where a kernel runs

        return race_sample(logits, temperature, seeds, steps)
    temp = torch.where(temperature > 0, temperature, 1.0)[:, None]
    probs = (logits / temp).softmax(-1)
    sampled = (probs / exponential_noise(seeds, steps, logits.shape[-1])).argmax(-1)
    return torch.where(temperature > 0, sampled, logits.argmax(-1))


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
    # Grammar masks of the constrained rows (structured outputs), set once the grammars have seen the
    # previous token: bit j of word w of a row allows token 32 * w + j.
    mask_rows: torch.Tensor | None = None  # [C] int64, rows of the batch
    token_bitmask: torch.Tensor | None = None  # [C, ceil(V / 32)] int32
    # Logit bias as sparse (row, token, bias) triples, only when some row has one.
    bias_rows: torch.Tensor | None = None  # [N] int64
    bias_ids: torch.Tensor | None = None  # [N] int64
    bias_values: torch.Tensor | None = None  # [N] float32
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


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """-inf where a row's grammar forbids the token; rows not in ``rows`` are left as they are.

    logits [B, V]; rows [C] int64; bitmask [C, W] int32 with W * 32 >= V (xgrammar's layout).
    """
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).flatten(1)[:, : logits.shape[-1]].bool()  # [C, V]
    return logits.index_put((rows,), logits[rows].masked_fill(~allowed, float("-inf")))


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


def sample(logits: torch.Tensor, b: SamplingBatch, *, use_kernel: bool | None = None) -> SamplerOutput:
    """logits: [B, V] from the model, in its dtype. Returns the sampled ids and the asked-for logprobs.

    ``use_kernel``: the fused sampling kernel for the exponential race (default: on CUDA). The logits go
    to float32 first unless the kernel (or an argmax) alone reads them: it reads 16-bit values exactly,
    and at B = 256 and a 152k vocabulary the copy costs a decode step a tenth of a millisecond.
    """
    kernel = use_kernel if use_kernel is not None else logits.is_cuda
    plain = b.banned is None and b.output_counts is None and not (b.needs_top_k_p or b.needs_min_p)
    plain = plain and b.bias_rows is None
    if not (plain and b.max_logprobs < 0 and (kernel or b.all_greedy)):
        logits = logits.float()
    raw = logits
    if b.banned is not None:
        logits = logits.masked_fill(b.banned, float("-inf"))
    if b.token_bitmask is not None:
        logits = apply_token_bitmask(logits, b.mask_rows, b.token_bitmask)
    if b.bias_rows is not None:
        logits = logits.index_put((b.bias_rows, b.bias_ids), b.bias_values, accumulate=True)
    logits = apply_penalties(logits, b)
    if b.all_greedy:
        token_ids = logits.argmax(-1)
    elif b.needs_top_k_p or b.needs_min_p:
        # The masks act on temperature-scaled logits, so the race runs on those at T = 1; greedy rows take
        # the argmax of the unmasked logits (a top-k cut among equal maxima need not keep the lowest id).
        temp = torch.where(b.temperature > 0, b.temperature, 1.0)[:, None]
        scaled = apply_top_k_top_p_min_p(logits / temp, b)
        ones = torch.ones_like(b.temperature)
        sampled = exponential_race(scaled, ones, b.seeds, b.steps, kernel)
        token_ids = torch.where(b.temperature > 0, sampled, logits.argmax(-1))
    else:
        token_ids = exponential_race(logits, b.temperature, b.seeds, b.steps, kernel)
    if b.max_logprobs < 0:
        return SamplerOutput(token_ids, None, None, None)
    logprobs = raw.log_softmax(-1)
    top_logprobs, top_ids = logprobs.topk(b.max_logprobs, -1) if b.max_logprobs else (None, None)
    return SamplerOutput(token_ids, logprobs.gather(-1, token_ids[:, None])[:, 0], top_ids, top_logprobs)


@torch.inference_mode()
def warm_lm_head(model: torch.nn.Module, max_rows: int, hidden_size: int, dtype: torch.dtype, device: torch.device):
    """The LM head at every row count a step can sample, 1 ... ``max_rows`` (max_num_seqs). It runs eagerly, and
    cuBLAS picks and loads a GEMM kernel per row count on first use: on an H200 host a stall of several ms a step in
    the first burst's prompt steps (their row counts are new), unless it happened at start-up."""
    hidden = torch.zeros(max_rows, hidden_size, dtype=dtype, device=device)
    for rows in range(1, max_rows + 1):
        model.compute_logits(hidden[:rows])
    torch.cuda.synchronize(device)
