"""The fused sampling kernel against the torch exponential race: same tokens, seeding, layout checks.

On a machine without a GPU the kernel runs under Triton's interpreter (tests/conftest.py), so the CPU
shapes stay small; the gpu-marked tests take the production shape and the sampled distribution.
"""

import dataclasses

import pytest
import torch
from test_sampler import make_batch

from nanostream.engine.runner.sampler import SamplingBatch, exponential_noise, exponential_race, sample
from nanostream.kernels.sampling import race_sample

F32, I64 = torch.float32, torch.int64
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the compiled kernel on a GPU, else the interpreter
# Scores (softmax(logits / T) / E) closer than this, relative, are a tie within float rounding: the two
# paths round logits / T (|.| up to ~200 here, ulp ~1.5e-5) and the noise differently.
TIE_RTOL = 1e-4

# (temperature, seed, step, mask): seeds cover the high word's carry (hi + 0x9E3779B9 >= 2**32 from
# hi = 0x61C88647 on) and the int64 extremes; masks leave 10% of the tokens, one, or only the ends finite.
ROWS = [
    (1.0, 0, 0, None),
    (0.0, 5, 3, None),
    (0.05, -1, 17, None),
    (30.0, 0x61C88647 << 32, 2, "sparse"),
    (0.7, (0x61C88646 << 32) | 0xFFFFFFFF, 999, None),
    (1.3, 2**63 - 1, 0, "one"),
    (0.0, -(2**63), 5, "sparse"),
    (2.0, 123456789, 2**40, "ends"),
]


def make_inputs(batch: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=g) * 2
    for i, (_, _, _, mask) in enumerate(ROWS[:batch]):
        if mask == "sparse":
            logits[i, torch.rand(vocab, generator=g) > 0.1] = float("-inf")
        elif mask == "one":
            keep = int(torch.randint(vocab, (1,), generator=g))
            logits[i, torch.arange(vocab) != keep] = float("-inf")
        elif mask == "ends":
            logits[i, 1:-1] = float("-inf")
    temperature, seeds, steps = (
        torch.tensor([r[k] for r in ROWS[:batch]], dtype=d) for k, d in ((0, F32), (1, I64), (2, I64))
    )
    return logits.to(DEVICE), temperature.to(DEVICE), seeds.to(DEVICE), steps.to(DEVICE)


def on_device(b: SamplingBatch) -> SamplingBatch:
    tensors = {f.name: getattr(b, f.name) for f in dataclasses.fields(b)}
    return dataclasses.replace(b, **{k: v.to(DEVICE) for k, v in tensors.items() if isinstance(v, torch.Tensor)})


def torch_race(logits, temperature, seeds, steps):
    """The torch path written out: token ids [B] and its scores [B, V]."""
    temp = torch.where(temperature > 0, temperature, 1.0)[:, None]
    scores = (logits / temp).softmax(-1) / exponential_noise(seeds, steps, logits.shape[-1])
    return torch.where(temperature > 0, scores.argmax(-1), logits.argmax(-1)), scores


def assert_same_draws(got, logits, temperature, seeds, steps) -> None:
    want, scores = torch_race(logits, temperature, seeds, steps)
    for r in (got != want).nonzero()[:, 0].tolist():
        # Only a sampled row whose two candidates tie within float rounding may differ.
        s_got, s_want = scores[r, got[r]].item(), scores[r, want[r]].item()
        assert temperature[r] > 0 and abs(s_got - s_want) <= TIE_RTOL * s_want, (r, got[r], want[r], s_got, s_want)
    assert torch.isfinite(logits.gather(-1, got[:, None])).all()  # never a masked token


# -- same tokens as the torch path ------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize(("batch", "vocab"), [(2, 1000), (5, 2500), (8, 1024), (8, 4097)])
def test_kernel_matches_torch_race(batch, vocab, num_splits):
    logits, temperature, seeds, steps = make_inputs(batch, vocab, seed=vocab + batch)
    got = race_sample(logits, temperature, seeds, steps, num_splits=num_splits)
    assert got.dtype == I64 and got.shape == (batch,)
    assert_same_draws(got, logits, temperature, seeds, steps)
    assert torch.equal(exponential_race(logits, temperature, seeds, steps, use_kernel=True), got)


def test_near_tie_check_catches_a_real_mismatch():
    # The tolerance above must not hide a wrong draw: the second-best token of a row is far from a tie.
    logits, temperature, seeds, steps = make_inputs(1, 1000, seed=0)
    _, scores = torch_race(logits, temperature, seeds, steps)
    with pytest.raises(AssertionError):
        assert_same_draws(scores.topk(2).indices[:, 1], logits, temperature, seeds, steps)


