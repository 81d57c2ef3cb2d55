"""The start-up steps that compile kernel variants before serving (engine/runner/kv_pool.py): they fit the pool,
cover every short chunk length's tile, and run through the Triton kernels (the interpreter on a CPU)."""

import pytest

from nanostream import LLM
from nanostream.engine.runner.kv_pool import short_chunk_steps
from nanostream.kernels.late_compiles import warn_on_late_compiles


def test_short_chunk_steps_cover_each_tile_height_within_the_pool(qwen3_dir):
    llm = LLM(str(qwen3_dir), device="cpu", dtype="float32", attention_backend="triton", kvcache_block_size=8,
              num_kvcache_blocks=40, max_num_batched_tokens=128, max_num_seqs=4)  # fmt: skip
    runner, config = llm.engine.runner, llm.engine.config
    steps = short_chunk_steps(config, runner.num_kv_blocks)
    # Each step: a decode row, then a prompt chunk of 1, 2, 4 ... 64 tokens (any tile of up to 128 rows).
    assert [[c.num_new_tokens for c in step] for step in steps] == [[1, n] for n in (1, 2, 4, 8, 16, 32, 64)]
    # ... and the decode row reads a context the decode kernel splits (over 64 tokens): its merge compiles too
    assert all(step[0].seq.num_computed_tokens > 64 for step in steps)
    for step in steps:
        blocks = [b for c in step for b in c.seq.block_table]
        assert len(blocks) == len(set(blocks)) and max(blocks) < runner.num_kv_blocks
        sampled = runner.collect(runner.launch_local(step))
        assert set(sampled) == {c.seq.request_id for c in step}


@pytest.mark.parametrize(
    "num_blocks, max_batched, max_seqs, lengths",
    [(4, 128, 4, [1, 2, 4, 8]), (40, 20, 4, [1, 2, 4, 8, 16]), (40, 128, 1, [1, 2, 4, 8, 16, 32, 64])],
    ids=["small pool", "short steps", "one sequence"],
)
def test_short_chunk_steps_stop_at_what_the_engine_can_run(qwen3_dir, num_blocks, max_batched, max_seqs, lengths):
    llm = LLM(str(qwen3_dir), device="cpu", kvcache_block_size=8, num_kvcache_blocks=num_blocks,
              max_num_batched_tokens=max_batched, max_num_seqs=max_seqs)  # fmt: skip
    steps = short_chunk_steps(llm.engine.config, num_blocks)
    assert [step[-1].num_new_tokens for step in steps] == lengths
    assert all(len(step) == min(2, max_seqs) for step in steps)


def test_a_kernel_variant_built_after_start_up_is_logged_by_name_and_key(caplog):
    # Triton calls its post-compile hook for each variant it builds; on a GPU one built after start-up
    # stalled every stream, and the engine process's log says which (called here as Triton would).
    knobs = pytest.importorskip("triton").knobs
    before = knobs.runtime.jit_post_compile_hook
    seen = []
    knobs.runtime.jit_post_compile_hook = lambda *, fn, key, **_: seen.append(key)  # someone else's
    try:
        warn_on_late_compiles()
        warn_on_late_compiles()  # installed once, not wrapped twice
        hook = knobs.runtime.jit_post_compile_hook

        def decode_kernel():
            pass

        with caplog.at_level("WARNING", logger="nanostream.kernels.late_compiles"):
            hook(fn=decode_kernel, key="splits-1", repr="", already_compiled=False)
    finally:
        knobs.runtime.jit_post_compile_hook = before
    assert [r.getMessage() for r in caplog.records] == [
        "Triton kernel decode_kernel got a variant after start-up, a stall of every stream (key splits-1)"
    ]
    assert seen == ["splits-1"], "the hook that was there before still runs"
