"""The batched sampler against per-row references written here: masks, penalties, seeding, distribution, logprobs."""

import math
from collections import Counter

import pytest
import torch

from nanostream import SamplingParams
from nanostream.engine.runner.sampler import (
    SamplingBatch,
    apply_penalties,
    apply_top_k_top_p_min_p,
    exponential_noise,
    sample,
)

F32, I64 = torch.float32, torch.int64


def make_batch(rows: list[dict], vocab: int, max_logprobs: int = -1) -> SamplingBatch:
    """A SamplingBatch from per-row dicts. Keys (all optional): temperature, top_k (0 = off), top_p, min_p, seed,
    step, rep / presence / freq (penalties), prompt / output (token id lists), banned (token id list)."""

    def col(key, default):
        return [r.get(key, default) for r in rows]

    temperature, top_p, min_p = col("temperature", 1.0), col("top_p", 1.0), col("min_p", 0.0)
    top_k = [k if k > 0 else vocab for k in col("top_k", 0)]
    b = SamplingBatch(
        temperature=torch.tensor(temperature, dtype=F32),
        top_k=torch.tensor(top_k, dtype=I64),
        top_p=torch.tensor(top_p, dtype=F32),
        min_p=torch.tensor(min_p, dtype=F32),
        seeds=torch.tensor(col("seed", 0), dtype=I64),
        steps=torch.tensor(col("step", 0), dtype=I64),
        all_greedy=all(t == 0 for t in temperature),
        needs_top_k_p=any(k < vocab for k in top_k) or any(p < 1 for p in top_p),
        needs_min_p=any(m > 0 for m in min_p),
        max_logprobs=max_logprobs,
    )
    if any(k in r for r in rows for k in ("rep", "presence", "freq")):
        b.repetition_penalty = torch.tensor(col("rep", 1.0), dtype=F32)
        b.presence_penalty = torch.tensor(col("presence", 0.0), dtype=F32)
        b.frequency_penalty = torch.tensor(col("freq", 0.0), dtype=F32)
        b.output_counts = torch.zeros(len(rows), vocab, dtype=F32)
        b.prompt_mask = torch.zeros(len(rows), vocab, dtype=torch.bool)
        for i, r in enumerate(rows):
            for t in r.get("output", []):
                b.output_counts[i, t] += 1
            b.prompt_mask[i, r.get("prompt", [])] = True
    if any(r.get("banned") for r in rows):
        b.banned = torch.zeros(len(rows), vocab, dtype=torch.bool)
        for i, r in enumerate(rows):
            b.banned[i, r.get("banned", [])] = True
    return b


def ref_penalties(row: torch.Tensor, prompt: list[int], output: list[int], rep: float, presence: float, freq: float):
    """vLLM: repetition over prompt+output (logit > 0 divided, else multiplied), then frequency and presence."""
    counts = Counter(output)
    out = []
    for t, x in enumerate(row.tolist()):
        if t in prompt or t in counts:
            x = x / rep if x > 0 else x * rep
        out.append(x - freq * counts[t] - presence * (t in counts))
    return torch.tensor(out, dtype=torch.float64)


