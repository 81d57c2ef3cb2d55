"""The KV pool by layer kind (engine/runner/cache_pool.py): attention layers of two KV shapes get a tensor each under
the same block ids and a block costs the sum of their bytes; a layer with a ``SharedKV`` spec reads its source
layer's pages and costs nothing, and attending to them (``attend``, no store) gives what its source's ``forward``
gave for the same queries."""

from __future__ import annotations

import pytest
import torch

from nanostream.engine.runner.cache_pool import CacheLayout, allocate_caches
from nanostream.layers.attention_backend import AttentionMetadata, TorchAttention
from nanostream.layers.cache_spec import PagedKV, RecurrentState, SharedKV, StateTensor

CPU = torch.device("cpu")


def caches_of(specs, num_blocks=6, block_size=4):
    layout = CacheLayout(specs)
    caches = allocate_caches(layout, num_blocks=num_blocks, block_size=block_size, kv_dtype=torch.float32,
                             num_slots=2, model_dtype=torch.float32, device=CPU)  # fmt: skip
    return layout, caches


def test_two_kv_shapes_page_under_the_same_block_ids_and_a_shared_layer_costs_nothing():
    # Gemma 4's pattern: sliding layers of (2, 16), a full layer of (1, 32), and two layers reading earlier ones'
    specs = [PagedKV(2, 16), PagedKV(1, 32), PagedKV(2, 16), SharedKV(2), SharedKV(1)]
    layout, caches = caches_of(specs)
    assert layout.kv_block_bytes(4, torch.float32) == (2 * 2 * 2 * 16 + 2 * 1 * 32) * 4 * 4
    assert [tuple(c.k.shape) for c in caches[:3]] == [(6, 4, 2, 16), (6, 4, 1, 32), (6, 4, 2, 16)]
    assert caches[3] is caches[2] and caches[4] is caches[1]
    caches[1].k[5].fill_(1.0)  # block 5 of the full layer: no other layer's block 5 changes
    assert caches[0].k.abs().sum() == 0 and caches[2].k.abs().sum() == 0
    assert "3 attention layers, 2 layers reading another's KV" in layout.describe(6, 4, 0, 0, 0)


@pytest.mark.parametrize("specs", [[SharedKV(1), PagedKV(2, 16)], [RecurrentState((StateTensor((4,)),)), SharedKV(0)]])
def test_a_layer_sharing_what_is_not_an_earlier_attention_layers_kv_is_refused(specs):
    with pytest.raises(ValueError, match="shares layer"):
        CacheLayout(specs)


def test_attending_to_a_source_layers_pages_gives_its_output_for_the_same_queries():
    gen = torch.Generator().manual_seed(0)
    _, caches = caches_of([PagedKV(2, 16), SharedKV(0)])
    lengths, prefix = [5, 3], [0, 6]  # the second sequence continues from 6 cached tokens
    seq_lens = [n + p for n, p in zip(lengths, prefix)]
    tables = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    slots = torch.cat([tables[i].repeat_interleave(4)[p : p + n] * 4 + torch.arange(p, p + n) % 4
                       for i, (n, p) in enumerate(zip(lengths, prefix))]).long()  # fmt: skip
    # the cached prefix's K/V, then this step's
    for block in (3, 4):
        caches[0].k[block] = torch.randn(4, 2, 16, generator=gen)
        caches[0].v[block] = torch.randn(4, 2, 16, generator=gen)
    cu = [0, 5, 8]
    meta = AttentionMetadata(
        slot_mapping=slots, cu_seqlens_q=torch.tensor(cu, dtype=torch.int32), seq_lens=torch.tensor(seq_lens),
        block_tables=tables, max_seqlen_q=5, max_seqlen_k=max(seq_lens), cu_seqlens_q_host=cu, seq_lens_host=seq_lens,
    )  # fmt: skip
    q, k, v = (torch.randn(8, n, 16, generator=gen) for n in (4, 2, 2))
    backend = TorchAttention()
    source = backend.forward(q, k, v, caches[0], meta, 0.25, window=4)
    shared = backend.attend(q, caches[1], meta, 0.25, window=4)
    torch.testing.assert_close(shared, source, rtol=0, atol=0)
