"""A model whose every attention layer has a sliding window gives back the KV blocks behind the window as its
sequences advance: a sequence holds about window + chunk tokens of blocks, however long it grows, and a pool far
smaller than one prompt serves it, token-exact against transformers."""

from __future__ import annotations

import pytest
from test_hf_parity import assert_matches_hf, greedy, random_prompts

from nanostream import LLM
from nanostream.engine.block_manager import BlockManager
from nanostream.engine.sequence import Sequence
from nanostream.sampling_params import SamplingParams
from nanostream.testing import make_tiny_model

WINDOW, BLOCK = 16, 8


def make_seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, tokens, SamplingParams(), max_tokens=8, sampling_seed=0, stop_token_ids=frozenset())


def advance(manager: BlockManager, seq: Sequence, n: int, hits=()) -> None:
    """One chunk of n tokens through allocate, the step and resolve's bookkeeping."""
    assert manager.allocate(seq, n, list(hits))
    seq.num_computed_tokens += n
    manager.cache_full_blocks(seq)
    manager.release_behind_window(seq)


def held(manager: BlockManager) -> int:
    return manager.num_blocks - manager.num_free_blocks


def test_a_sequence_holds_the_blocks_of_its_window_and_chunk_and_gives_the_rest_back():
    manager = BlockManager(12, BLOCK, window=WINDOW)
    seq = make_seq(list(range(200)))
    for _ in range(200 // 25):
        advance(manager, seq, 25)
        # the next query at num_computed sees keys from num_computed - WINDOW + 1: those blocks, and the tail's
        first_needed = (seq.num_computed_tokens - WINDOW + 1) // BLOCK
        assert seq.released_blocks == first_needed
        assert held(manager) == len(seq.block_table) - first_needed <= -(-(WINDOW + 25) // BLOCK) + 1
    manager.free(seq)
    assert held(manager) == 0  # nothing freed twice (free() asserts it), nothing kept
    assert all(b.ref_count == 0 for b in manager.blocks)


def test_blocks_given_back_stay_cached_until_handed_out_again():
    manager = BlockManager(40, BLOCK, window=WINDOW)
    prompt = list(range(100))
    first = make_seq(prompt)
    advance(manager, first, 100)
    assert first.released_blocks == (100 - WINDOW + 1) // BLOCK
    second = make_seq(prompt, "s")
    hits = manager.match_prefix(second)
    assert len(hits) == 99 // BLOCK  # every full block before the last token, the given-back ones included
    advance(manager, second, 100 - len(hits) * BLOCK, hits)
    assert second.released_blocks == first.released_blocks
    manager.free(first)
    manager.free(second)
    assert held(manager) == 0


def test_without_a_window_every_block_is_kept():
    manager = BlockManager(40, BLOCK)
    seq = make_seq(list(range(100)))
    advance(manager, seq, 100)
    assert seq.released_blocks == 0 and held(manager) == -(-100 // BLOCK)


@pytest.fixture(scope="module")
def windowed_dir(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("mistral_window"), architecture="MistralForCausalLM", seed=31, sliding_window=WINDOW
    )


def test_a_pool_smaller_than_one_prompt_serves_a_windowed_model_token_exact(windowed_dir, hf_model_cache):
    # 10 blocks of 8 hold 80 tokens; the prompts are 130 to 300 tokens long and decode 30 more
    prompts = random_prompts([300, 130, 217], seed=60)
    options = dict(device="cpu", dtype="float32", kvcache_block_size=BLOCK, num_kvcache_blocks=10,
                   max_num_batched_tokens=24, max_num_seqs=2)  # fmt: skip
    with LLM(str(windowed_dir), **options) as llm:
        assert llm.engine.block_manager.window == WINDOW
        outputs = llm.generate(prompts, greedy(30), use_tqdm=False)
        again = llm.generate(prompts[:1], greedy(30), use_tqdm=False)  # its early blocks given back, maybe reused
    assert_matches_hf(hf_model_cache(windowed_dir), prompts, outputs, 30)
    assert again[0].token_ids == outputs[0].token_ids