def ref_kept(scaled: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """vLLM's order on temperature-scaled logits: min-p, then top-k, then top-p on the top-k renormalised mass."""
    p = scaled.double().softmax(-1).tolist()
    kept = sorted((t for t in range(len(p)) if p[t] >= min_p * max(p)), key=lambda t: -p[t])[: top_k or len(p)]
    mass, acc, out = sum(p[t] for t in kept), 0.0, set()
    for t in kept:  # the smallest prefix whose mass reaches top_p, at least one token
        out.add(t)
        acc += p[t]
        if acc >= top_p * mass:
            break
    return out


def random_logits(b: int, v: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * scale


def logits_of(probs: list[float], order: list[int]) -> torch.Tensor:
    """[V] logits whose softmax puts probs[i] on token order[i] (shifted: softmax is shift-invariant)."""
    out = torch.empty(len(probs))
    out[order] = torch.tensor(probs).log() + 3.0
    return out


# Crafted distribution over 8 tokens, most likely token first, scattered over the ids.
PROBS = [0.3, 0.2, 0.15, 0.12, 0.1, 0.07, 0.04, 0.02]
ORDER = [5, 2, 7, 0, 3, 6, 1, 4]


# -- greedy -----------------------------------------------------------------------------------------------------------


def test_greedy_rows_take_the_argmax():
    logits = random_logits(24, 200, seed=0)
    argmax = logits.argmax(-1)
    all_greedy = make_batch([{"temperature": 0.0, "seed": i} for i in range(24)], 200)
    assert all_greedy.all_greedy
    assert torch.equal(sample(logits, all_greedy).token_ids, argmax)
    # Mixed batch: temperature-0 rows and top_k=1 rows (at a high temperature) beside sampled rows.
    rows = [[{"temperature": 0.0}, {"temperature": 2.0, "top_k": 1}, {"temperature": 2.0}][i % 3] for i in range(24)]
    for i, r in enumerate(rows):
        r.update(seed=i, step=i * 7)
    ids = sample(logits, make_batch(rows, 200)).token_ids
    greedy = [i for i in range(24) if i % 3 != 2]
    assert torch.equal(ids[greedy], argmax[greedy])
    assert not torch.equal(ids[2::3], argmax[2::3])  # the T=2 rows over 200 tokens do sample


def test_greedy_takes_the_argmax_after_penalties():
    v = 50
    logits = random_logits(12, v, seed=1)
    rows = []
    for i in range(12):
        top = logits[i].topk(3).indices.tolist()
        rows.append(
            {
                "temperature": 0.0,
                "rep": 1.5 + i / 4,
                "presence": 0.5,
                "freq": 0.4,
                "prompt": top[:1],
                "output": top[1:] * 2,
            }
        )
    want = torch.stack(
        [
            ref_penalties(logits[i], r["prompt"], r["output"], r["rep"], r["presence"], r["freq"])
            for i, r in enumerate(rows)
        ]
    ).argmax(-1)
    assert (want != logits.argmax(-1)).sum() >= 6  # the penalties do move the argmax of these rows
    assert torch.equal(sample(logits, make_batch(rows, v)).token_ids, want)
    for i, r in enumerate(rows):  # the same through top_k=1 on the sampling path
        r.update(temperature=1.0, top_k=1, seed=i)
    assert torch.equal(sample(logits, make_batch(rows, v)).token_ids, want)


# -- penalties --------------------------------------------------------------------------------------------------------


def test_penalties_match_vllm_reference():
    v, n = 40, 16
    logits = random_logits(n, v, seed=2)
    logits[:, :4] = torch.tensor([0.0, -0.0, 1e-3, -1e-3])  # the sign boundary of the repetition penalty
    g = torch.Generator().manual_seed(3)
    rows = []
    for i in range(n):
        prompt = torch.randint(0, v, (int(torch.randint(0, 12, (1,), generator=g)),), generator=g).tolist()
        output = torch.randint(0, v, (int(torch.randint(0, 20, (1,), generator=g)),), generator=g).tolist()
        prompt += [0, 1, 2, 3] if i % 2 else []
        output += [0, 2] if i % 3 == 0 else []
        rep, presence, freq = (1.0, 0.0, 0.0) if i == 0 else (0.5 + i / 8, (i % 5 - 2) / 2, (i % 4 - 1.5) / 1.5)
        rows.append({"rep": rep, "presence": presence, "freq": freq, "prompt": prompt, "output": output})
    got = apply_penalties(logits.clone(), make_batch(rows, v))
    want = torch.stack(
        [
            ref_penalties(logits[i], r["prompt"], r["output"], r["rep"], r["presence"], r["freq"])
            for i, r in enumerate(rows)
        ]
    )
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[0], logits[0])  # neutral penalties leave a row alone
    assert (got != logits).any(-1)[1:].all()


# -- top-k / top-p / min-p --------------------------------------------------------------------------------------------

CRAFTED_MASKS = [
    # (top_k, top_p, min_p, kept ranks in PROBS)
    (0, 1.0, 0.0, range(8)),
    (3, 1.0, 0.0, range(3)),
    (1, 1.0, 0.0, range(1)),
    (0, 0.25, 0.0, range(1)),  # the top token alone already reaches top_p
    (0, 0.6, 0.0, range(3)),  # 0.3 + 0.2 < 0.6 <= 0.3 + 0.2 + 0.15
    (0, 0.7, 0.0, range(4)),
    (0, 0.99, 0.0, range(8)),
    (0, 1.0, 0.35, range(4)),  # p >= 0.105
    (0, 1.0, 0.6, range(2)),  # p >= 0.18
    (0, 1.0, 0.25, range(5)),  # p >= 0.075
    (3, 0.6, 0.0, range(2)),  # top-p over the top-3 mass 0.65: 0.3 / 0.65 < 0.6 <= 0.5 / 0.65
    (2, 0.6, 0.0, range(1)),  # top-p over the top-2 mass 0.5: 0.3 / 0.5 >= 0.6
    (0, 0.8, 0.25, range(4)),  # min-p leaves 0.87, top-p over it: 0.65 / 0.87 < 0.8 <= 0.77 / 0.87
    (4, 0.6, 0.1, range(2)),  # all three: min-p drops 0.02, top-k keeps 0.77, top-p 0.5 / 0.77 >= 0.6
]


@pytest.mark.parametrize(("top_k", "top_p", "min_p", "ranks"), CRAFTED_MASKS)
def test_masks_on_crafted_logits(top_k, top_p, min_p, ranks):
    logits = logits_of(PROBS, ORDER)
    want = {ORDER[r] for r in ranks}
    assert ref_kept(logits, top_k, top_p, min_p) == want
    # The row sits in a batch whose other rows switch on every mask.
    rows = [{"top_k": top_k, "top_p": top_p, "min_p": min_p}, {"top_k": 2, "top_p": 0.5, "min_p": 0.2}]
    out = apply_top_k_top_p_min_p(torch.stack([logits, logits]), make_batch(rows, 8))
    assert set(torch.isfinite(out[0]).nonzero()[:, 0].tolist()) == want
    kept = sorted(want)
    assert torch.equal(out[0, kept], logits[kept])  # kept logits are untouched


def test_masks_match_reference_on_random_logits():
    n, v = 96, 60
    logits = random_logits(n, v, seed=4, scale=1.5)
    g = torch.Generator().manual_seed(5)
    rows = []
    for i in range(n):
        u = torch.rand(3, generator=g).tolist()
        rows.append(
            {
                "top_k": [0, 1, 5, 20][i % 4],
                "top_p": [1.0, 0.3 + 0.7 * u[0]][(i // 4) % 2],
                "min_p": [0.0, 0.3 * u[1]][(i // 8) % 2],
            }
        )
    out = apply_top_k_top_p_min_p(logits, make_batch(rows, v))
    for i, r in enumerate(rows):
        got = set(torch.isfinite(out[i]).nonzero()[:, 0].tolist())
        assert got == ref_kept(logits[i], r["top_k"], r["top_p"], r["min_p"]), f"row {i}: {r}"


def test_disabled_top_p_keeps_every_token_of_a_large_vocabulary():
    # A float32 cumulative sum over 32k probabilities can pass 1; top_p=1 must still keep the whole tail.
    v = 32_000
    logits = random_logits(4, v, seed=6, scale=3.0)
    rows = [{}, {"top_k": 5}, {"top_k": v}, {"top_p": 0.5}]
    out = apply_top_k_top_p_min_p(logits, make_batch(rows, v))
    assert torch.equal(out[0], logits[0])
    assert torch.equal(out[2], logits[2])
    assert torch.isfinite(out[1]).sum() == 5


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [(1.0, 0, 1.0, 0.0), (1.0, 3, 1.0, 0.0), (1.0, 0, 0.7, 0.0), (0.7, 0, 1.0, 0.3), (1.0, 4, 0.6, 0.1)],
)
def test_sampled_support_equals_reference_kept_set(temperature, top_k, top_p, min_p):
    n = 3000  # every kept token has probability >= 0.02, so P(one is never drawn) < 3000 * 0.98**3000 ~ 1e-23
    logits = logits_of(PROBS, ORDER).expand(n, 8)
    row = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p}
    rows = [{**row, "seed": 17 + i % 300, "step": i // 300} for i in range(n)]
    ids = sample(logits, make_batch(rows, 8)).token_ids
    assert set(ids.tolist()) == ref_kept(logits[0] / temperature, top_k, top_p, min_p)


# -- min_tokens banning -----------------------------------------------------------------------------------------------


def test_banned_tokens_are_never_sampled():
    v, n = 10, 2000
    logits = logits_of([0.4, 0.25, 0.1, 0.08, 0.06, 0.04, 0.03, 0.02, 0.01, 0.01], list(range(v))).expand(n, v)
    banned = [0, 1, 5]  # the two most likely tokens and one more
    rows = [{"temperature": 1.5, "seed": i, "step": i % 11, "banned": banned} for i in range(n)]
    rows[0] = {"temperature": 0.0, "banned": banned}
    # A negative presence penalty on a banned token already in the output must not bring it back.
    rows[1] |= {"presence": -2.0, "freq": -2.0, "output": [1, 1, 1]}
    rows[2] |= {"rep": 0.1, "prompt": [0]}
    ids = sample(logits, make_batch(rows, v)).token_ids
    assert ids[0] == 2  # greedy: the most likely token that is not banned
    assert not set(ids.tolist()) & set(banned)
    assert set(ids.tolist()) == set(range(v)) - set(banned)
    greedy = make_batch([{"temperature": 0.0, "banned": banned}, {"temperature": 0.0}], v)
    assert sample(logits[:2], greedy).token_ids.tolist() == [2, 0]


# -- seeding ----------------------------------------------------------------------------------------------------------

TARGETS = [
    {"temperature": 1.0, "seed": 1234, "step": 7},
    {"temperature": 0.8, "top_p": 0.95, "seed": 1234, "step": 8},
    {"temperature": 1.3, "top_k": 50, "seed": 99, "step": 0},
    {"temperature": 1.0, "min_p": 0.05, "seed": 2**40 + 5, "step": 3},
    {"temperature": 0.9, "top_k": 100, "top_p": 0.9, "min_p": 0.01, "seed": 7, "step": 123},
]


def test_seeded_rows_are_independent_of_batch_composition():
    v = 300
    target_logits = random_logits(len(TARGETS), v, seed=7, scale=0.5)  # flat: any change of noise changes the draw
    alone = [sample(target_logits[i : i + 1], make_batch([t], v)).token_ids.item() for i, t in enumerate(TARGETS)]
    together = sample(target_logits, make_batch(TARGETS, v)).token_ids.tolist()
    assert together == alone
    # Inside larger batches, shuffled, beside rows with other settings, penalties, bans and logprobs.
    fillers = [
        {"temperature": 0.0},
        {"temperature": 0.5, "top_k": 2, "seed": 1234, "step": 9},
        {"temperature": 1.0, "rep": 1.3, "presence": 0.5, "output": [1, 2, 2]},
        {"temperature": 1.0, "min_p": 0.5, "banned": [0, 1, 2]},
        {"temperature": 2.0, "top_p": 0.2, "freq": 1.0, "prompt": [4]},
    ]
    filler_logits = random_logits(len(fillers), v, seed=8)
    for size, perm_seed in ((8, 0), (13, 1), (31, 2)):
        perm = torch.randperm(size, generator=torch.Generator().manual_seed(perm_seed)).tolist()
        slots = perm[: len(TARGETS)]  # where each target goes
        rows = [fillers[i % len(fillers)] for i in range(size)]
        logits = filler_logits[torch.arange(size) % len(fillers)]  # a copy: advanced indexing
        for j, slot in enumerate(slots):
            rows[slot], logits[slot] = TARGETS[j], target_logits[j]
        ids = sample(logits, make_batch(rows, v, max_logprobs=3)).token_ids
        assert ids[slots].tolist() == alone, f"batch of {size}"


def test_different_seeds_or_steps_give_different_draws():
    v, n = 1000, 200
    logits = torch.zeros(n, v)  # uniform: each draw is a fresh uniform pick over 1000 ids

    def draws(seeds, steps):
        return sample(logits, make_batch([{"seed": a, "step": b} for a, b in zip(seeds, steps)], v)).token_ids.tolist()

    over_steps = draws([42] * n, range(n))
    over_seeds = draws(range(n), [5] * n)
    high_seeds = draws([s << 32 for s in range(n)], [5] * n)  # seeds that differ only in their high 32 bits
    for ids in (over_steps, over_seeds, high_seeds):
        assert len(set(ids)) > 150  # 200 uniform draws over 1000 ids: ~181 distinct on average, sd ~4
    assert draws([42] * n, [3] * n) == [over_steps[3]] * n  # the same (seed, step) always draws the same token


def test_exponential_noise_depends_only_on_seed_step_and_token():
    seeds = torch.tensor([0, 1, 2**33 + 1, 1, 0, 2**62 + 7], dtype=I64)
    steps = torch.tensor([0, 0, 0, 1, 0, 1000], dtype=I64)
    noise = exponential_noise(seeds, steps, 4096)
    assert torch.equal(noise[0], noise[4])  # same (seed, step) in another row
    assert torch.equal(noise, exponential_noise(seeds, steps, 5000)[:, :4096])  # a token's noise ignores vocab size
    for i in range(6):
        assert torch.equal(noise[i], exponential_noise(seeds[i : i + 1], steps[i : i + 1], 4096)[0])
    distinct = noise[[0, 1, 2, 3, 5]]  # any other seed or step: (nearly) every token's noise differs
    for i in range(5):
        for j in range(i):
            assert (distinct[i] != distinct[j]).float().mean() > 0.99
    assert not torch.equal(noise[:, 1:], noise[:, :-1])  # tokens of one row differ too


def test_exponential_noise_is_exp1_distributed():
    n_rows, v = 64, 4096
    seeds = torch.arange(n_rows, dtype=I64) * 7919
    noise = exponential_noise(seeds, torch.arange(n_rows, dtype=I64) % 5, v)
    assert torch.isfinite(noise).all() and (noise > 0).all()
    n = noise.numel()
    x = noise.double()
    assert abs(x.mean().item() - 1) < 4 / math.sqrt(n)  # Exp(1): mean 1, sd 1
    p = math.exp(-1)  # P(E > 1)
    assert abs((x > 1).double().mean().item() - p) < 4 * math.sqrt(p * (1 - p) / n)
    assert abs(x.var().item() - 1) < 4 * math.sqrt(8 / n)  # var of the sample variance of Exp(1) ~ (mu4 - 1) / n


@pytest.mark.parametrize("temperature", [0.5, 1.5])
def test_temperature_sampling_matches_softmax(temperature):
    n, v = 20_000, 5
    logits = torch.tensor([1.0, 0.4, 0.0, -0.7, -1.5])
    rows = [{"temperature": temperature, "seed": 1000 + i % 4000, "step": i // 4000} for i in range(n)]
    ids = sample(logits.expand(n, v), make_batch(rows, v)).token_ids
    freq = torch.bincount(ids, minlength=v).double() / n
    p = (logits.double() / temperature).softmax(-1)
    sigma = (p * (1 - p) / n).sqrt()
    # 10 binomial frequencies (two temperatures): P(any beyond 4 sigma) ~ 6e-4; the softmax at T=1 is > 10 sigma off.
    assert ((freq - p).abs() < 4 * sigma).all(), (freq, p)
    assert ((freq - logits.double().softmax(-1)).abs() > 10 * sigma).any()


# -- logprobs ---------------------------------------------------------------------------------------------------------


def test_logprobs_are_of_the_raw_logits():
    v = 64
    logits = random_logits(6, v, seed=9)
    rows = [
        {"temperature": 0.0},
        {"temperature": 0.3, "seed": 1},
        {"temperature": 2.0, "top_k": 3, "seed": 2},
        {"temperature": 1.0, "rep": 2.0, "presence": 1.0, "freq": 1.0, "output": list(range(0, v, 2)), "seed": 3},
        {"temperature": 1.0, "banned": logits[4].topk(2).indices.tolist(), "seed": 4},
        {"temperature": 0.7, "top_p": 0.5, "min_p": 0.2, "seed": 5},
    ]
    batch = make_batch(rows, v, max_logprobs=5)
    out = sample(logits, batch)
    want = logits.double().log_softmax(-1)
    torch.testing.assert_close(out.logprobs.double(), want.gather(-1, out.token_ids[:, None])[:, 0])
    top_lp, top_ids = want.topk(5, -1)
    assert torch.equal(out.top_ids, top_ids)
    torch.testing.assert_close(out.top_logprobs.double(), top_lp)
    processed = make_batch(rows, v)  # logprobs of the penalised, masked logits would differ for rows 3 and 4
    assert not torch.equal(apply_penalties(logits, processed)[3], logits[3])
    assert out.token_ids[4] not in rows[4]["banned"]
    # logprobs=0: the sampled token's logprob only; no row asking: nothing.
    zero = sample(logits, make_batch(rows, v, max_logprobs=0))
    assert zero.top_ids is None and zero.top_logprobs is None
    torch.testing.assert_close(zero.logprobs, out.logprobs)
    none = sample(logits, make_batch(rows, v))
    assert none.logprobs is None and none.top_ids is None and none.top_logprobs is None


# -- SamplingParams conventions (what the engine relies on, without a ModelRunner) ------------------------------------


def row_of(p: SamplingParams, seed: int = 0, step: int = 0) -> dict:
    return {
        "temperature": p.temperature,
        "top_k": p.top_k,  # 0 and -1: off (make_batch maps them to the vocab size)
        "top_p": p.top_p,
        "min_p": p.min_p,
        "rep": p.repetition_penalty,
        "presence": p.presence_penalty,
        "freq": p.frequency_penalty,
        "seed": seed,
        "step": step,
    }


def test_default_sampling_params_leave_logits_untouched():
    v = 32_000
    logits = random_logits(3, v, seed=10, scale=3.0)
    busy = {"top_k": 4, "top_p": 0.5, "min_p": 0.1, "rep": 1.5, "presence": 1.0, "output": [0, 1], "prompt": [2]}
    rows = [row_of(SamplingParams()), row_of(SamplingParams(top_k=-1)), {**row_of(SamplingParams()), **busy}]
    rows[0]["output"], rows[0]["prompt"] = [5, 5, 6], [7]  # history does nothing without penalties
    batch = make_batch(rows, v)
    assert batch.needs_top_k_p and batch.needs_min_p and batch.output_counts is not None
    assert torch.equal(apply_penalties(logits, batch)[:2], logits[:2])
    assert torch.equal(apply_top_k_top_p_min_p(logits, batch)[:2], logits[:2])
    assert torch.isfinite(apply_top_k_top_p_min_p(logits, batch)[2]).sum() <= 4


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(temperature=1.3, top_k=1)])
def test_greedy_sampling_params_sample_the_argmax(params):
    assert params.greedy
    logits = random_logits(40, 500, seed=11, scale=0.3)
    rows = [row_of(params, seed=i, step=i) for i in range(40)]
    assert torch.equal(sample(logits, make_batch(rows, 500)).token_ids, logits.argmax(-1))


# -- grammar masks and logit bias ----------------------------------------------------------------------------------


def packed(allowed: list[list[int]], vocab: int) -> torch.Tensor:
    """xgrammar's bitmask layout: bit j of int32 word w allows token 32 * w + j."""
    words = torch.zeros(len(allowed), -(-vocab // 32), dtype=torch.int64)
    for r, ids in enumerate(allowed):
        for t in ids:
            words[r, t // 32] |= 1 << (t % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # bit 31 is the sign bit


def test_grammar_masks_restrict_only_their_rows():
    v, n = 70, 600  # three words a row; tokens 31, 32 and 63 sit on word edges and the sign bit
    allowed = [31, 32, 63, 69]
    logits = random_logits(n, v, seed=4)
    rows = [{"temperature": 1.2, "seed": i, "step": i % 5} for i in range(n)]
    rows[0] = {"temperature": 0.0}
    b = make_batch(rows, v)
    masked = list(range(0, n, 2))  # every other row is constrained
    b.mask_rows, b.token_bitmask = torch.tensor(masked), packed([allowed] * len(masked), v)
    ids = sample(logits, b).token_ids.tolist()
    assert set(ids[0::2]) == set(allowed)
    assert ids[0] == max(allowed, key=lambda t: logits[0, t].item())  # greedy: the best allowed token
    free = make_batch(rows, v)
    assert ids[1::2] == sample(logits, free).token_ids.tolist()[1::2]  # the other rows draw what they drew


def test_grammar_masks_apply_before_top_k_and_logprobs_stay_raw():
    v = 40
    logits = random_logits(2, v, seed=5)
    b = make_batch([{"temperature": 1.0, "top_k": 1, "seed": 1}] * 2, v, max_logprobs=2)
    b.mask_rows, b.token_bitmask = torch.tensor([1]), packed([[7]], v)
    out = sample(logits, b)
    assert out.token_ids.tolist() == [logits[0].argmax().item(), 7]
    assert out.logprobs[1].item() == pytest.approx(logits[1].log_softmax(-1)[7].item(), abs=1e-6)


def test_logit_bias_adds_to_the_logits_of_its_rows():
    v = 16
    logits = torch.zeros(3, v)
    b = make_batch([{"temperature": 0.0}] * 3, v)
    b.bias_rows, b.bias_ids, b.bias_values = (
        torch.tensor([0, 1, 1]),
        torch.tensor([9, 4, 5]),
        torch.tensor([5.0, -1.0, 2.0]),
    )
    assert sample(logits, b).token_ids.tolist() == [9, 5, 0]
    lp = make_batch([{"temperature": 0.0}], v, max_logprobs=1)
    lp.bias_rows, lp.bias_ids, lp.bias_values = torch.tensor([0]), torch.tensor([3]), torch.tensor([100.0])
    out = sample(logits[:1], lp)
    assert out.token_ids.tolist() == [3] and out.logprobs.item() == pytest.approx(-math.log(v))  # raw logprobs
