"""The batch-invariant mode (``batch_invariant=True``): the same request gives the same tokens, and the same
log-probabilities to the last bit, alone or beside any other requests.

The probes are 16 prompts, some sharing a prefix (prefix-cache hits); the others are prompts of up to a few
hundred tokens, so that with a small token budget the probes' prompts are cut into chunks that differ from
run to run, and with a small KV pool some requests are preempted and recomputed. Log-probabilities are
compared exactly: they show a difference in the last bit of a logit long before a greedy token flips.
The models are drawn with a realistic init (std 0.02), whose next-token distributions are flat.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from nanostream import LLM, SamplingParams
from nanostream.config import EngineConfig
from nanostream.layers.batch_invariant import CPU_ROWS, invariant_linear
from nanostream.testing import make_tiny_model
from nanostream.testing.tiny_model import TINY_PRESETS

ENGINE = dict(max_num_seqs=32, max_num_batched_tokens=128, kvcache_block_size=16, num_kvcache_blocks=96)
"""A token budget that cuts prompts into chunks, a pool that preempts with 64 others."""


@pytest.fixture(scope="module")
def flat_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("flat"), seed=21, init_std=0.02)


@pytest.fixture(scope="module")
def flat_moe(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("flat_moe"), **{**TINY_PRESETS["qwen2_moe"], "init_std": 0.02})


def prompts(vocab: int, lengths: list[int], seed: int, shared: int = 0) -> list[list[int]]:
    """Random prompts of ``lengths``; the first half of them start with one prefix of ``shared`` tokens."""
    rng = random.Random(seed)
    prefix = [rng.randrange(5, vocab) for _ in range(shared)]
    out = [[rng.randrange(5, vocab) for _ in range(n)] for n in lengths]
    return [prefix + p if i < len(out) // 2 else p for i, p in enumerate(out)]


def run(llm: LLM, probes, others, seeded: bool, max_tokens: int = 8):
    """The probes' (token ids, logprobs), generated beside ``others``; the others go first, so that the probes
    meet the batch in another state each run."""
    batch = others + probes
    sampling = dict(max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    params = [
        SamplingParams(**sampling, temperature=0.8, seed=1000 + i)
        if seeded
        else SamplingParams(**sampling, temperature=0.0)
        for i in range(len(batch))
    ]
    if seeded:  # a probe's seed is its own whatever stands before it
        params[len(others) :] = [SamplingParams(**sampling, temperature=0.8, seed=7 + i) for i in range(len(probes))]
    outs = llm.generate(batch, params, use_tqdm=False)[len(others) :]
    return [(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs]) for o in outs]


def differing(llm: LLM, probes, others, seeded: bool, details: list | None = None) -> dict[int, int]:
    """For 1, 7 and 64 others: how many probes' ids or logprobs differ from the probes' run alone. ``details``
    collects (others, probe, its prompt length, the first differing token) of each."""
    alone = run(llm, probes, [], seeded)
    counts = {}
    for n in (1, 7, 64):
        got = run(llm, probes, others[:n], seeded)
        bad = [i for i, (a, b) in enumerate(zip(alone, got)) if a != b]
        counts[n] = len(bad)
        for i in bad if details is not None else ():
            first = next(t for t, (x, y) in enumerate(zip(alone[i][1], got[i][1])) if x != y)
            details.append((n, i, len(probes[i]), first))
    return counts


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_same_tokens_and_logprobs_alone_and_in_any_batch(flat_model, seeded):
    probes = prompts(512, [1, 2, 5, 9, 17, 31, 40, 47, 3, 8, 13, 21, 34, 55, 60, 70], seed=1, shared=20)
    others = prompts(512, [random.Random(i).randint(1, 300) for i in range(64)], seed=2)
    llm = LLM(str(flat_model), batch_invariant=True, **ENGINE)
    assert differing(llm, probes, others, seeded) == {1: 0, 7: 0, 64: 0}
    stats = llm.engine.stats()  # what the runs went through
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0, stats


def test_without_the_mode_logprobs_follow_the_batch(flat_model):
    # What the mode is for, on the CPU: float32 F.linear blocks its rows by their count, so that a probe's
    # logprobs change with the others in its steps (its greedy tokens, at these shapes, do not).
    probes = prompts(512, [1, 2, 5, 9, 17, 31, 40, 47, 3, 8, 13, 21, 34, 55, 60, 70], seed=1, shared=20)
    others = prompts(512, [random.Random(i).randint(1, 300) for i in range(64)], seed=2)
    llm = LLM(str(flat_model), **ENGINE)
    assert sum(differing(llm, probes, others, seeded=False).values()) > 0


def test_moe_same_tokens_alone_and_in_any_batch(flat_moe):
    # Qwen2-MoE: router, routed experts (each expert's rows through the mode's GEMM), gated shared expert.
    probes = prompts(512, [1, 4, 9, 16, 25, 36, 20, 30], seed=3, shared=12)
    others = prompts(512, [random.Random(i).randint(1, 200) for i in range(64)], seed=4)
    llm = LLM(str(flat_moe), batch_invariant=True, **ENGINE)
    assert differing(llm, probes, others, seeded=False) == {1: 0, 7: 0, 64: 0}


def test_two_ranks_same_tokens_alone_and_in_any_batch(flat_model):
    # Tensor parallelism (gloo): each rank's GEMMs are the mode's, and an all-reduce of two adds a + b.
    probes = prompts(512, [1, 5, 17, 40, 8, 21, 55, 70], seed=1, shared=20)
    others = prompts(512, [random.Random(i).randint(1, 300) for i in range(64)], seed=2)
    with LLM(str(flat_model), batch_invariant=True, tensor_parallel_size=2, **ENGINE) as llm:
        assert differing(llm, probes, others, seeded=True) == {1: 0, 7: 0, 64: 0}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_linear_rows_do_not_depend_on_the_row_count(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3 * CPU_ROWS + 5, 96, generator=gen).to(dtype)
    w = torch.randn(80, 96, generator=gen).to(dtype)
    b = torch.randn(80, generator=gen).to(dtype)
    whole = invariant_linear(x, w, b)
    torch.testing.assert_close(whole, F.linear(x, w, b))
    for m in (1, 2, CPU_ROWS - 1, CPU_ROWS, CPU_ROWS + 1, 70):
        for start in (0, 3):
            assert torch.equal(invariant_linear(x[start : start + m], w, b), whole[start : start + m]), (m, start)
    assert invariant_linear(x[:0], w, b).shape == (0, 80)
    assert invariant_linear(x.view(1, -1, 96), w).shape == (1, x.shape[0], 80)  # leading dims kept


def test_invariant_triton_matmul_computes_the_linear():
    # Under the interpreter on the CPU: the kernel's arithmetic (tiles, masks, bias); its invariance is the
    # GPU test's (the interpreter's dots are NumPy's).
    from nanostream.kernels.invariant_matmul import invariant_matmul

    gen = torch.Generator().manual_seed(1)
    for m, n, k in ((1, 40, 72), (37, 130, 100)):
        x, w, b = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
        torch.testing.assert_close(invariant_matmul(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(invariant_matmul(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 20])
def test_invariant_attention_kernels_compute_attention(window):
    # Under the interpreter: the mode's kernels (one split, every tile masked, from an aligned start) attend as
    # the default ones do; their bit-for-bit agreement is the GPU test's.
    from nanostream.kernels.decode_attention import paged_decode_attention
    from nanostream.kernels.prefill_attention import paged_prefill_attention

    gen = torch.Generator().manual_seed(3)
    lens = torch.tensor([1, 70, 130], dtype=torch.int32)
    b, hq, hkv, d, page = 3, 4, 2, 32, 16
    k = torch.randn(b * 9, page, hkv, d, generator=gen)
    v = torch.randn(b * 9, page, hkv, d, generator=gen)
    tables = torch.arange(b * 9, dtype=torch.int32).view(b, 9)
    q = torch.randn(b, hq, d, generator=gen)
    ref = paged_decode_attention(q, k, v, tables, lens, 0.2, 144, window=window)
    got = paged_decode_attention(q, k, v, tables, lens, 0.2, 144, window=window, batch_invariant=True)
    torch.testing.assert_close(got, ref)
    cu = torch.tensor([0, 1, 31, 71], dtype=torch.int32)
    q = torch.randn(71, hq, d, generator=gen)
    ref = paged_prefill_attention(q, k, v, cu, lens, tables, 40, 0.2, window=window)
    got = paged_prefill_attention(q, k, v, cu, lens, tables, 40, 0.2, window=window, batch_invariant=True)
    torch.testing.assert_close(got, ref)


def test_what_the_mode_cannot_cover_is_refused():
    with pytest.raises(ValueError, match="batch_invariant runs on 1 or 2 ranks"):
        EngineConfig(model="m", batch_invariant=True, tensor_parallel_size=4)
    with pytest.raises(ValueError, match="batch_invariant needs attention_backend"):
        EngineConfig(model="m", batch_invariant=True, attention_backend="flash_attn")
    EngineConfig(model="m", batch_invariant=True, tensor_parallel_size=2, attention_backend="triton")


# ---- on the GPU -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("gpu_flat"), seed=22, init_std=0.02, weights_dtype="bfloat16",
        hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_invariant_matmul_rows_do_not_depend_on_the_row_count(dtype):
    from nanostream.kernels.invariant_matmul import invariant_matmul

    gen = torch.Generator(device="cuda").manual_seed(0)
    for n, k in ((4096, 1024), (1024, 3072), (151936 // 8, 1024)):
        x = torch.randn(1000, k, device="cuda", generator=gen, dtype=dtype)
        w = torch.randn(n, k, device="cuda", generator=gen, dtype=dtype) / k**0.5
        whole = invariant_matmul(x, w)
        torch.testing.assert_close(whole.float(), F.linear(x, w).float(), rtol=2e-2, atol=2e-2)
        for m in (1, 3, 16, 64, 129, 999):
            assert torch.equal(invariant_matmul(x[:m], w), whole[:m]), (n, k, m)
            assert torch.equal(invariant_matmul(x[1 : 1 + m], w), whole[1 : 1 + m]), (n, k, m)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hq, hkv, d", [(16, 8, 128), (8, 4, 64)])
def test_gpu_decode_and_prefill_kernels_agree_in_the_mode(dtype, hq, hkv, d):
    # A preempted request's tokens are recomputed by the prefill kernel, a prompt's by chunks that start
    # anywhere: in the mode each gives the decode kernel's bits for the same query and context.
    from nanostream.kernels.decode_attention import paged_decode_attention
    from nanostream.kernels.prefill_attention import paged_prefill_attention

    gen = torch.Generator(device="cuda").manual_seed(2)
    lens = torch.tensor([1, 17, 63, 64, 65, 128, 300, 2000], dtype=torch.int32, device="cuda")
    b, page = len(lens), 16
    blocks = -(-int(lens.max()) // page)
    k = torch.randn(b * blocks, page, hkv, d, device="cuda", generator=gen, dtype=dtype)
    v = torch.randn(b * blocks, page, hkv, d, device="cuda", generator=gen, dtype=dtype)
    tables = torch.arange(b * blocks, dtype=torch.int32, device="cuda").view(b, blocks)
    for window in (None, 100):
        # the last 40 queries of each context (fewer where it is shorter), as one chunk
        q_lens = torch.clamp(lens, max=40)
        cu = torch.zeros(b + 1, dtype=torch.int32, device="cuda")
        cu[1:] = torch.cumsum(q_lens, 0)
        q = torch.randn(int(cu[-1]), hq, d, device="cuda", generator=gen, dtype=dtype)
        chunk = paged_prefill_attention(q, k, v, cu, lens, tables, 40, 0.088, window=window, batch_invariant=True)
        for back in (0, 1, 17, 39):  # the query `back` before each context's last: decoded, and in a chunk
            keep = q_lens > back
            rows = (cu[1:] - 1 - back)[keep]
            ctx = (lens - back)[keep]
            dec = paged_decode_attention(q[rows], k, v, tables[keep], ctx, 0.088, 2048, window=window,
                                         batch_invariant=True)  # fmt: skip
            one = torch.arange(len(rows) + 1, dtype=torch.int32, device="cuda")
            pre = paged_prefill_attention(q[rows], k, v, one, ctx, tables[keep], 1, 0.088, window=window,
                                          batch_invariant=True)  # fmt: skip
            assert torch.equal(dec, pre), (window, back, (dec.float() - pre.float()).abs().max())
            assert torch.equal(dec, chunk[rows]), (window, back, (dec.float() - chunk[rows].float()).abs().max())


def gpu_prompts():
    lengths = [1, 2, 7, 31, 64, 100, 257, 511, 700, 1000, 1500, 2000, 5, 50, 500, 1999]
    return prompts(512, lengths, seed=5, shared=300), prompts(
        512, [random.Random(i).randint(1, 1500) for i in range(64)], seed=6
    )


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_gpu_same_tokens_and_logprobs_alone_and_in_any_batch(gpu_model, eager):
    probes, others = gpu_prompts()
    llm = LLM(
        str(gpu_model), dtype="bfloat16", batch_invariant=True, enforce_eager=eager, max_num_batched_tokens=2048,
        num_kvcache_blocks=512, kvcache_block_size=16, max_model_len=4096,
    )  # fmt: skip
    for seeded in (False, True):
        details = []
        counts = differing(llm, probes, others, seeded, details)
        assert counts == {1: 0, 7: 0, 64: 0}, (seeded, details, llm.engine.stats())


@pytest.mark.gpu
def test_gpu_without_the_mode_logprobs_follow_the_batch(gpu_model):
    probes, others = gpu_prompts()
    llm = LLM(
        str(gpu_model), dtype="bfloat16", max_num_batched_tokens=2048, num_kvcache_blocks=512,
        kvcache_block_size=16, max_model_len=4096, attention_backend="triton",
    )  # fmt: skip
    counts = differing(llm, probes, others, seeded=False)
    print(f"without batch_invariant, probes whose ids or logprobs differ from alone: {counts}")
    assert sum(counts.values()) > 0
