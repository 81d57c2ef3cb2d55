"""KV groups (issue 57): where a model's layers give KV blocks back by different rules (Llama 4's chunked layers beside
its global ones, OLMo 3's sliding layers beside full ones), each group has its own block table: the windowed and
chunked groups hold about their reach and a step's tokens of blocks however long a sequence grows, the full group
holds all, and a pool smaller than full attention in every layer would need for one prompt serves them, token-exact
against transformers through chunked prefill, prefix hits and preemption (and at two ranks)."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import outputs_at_one_and_two_ranks
from test_hf_parity import assert_matches_hf, greedy, random_prompts
from test_window_blocks import advance, held, make_seq

from nanostream import LLM
from nanostream.engine.block_manager import BlockManager
from nanostream.engine.runner.cache_pool import CacheLayout, allocate_caches
from nanostream.layers.cache_spec import PagedKV, SharedKV
from nanostream.testing import TINY_PRESETS, make_tiny_model

BLOCK, REACH = 8, 16
GROUPS = (None, REACH, REACH)  # a full group and two windowed ones (OLMo 3's or Gemma 3's layers, one a group)


def test_a_windowed_group_gives_back_the_blocks_behind_its_reach_while_the_full_group_keeps_its_own():
    manager = BlockManager(64, BLOCK, groups=GROUPS)
    seq = make_seq(list(range(200)))
    for _ in range(200 // 25):
        advance(manager, seq, 25)
        needed = manager.blocks_needed(seq.num_computed_tokens)
        behind = (seq.num_computed_tokens - REACH + 1) // BLOCK  # before every window of the next queries
        assert [len(t) for t in seq.block_tables] == [needed] * 3 and seq.released == [0, behind, behind]
        assert held(manager) == needed + 2 * (needed - behind)
    assert held(manager) < 3 * manager.blocks_needed(200) // 2  # (full attention in every group: all of them)
    manager.free(seq)
    assert held(manager) == 0 and all(b.ref_count == 0 for b in manager.blocks)  # none freed twice, none kept
    assert manager.most_blocks_held(200) == 25 + 2 * min(25, (REACH - 1 + 2) // BLOCK + 2)


def test_a_prefix_hit_shares_each_groups_blocks_and_takes_none_behind_a_windowed_groups_reach():
    manager = BlockManager(80, BLOCK, groups=GROUPS)
    prompt = list(range(100))
    first = make_seq(prompt)
    advance(manager, first, 100)
    second = make_seq(prompt, "s")
    hits = manager.match_prefix(second)
    assert len(hits) == 99 // BLOCK and all(len(h) == 3 for h in hits)
    behind = (len(hits) * BLOCK - REACH + 1) // BLOCK
    assert [h[0] for h in hits] == first.block_tables[0][: len(hits)]  # the full group's: every block
    assert all(h[1] is None and h[2] is None for h in hits[:behind])  # no query from the hit's end reads these
    assert [h[1] for h in hits[behind:]] == first.block_tables[1][behind : len(hits)]
    free = manager.num_free_blocks
    advance(manager, second, 100 - len(hits) * BLOCK, hits)
    assert second.released == [0, behind, behind] == first.released[:1] + [behind] * 2
    assert second.block_tables[0][: len(hits)] == first.block_tables[0][: len(hits)]
    assert manager.num_free_blocks == free - 3  # the last block of each group; the hits shared, not copied
    manager.free(first)
    manager.free(second)
    assert held(manager) == 0


def test_a_prefix_hit_stops_where_a_windowed_group_lost_a_block_its_queries_read():
    manager = BlockManager(80, BLOCK, groups=GROUPS)
    prompt = list(range(100))
    first = make_seq(prompt)
    advance(manager, first, 100)
    tables = first.block_tables
    manager.free(first)  # cached, every group's
    # group 2's block 11 handed out again: a hit of 12 blocks needs its blocks 10 and 11, one of 11 its 9 and 10
    lost = manager.blocks[tables[2][11]]
    del manager.cached[2][lost.block_hash]
    lost.block_hash = None
    hits = manager.match_prefix(make_seq(prompt, "s"))
    assert len(hits) == 11 and hits[-1][2] == tables[2][10]
    # the full group's first block lost: no hit at all, whatever the windowed groups still hold
    del manager.cached[0][manager.blocks[tables[0][0]].block_hash]
    assert manager.match_prefix(make_seq(prompt, "t")) == []


def test_a_step_packs_each_groups_own_slots_and_tables():
    from nanostream.engine.runner.kv_pool import WarmupChunk
    from nanostream.engine.runner.step_inputs import pack_step

    manager = BlockManager(64, BLOCK, groups=GROUPS)
    seq = make_seq(list(range(60)))
    advance(manager, seq, 40)
    assert manager.allocate(seq, 20) and seq.released == [0, 3, 3]
    inputs = pack_step([WarmupChunk(seq, 40, 20)], BLOCK, torch.device("cpu"), num_groups=3)
    for g in range(3):
        meta, table = inputs.meta.group(g), seq.block_tables[g]
        assert meta.block_tables[0].tolist() == table
        assert meta.slot_mapping.tolist() == [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(40, 60)]


def test_scouts_layers_are_four_groups_of_twelve_whose_layer_j_shares_slot_j():
    # every fourth layer global, the rest chunked (8192): groups of the fewest of one reach, full attention first
    specs = [PagedKV(2, 16, None if (i + 1) % 4 == 0 else 8192) for i in range(48)]
    layout = CacheLayout(specs)
    assert layout.group_reaches == (None, 8192, 8192, 8192) and layout.slots == 12
    assert layout.groups[0] == list(range(3, 48, 4)) and layout.groups[1] == [0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14]
    assert layout.kv_block_bytes(4, torch.float32) == 2 * 12 * 2 * 16 * 4 * 4  # one group's layers a block
    caches = allocate_caches(layout, num_blocks=3, block_size=4, kv_dtype=torch.float32, num_slots=0,
                             model_dtype=torch.float32, device=torch.device("cpu"))  # fmt: skip
    assert [caches[i].group for i in (3, 0, 14, 16, 47)] == [0, 1, 1, 2, 0]
    assert caches[3].k.data_ptr() == caches[0].k.data_ptr()  # slot 0: block b is group 0's or group 1's, not both
    assert "48 attention layers in 4 groups of 12" in layout.describe(3, 4, 0, 0, 0)


def test_gemma3_27bs_layers_are_a_full_group_and_six_sliding_ones_and_other_layouts_one_group():
    specs = [PagedKV(2, 16, None if (i + 1) % 6 == 0 else 1024) for i in range(62)]  # 10 full, 52 sliding
    layout = CacheLayout(specs)
    assert layout.group_reaches == (None,) + (1024,) * 6 and [len(g) for g in layout.groups] == [10] * 6 + [2]
    # two KV shapes, or a layer reading another's KV: one group, which keeps every block while a layer is full
    assert CacheLayout([PagedKV(2, 16, 24), PagedKV(1, 32), PagedKV(2, 16, 24)]).group_reaches == (None,)
    assert CacheLayout([PagedKV(2, 16, 24), PagedKV(2, 16, 32), SharedKV(0)]).group_reaches == (None,)
    assert CacheLayout([PagedKV(2, 16, 24), PagedKV(2, 16, 32)]).group_reaches == (24, 32)
    assert CacheLayout([PagedKV(2, 16, 24), PagedKV(2, 16, 24)]).group_reaches == (24,)


def _engine(path, blocks: int, **options) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", kvcache_block_size=BLOCK, num_kvcache_blocks=blocks,
               max_num_batched_tokens=24, max_num_seqs=2, **options)  # fmt: skip


def _assert_serves_a_pool_smaller_than_one_prompt(path, hf, blocks: int, num_layers: int, seed: int) -> None:
    # A 300-token prompt alone, then two that extend it (a hit of its 37 full blocks: the windowed groups' last ones,
    # given back last, are still cached) and two more of 130 and 217, each decoding 30 tokens, in chunks of 24; full
    # attention in every layer would need num_layers x 42 blocks of one layer for the first alone
    prompts = random_prompts([300, 130, 217], seed=seed)
    prompts[1:1] = [prompts[0] + tail for tail in random_prompts([5, 41], seed=seed + 1)]
    assert blocks < num_layers * -(-330 // BLOCK)
    with _engine(path, blocks) as llm:
        assert len(llm.engine.runner.layout.groups) == num_layers  # a layer a group
        outputs = llm.generate(prompts[:1], greedy(30), use_tqdm=False)
        outputs += llm.generate(prompts[1:], greedy(30), use_tqdm=False)
        stats = llm.engine.stats()
        assert llm.engine.block_manager.num_free_blocks == blocks
    assert stats.preemptions > 0 and outputs[1].num_cached_tokens == 296
    assert_matches_hf(hf, prompts, outputs, 30)


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    # three chunked layers (chunks of 32) and a global NoPE one, as the preset's Llama4TextConfig lays them out
    path = make_tiny_model(tmp_path_factory.mktemp("llama4_groups"), **TINY_PRESETS["llama4"])
    return path, transformers.Llama4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_llama4s_chunked_layers_give_back_their_blocks_beside_its_global_layer_token_exact(llama4):
    _assert_serves_a_pool_smaller_than_one_prompt(*llama4, blocks=80, num_layers=4, seed=70)


def test_olmo3s_sliding_layers_give_back_their_blocks_beside_its_full_layer_token_exact(tmp_path):
    path = make_tiny_model(tmp_path, **TINY_PRESETS["olmo3"])  # sliding (24), full, sliding
    hf = transformers.Olmo3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    _assert_serves_a_pool_smaller_than_one_prompt(path, hf, blocks=68, num_layers=3, seed=72)


def test_the_triton_kernels_read_each_groups_tables(llama4):
    # Under Triton's interpreter without a GPU: the chunked layers' tables have stale ids behind their chunks
    path, hf = llama4
    prompts = random_prompts([150], seed=74)
    prompts.append(prompts[0][:120] + random_prompts([7], seed=75)[0])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with LLM(str(path), device=device, dtype="float32", attention_backend="triton", kvcache_block_size=BLOCK,
             num_kvcache_blocks=60, max_num_batched_tokens=24, max_num_seqs=2) as llm:  # fmt: skip
        outputs = llm.generate(prompts[:1], greedy(6), use_tqdm=False)
        outputs += llm.generate(prompts[1:], greedy(6), use_tqdm=False)
    assert outputs[1].num_cached_tokens == 120
    assert_matches_hf(hf, prompts, outputs, 6)


@pytest.mark.slow
def test_two_llama4_ranks_generate_what_one_does_with_a_table_per_group(llama4):
    path, _ = llama4
    shared = random_prompts([100], seed=76)[0]
    prompts = [shared + tail for tail in random_prompts([3, 30, 9, 17], seed=77)]
    options = dict(device="cpu", dtype="float32", kvcache_block_size=BLOCK, max_num_batched_tokens=24, max_num_seqs=4,
                   num_kvcache_blocks=56)  # fmt: skip
    one, two = outputs_at_one_and_two_ranks(path, prompts, greedy(20), **options)
    assert [o.token_ids for o in one] == [o.token_ids for o in two]