def test_greedy_rows_take_the_argmax_lowest_id_on_ties():
    vocab = 4097
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    logits[0, [10, 3000]] = 9.0  # equal maxima in different tiles and splits
    logits[1, [2100, 4096]] = 9.0
    logits[2, :-1] = float("-inf")  # only the last (partial-tile) token is finite
    zeros = torch.zeros(3, dtype=I64, device=DEVICE)
    for num_splits in (1, 3):
        got = race_sample(logits, torch.zeros(3, device=DEVICE), zeros, zeros, num_splits=num_splits)
        assert got.tolist() == [10, 2100, 4096] == logits.argmax(-1).tolist()


def test_seeded_rows_are_independent_of_batch_composition():
    vocab = 2000
    g = torch.Generator().manual_seed(2)
    targets = (torch.randn(3, vocab, generator=g) * 0.3).to(DEVICE)  # flat: any change of noise changes the draw
    t_temp = torch.tensor([1.0, 0.8, 1.5], device=DEVICE)
    t_seeds, t_steps = torch.tensor([7, 7, 2**40 + 3], device=DEVICE), torch.tensor([0, 1, 5], device=DEVICE)
    alone = [
        race_sample(targets[i : i + 1], t_temp[i : i + 1], t_seeds[i : i + 1], t_steps[i : i + 1]).item()
        for i in range(3)
    ]
    fillers = torch.randn(4, vocab, generator=g).to(DEVICE)
    slots = [4, 0, 2]  # where the targets go in a batch of 7, beside greedy and other seeded rows
    logits = torch.cat([fillers, fillers[:3]])
    temperature = torch.tensor([0.0, 1.0, 0.5, 2.0, 0.0, 1.0, 1.0], device=DEVICE)
    seeds = torch.tensor([7, 7, 8, 7, 1, 2, 3], device=DEVICE)
    steps = torch.tensor([0, 2, 0, 1, 0, 0, 0], device=DEVICE)
    for j, s in enumerate(slots):
        logits[s], temperature[s], seeds[s], steps[s] = targets[j], t_temp[j], t_seeds[j], t_steps[j]
    for num_splits in (None, 2):
        got = race_sample(logits, temperature, seeds, steps, num_splits=num_splits)
        assert got[slots].tolist() == alone
    assert len(set(alone)) == 3


def test_a_uniform_that_rounds_to_one():
    # (seed 572, step 0) hashes token 3245 to u = (2**24 - 0.5) / 2**24, which float32 rounds to 1. Its E
    # is clamped to -log(1 - 2**-24) > 0; unclamped it was -0.0, and a masked token's 0 / -0.0 = NaN won argmax.
    vocab, seeds, steps = 4096, torch.tensor([572], device=DEVICE), torch.tensor([0], device=DEVICE)
    noise = exponential_noise(seeds, steps, vocab)[0]
    assert noise.argmin() == 3245 and 0 < noise[3245] < 1e-7
    flat, ones = torch.zeros(1, vocab, device=DEVICE), torch.ones(1, device=DEVICE)
    assert race_sample(flat, ones, seeds, steps).item() == 3245  # the smallest E wins on flat logits
    assert torch_race(flat, ones, seeds, steps)[0].item() == 3245
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    top1 = on_device(make_batch([{"temperature": 1.0, "top_k": 1, "seed": 572, "step": 0}], vocab))
    for use_kernel in (False, True):
        assert sample(logits, top1, use_kernel=use_kernel).token_ids.item() == logits.argmax().item()


def test_sample_with_the_kernel_matches_the_torch_path():
    vocab = 300
    logits = (torch.randn(8, vocab, generator=torch.Generator().manual_seed(4)) * 2).to(DEVICE)
    rows = [
        {"temperature": 0.0},
        {"temperature": 1.0, "seed": 1},
        {"temperature": 0.6, "top_k": 20, "seed": 2, "step": 4},
        {"temperature": 1.2, "top_p": 0.8, "seed": -3, "step": 1},
        {"temperature": 0.9, "min_p": 0.05, "seed": 2**40, "step": 9},
        {"temperature": 1.0, "rep": 1.3, "presence": 0.5, "output": [1, 2, 2], "seed": 5},
        {"temperature": 1.5, "banned": logits[6].topk(3).indices.tolist(), "seed": 6},
        {"temperature": 0.0, "top_k": 3},
    ]
    for batch in map(on_device, (make_batch(rows, vocab, max_logprobs=2), make_batch(rows[:2] + rows[5:7], vocab))):
        want = sample(logits[: len(batch.seeds)], batch, use_kernel=False)
        got = sample(logits[: len(batch.seeds)], batch, use_kernel=True)
        assert torch.equal(got.token_ids, want.token_ids)
        if want.logprobs is not None:
            assert torch.equal(got.logprobs, want.logprobs) and torch.equal(got.top_ids, want.top_ids)


