"""Queries that see past their own position: an image's tokens attending to each other both ways (Gemma 3's), in
the Triton prefill kernel (under the interpreter on a CPU) and the torch backend, against a float64 reference."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from test_kernels import DEVICE, paged_pool, randn, rel_err
from test_scheduler import make_scheduler, make_seq, update

from nanostream.kernels.prefill_attention import paged_prefill_attention
from nanostream.layers.attention_backend import AttentionMetadata, KVCache, TorchAttention


def limits(q_lens, prefix_lens, spans):
    """[T] int32: each query's last visible key: its image's last token inside ``spans`` (per sequence, [start, end)
    positions), else its own position."""
    out = []
    for q_len, prefix, seq_spans in zip(q_lens, prefix_lens, spans):
        for p in range(prefix, prefix + q_len):
            out.append(next((e - 1 for s, e in seq_spans if s <= p < e), p))
    return torch.tensor(out, dtype=torch.int32, device=DEVICE)


def reference(q, k_cache, v_cache, tables, cu_q, seq_lens, scale, q_last, window):
    """float64 attention: a query at p sees the keys up to q_last[p] (and, with a window, after p - window)."""
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    bs = k_cache.shape[1]
    for i, n in enumerate(seq_lens.tolist()):
        s, e = cu_q[i], cu_q[i + 1]
        rows = tables[i, : -(-n // bs)].long()
        k = k_cache[rows].flatten(0, 1)[:n].double().transpose(0, 1)
        v = v_cache[rows].flatten(0, 1)[:n].double().transpose(0, 1)
        q_pos = torch.arange(n - (e - s), n, device=q.device)
        k_pos = torch.arange(n, device=q.device)[None, :]
        mask = k_pos <= q_last[s:e, None]
        if window is not None:
            mask &= k_pos > q_pos[:, None] - window
        qi = q[s:e].double().transpose(0, 1)
        out[s:e] = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=True).transpose(
            0, 1
        )
    return out


CASES = [  # q_lens, prefix_lens, image spans per sequence, window, tile config
    ([40, 9], [0, 20], [[(3, 19)], [(22, 27)]], None, (16, 16, 4, 1)),  # images across query tiles and key tiles
    ([70], [30], [[(20, 45), (50, 66)]], None, (32, 16, 4, 1)),  # a hit ending inside an image, then a second one
    ([64, 1], [0, 40], [[(0, 64)], []], 16, (16, 16, 4, 1)),  # a whole chunk of image in a sliding window; a decode row
    ([33], [0], [[(10, 11), (11, 30)]], 8, None),  # adjacent images, a window shorter than them
]


@pytest.mark.parametrize("q_lens, prefix_lens, spans, window, config", CASES)
def test_the_prefill_kernel_lets_an_images_tokens_see_the_whole_image(q_lens, prefix_lens, spans, window, config):
    gen = torch.Generator().manual_seed(7)
    seq_lens = [a + b for a, b in zip(q_lens, prefix_lens)]
    k, v, tables = paged_pool(seq_lens, 8, 2, 16, torch.float32, gen)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    q = randn((cu[-1], 4, 16), torch.float32, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    q_last = limits(q_lens, prefix_lens, spans)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, k, v, cu_t, lens, tables, max(q_lens), 0.25, out=out, config=config, window=window,
                            q_last=q_last)  # fmt: skip
    expected = reference(q, k, v, tables, cu, lens, 0.25, q_last, window)
    assert rel_err(out, expected) < 1e-5
    causal = reference(q, k, v, tables, cu, lens, 0.25, limits(q_lens, prefix_lens, [[]] * len(q_lens)), window)
    assert rel_err(out, causal) > 1e-3  # the images' tokens did see ahead
    # The torch backend (the CPU's, and the reference the engine tests compare) agrees.
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64), cu_seqlens_q=cu_t, seq_lens=lens, block_tables=tables,
        max_seqlen_q=max(q_lens), max_seqlen_k=max(seq_lens), cu_seqlens_q_host=cu, seq_lens_host=seq_lens,
        q_last=q_last,
    )  # fmt: skip
    torch_out = TorchAttention().attend(q, KVCache(k, v), meta, 0.25, window=window)
    assert rel_err(torch_out, expected) < 1e-5


# ---- the steps: an image's tokens computed together ----------------------------------------------------------


def image_prompt(spans: list[tuple[int, int]], length: int, whole: bool):
    """A prompt of ``length`` tokens whose images take ``spans`` ([start, end)), as check_images keeps them."""
    from nanostream.engine.images import PromptImages, SeqImage

    images = tuple(SeqImage(s, e - s, (1, 2, 2), b"", bytes([k]) * 16) for k, (s, e) in enumerate(spans))
    return [3] * length, PromptImages(images, None, 0, whole)


def test_the_scheduler_never_ends_a_step_inside_an_image_that_attends_both_ways():
    # Two prompts with 12- and 20-token images and a budget of 16 tokens a step: every step's chunk of a whole-image
    # prompt ends before or after each image (never inside), and every image fits one step; causal images are cut.
    for whole in (True, False):
        sched = make_scheduler(max_num_batched_tokens=16)
        chunks_seen = []
        for rid, spans in (("a", [(5, 17)]), ("b", [(2, 3), (8, 24)])):
            prompt, images = image_prompt(spans, 30, whole)
            seq = make_seq(rid, prompt, max_tokens=2)
            seq.images = images
            sched.add(seq)
        while sched.requests:
            chunks = sched.schedule()
            chunks_seen += [(c.seq.request_id, c.start, c.start + c.num_new_tokens) for c in chunks]
            update(sched, chunks, {c.seq.request_id: 9 for c in chunks if c.samples})
        spans = {"a": [(5, 17)], "b": [(2, 3), (8, 24)]}
        cut = [(rid, s, e) for rid, s, e in chunks_seen for a, b in spans[rid] if a < e < b]
        assert bool(cut) != whole, (whole, chunks_seen)


def test_query_limits_give_each_image_row_its_images_last_position():
    from types import SimpleNamespace

    from nanostream.engine.runner.image_rows import with_query_limits
    from nanostream.engine.runner.step_inputs import StepInputs

    meta = AttentionMetadata(torch.zeros(0), torch.zeros(0), torch.zeros(0), torch.zeros(0), 0, 0, [], [])
    inputs = StepInputs(torch.zeros(9, dtype=torch.int64), torch.zeros(9), meta, [])
    chunks = [SimpleNamespace(start=40, num_new_tokens=1), SimpleNamespace(start=10, num_new_tokens=8)]
    # the second chunk: the rest of an image (rows 0-1, positions 10-11), text, then an image at rows 4-6
    out = with_query_limits(chunks, [[], [0, 1, 4, 5, 6]], inputs, None, "all")
    assert out.meta.q_last.tolist() == [40, 11, 11, 12, 13, 16, 16, 16, 17]
    assert out.meta.limits(None) is out.meta.limits(8) is out.meta.q_last
    assert with_query_limits(chunks, [[], []], inputs, None, "all") is inputs  # no image rows: causal
    # Gemma 4's: only the windowed layers see images whole, the full ones attend causally
    meta = dataclasses.replace(meta, kv_groups=(dataclasses.replace(meta),))
    out = with_query_limits(chunks, [[], [0, 1]], inputs._replace(meta=meta), None, "sliding")
    for m in (out.meta, out.meta.kv_groups[0]):
        assert m.limits(None) is None and m.limits(8).tolist()[1:3] == [11, 11]
