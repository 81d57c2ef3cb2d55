"""The paged MLA decode kernel (nanostream/kernels/mla_decode.py) against its torch reference
(layers/latent_ops.py's ``latent_decode_reference``), on fresh random entries and block tables: one token of context,
partial last blocks, a context split over many programs, more heads than a program takes, many sequences, an FP8
cache; and the store kernel against the reference store (padding slots skipped, FP8 quantized alike).

Without a GPU they run under Triton's interpreter (tests/conftest.py); ``gpu``-marked ones at real shapes on a GPU.
"""

import pytest
import torch
from test_fp8_kv import check_stored

from nanostream.kernels.fp8_kv import FP8_KV_DTYPE
from nanostream.kernels.mla_decode import paged_mla_decode, store_latent_entries
from nanostream.layers.cache_spec import LatentCache
from nanostream.layers.latent_ops import latent_decode_reference, store_latent

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def random_case(seq_lens, num_heads, c, r, page, dtype, seed, fp8=False):
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // page) for n in seq_lens]
    num_blocks = sum(blocks) + 3
    latent = torch.randn(num_blocks, page, c + r, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen)  # each sequence's blocks scattered over the pool
    width = max(blocks)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    at = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[at : at + n].to(torch.int32)
        at += n
    q = torch.randn(len(seq_lens), num_heads, c + r, generator=gen) * 0.3
    k_scale = None
    if fp8:
        k_scale = torch.tensor([0.02], dtype=torch.float32)
        latent = (latent / k_scale).clamp(-448, 448).to(FP8_KV_DTYPE)
    else:
        latent = latent.to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    to = lambda t: None if t is None else t.to(DEVICE)
    return to(q.to(dtype)), to(latent), to(tables), to(lens), to(k_scale)


CASES = {  # seq_lens, heads, C, R, block size, splits (None: the launcher's)
    "one_token": ([1], 4, 32, 16, 16, None),
    "partial_blocks": ([5, 17, 33, 16], 4, 32, 16, 16, None),
    "split": ([300, 9], 4, 32, 16, 16, 5),
    "many_splits_short_tail": ([130, 1, 64], 20, 48, 16, 8, 11),
    "many_sequences": ([int(x) for x in torch.randint(1, 90, (24,), generator=torch.Generator().manual_seed(3))],
                       8, 32, 16, 16, None),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_the_kernel_matches_the_reference(case):
    seq_lens, heads, c, r, page, splits = CASES[case]
    q, latent, tables, lens, _ = random_case(seq_lens, heads, c, r, page, torch.float32, seed=len(case))
    scale = (c + r) ** -0.5
    expected = latent_decode_reference(q, latent, tables, lens, scale, max(seq_lens), c)
    got = paged_mla_decode(q, latent, tables, lens, scale, max(seq_lens), c, num_splits=splits)
    assert got.shape == (len(seq_lens), heads, c)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_launchers_split_count_covers_the_context():
    # at 2 sequences of ~1k tokens and 4 heads the launcher splits; the result does not depend on it
    q, latent, tables, lens, _ = random_case([1000, 700], 4, 32, 16, 16, torch.float32, seed=5)
    expected = latent_decode_reference(q, latent, tables, lens, 0.1, 1000, 32)
    for splits in (None, 1, 64):
        torch.testing.assert_close(paged_mla_decode(q, latent, tables, lens, 0.1, 1000, 32, num_splits=splits),
                                   expected, rtol=1e-5, atol=1e-5)  # fmt: skip


@pytest.mark.parametrize(("block_h", "block_n"), [(32, 16), (64, 64)])
def test_other_tiles_give_the_same_attention(block_h, block_n):
    # 40 heads: a head block past the last head, masked; the tiles apps/mla_sweep.py times
    q, latent, tables, lens, _ = random_case([70, 3, 129], 40, 32, 16, 16, torch.float32, seed=6)
    expected = latent_decode_reference(q, latent, tables, lens, 0.1, 129, 32)
    got = paged_mla_decode(q, latent, tables, lens, 0.1, 129, 32, num_splits=3, block_h=block_h, block_n=block_n)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_an_fp8_cache_is_read_as_stored_times_its_scale():
    q, latent, tables, lens, k_scale = random_case([40, 3], 4, 32, 16, 16, torch.float32, seed=6, fp8=True)
    expected = latent_decode_reference(q, latent, tables, lens, 0.1, 40, 32, k_scale)
    got = paged_mla_decode(q, latent, tables, lens, 0.1, 40, 32, k_scale, num_splits=2)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fp8", [False, True])
def test_the_store_kernel_writes_what_the_reference_writes_and_skips_padding(fp8):
    gen = torch.Generator().manual_seed(7)
    entries = torch.randn(6, 40, generator=gen).to(DEVICE)
    slots = torch.tensor([5, -1, 17, 0, -1, 31], device=DEVICE)
    dtype = FP8_KV_DTYPE if fp8 else torch.float32
    k_scale = torch.tensor([0.01], device=DEVICE) if fp8 else None
    ours, theirs = (LatentCache(torch.zeros(4, 8, 40, dtype=dtype, device=DEVICE)) for _ in range(2))
    store_latent_entries(ours, entries, slots, k_scale)
    store_latent(theirs, entries, slots, k_scale)
    if fp8:  # (Triton's interpreter casts a few elements otherwise: test_fp8_kv.check_stored says which)
        check_stored(ours.latent.flatten(0, 1)[[0, 5, 17, 31]], theirs.latent.flatten(0, 1)[[0, 5, 17, 31]])
    else:
        assert torch.equal(ours.latent, theirs.latent)
    assert ours.latent.view(torch.uint8).flatten(0, 1).count_nonzero(-1).nonzero().flatten().tolist() == [0, 5, 17, 31]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_seqs", [1, 64])
def test_the_kernel_at_deepseek_v3_shapes_on_the_gpu(dtype, num_seqs):
    # one GPU's 128 heads (16 per rank at tp 8 below), kv_lora_rank 512, qk_rope_head_dim 64, blocks of 16 and 64
    for heads, page in ((128, 16), (16, 64)):
        lens = [int(x) for x in torch.randint(1, 3000, (num_seqs,), generator=torch.Generator().manual_seed(8))]
        q, latent, tables, seq_lens, _ = random_case(lens, heads, 512, 64, page, dtype, seed=9)
        expected = latent_decode_reference(q, latent, tables, seq_lens, 0.1147, max(lens), 512)
        got = paged_mla_decode(q, latent, tables, seq_lens, 0.1147, max(lens), 512)
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