def test_half_precision_logits_sample_as_their_float32_values():
    # The model hands the sampler its own dtype; the kernel reads 16-bit logits without a float32 copy.
    vocab = 3000
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(8)) * 4
    rows = [{"temperature": t, "seed": i, "step": 3 * i} for i, t in enumerate([0.0, 0.5, 1.0, 1.5, 0.7, 0.0])]
    batch = on_device(make_batch(rows, vocab))
    for dtype in (torch.bfloat16, torch.float16):
        low = logits.to(dtype).to(DEVICE)
        want = sample(low.float(), batch, use_kernel=False).token_ids
        assert torch.equal(sample(low, batch, use_kernel=True).token_ids, want)
        with_logprobs = on_device(make_batch(rows, vocab, max_logprobs=1))  # the float32 path
        assert torch.equal(sample(low, with_logprobs, use_kernel=True).token_ids, want)


# -- launcher checks --------------------------------------------------------------------------------------------------


def test_launcher_accepts_a_row_strided_view():
    logits, temperature, seeds, steps = make_inputs(5, 2500, seed=5)
    padded = torch.full((5, 2600), 50.0, device=DEVICE)  # the padding would win if it were read
    padded[:, :2500] = logits
    view = padded[:, :2500]
    assert not view.is_contiguous()
    assert torch.equal(race_sample(view, temperature, seeds, steps), race_sample(logits, temperature, seeds, steps))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: {**a, "logits": a["logits"].double()}, "logits must be torch.float32, bfloat16 or float16"),
        (lambda a: {**a, "logits": a["logits"][0]}, r"logits must be \[B, V\]"),
        (lambda a: {**a, "logits": a["logits"].t().contiguous().t()}, "rows must be contiguous"),
        (lambda a: {**a, "logits": a["logits"][:, :0]}, "rows must be contiguous"),
        (lambda a: {**a, "temperature": a["temperature"].double()}, "temperature must be torch.float32"),
        (lambda a: {**a, "temperature": a["temperature"][:2]}, r"temperature must have shape \[3\]"),
        (lambda a: {**a, "seeds": a["seeds"].int()}, "seeds must be torch.int64"),
        (lambda a: {**a, "steps": a["steps"][:, None]}, r"steps must have shape \[3\]"),
    ],
)
def test_launcher_rejects_bad_inputs(change, message):
    args = dict(zip(("logits", "temperature", "seeds", "steps"), make_inputs(3, 100, seed=6)))
    with pytest.raises(ValueError, match=message):
        race_sample(**change(args))


# -- on a GPU: the production shape and the sampled distribution ------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 256])
def test_kernel_matches_torch_race_at_scale(batch):
    vocab, g = 151_936, torch.Generator(device="cuda").manual_seed(7)
    logits = torch.randn(batch, vocab, device="cuda", generator=g) * 3
    logits[::3] = logits[::3].masked_fill(torch.rand(logits[::3].shape, device="cuda", generator=g) > 0.01, -torch.inf)
    temperature = torch.rand(batch, device="cuda", generator=g) * 2
    temperature[::4] = 0.0
    seeds = torch.randint(-(2**62), 2**62, (batch,), device="cuda", generator=g)
    steps = torch.randint(0, 10_000, (batch,), device="cuda", generator=g)
    got = race_sample(logits, temperature, seeds, steps)
    assert_same_draws(got, logits, temperature, seeds, steps)
    b = on_device(make_batch([{"temperature": t} for t in temperature.tolist()], vocab))
    b.seeds, b.steps = seeds, steps
    assert torch.equal(sample(logits, b).token_ids, got)  # sample() runs the kernel on CUDA


@pytest.mark.gpu
def test_kernel_samples_the_softmax():
    n, temperature = 20_000, 0.7
    logits = torch.tensor([1.0, 0.4, 0.0, -0.7, -1.5, -torch.inf, 2.0, -3.0], device="cuda")
    ids = race_sample(
        logits.expand(n, -1).contiguous(),
        torch.full((n,), temperature, device="cuda"),
        torch.arange(n, device="cuda") * 7919,
        torch.arange(n, device="cuda") % 5,
    )
    counts = torch.bincount(ids, minlength=8).double().cpu()
    assert counts[5] == 0  # the masked token
    keep = torch.isfinite(logits.cpu())

    def chi2(p: torch.Tensor) -> float:
        expected = n * p[keep]
        return ((counts[keep] - expected) ** 2 / expected).sum().item()

    # 6 free categories, 5 degrees of freedom: P(chi2 > 25.7) = 1e-4; the T = 1 softmax is far off.
    assert chi2((logits.double().cpu() / temperature).softmax(-1)) < 25.7
    assert chi2(logits.double().cpu().softmax(-1)) > 200


@pytest.mark.gpu
def test_launcher_rejects_cpu_tensors_when_compiled():
    with pytest.raises(ValueError, match="must be on a CUDA device"):
        race_sample(torch.zeros(1, 8), torch.ones(1), torch.zeros(1, dtype=I64), torch.zeros(1, dtype=I64))
