"""The "steps" and "prefill" sections: steps of a random-weight Qwen3-0.6B through ``ModelRunner.execute``."""

from __future__ import annotations

import statistics
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kernel_bench.attention_cases import causal_pairs
from kernel_bench.harness import Unavailable, check_alive_after, need_cuda, short

if TYPE_CHECKING:
    from kernel_bench.run import Run

STEP_CONTEXT = 1024
STEP_LLM_KWARGS = dict(max_num_seqs=256, max_model_len=4096)


def make_llm(path: Path, backend: str, eager: bool):
    from nanostream import LLM

    t = time.perf_counter()
    try:
        llm = LLM(str(path), enforce_eager=eager, attention_backend=backend, **STEP_LLM_KWARGS)
    except Exception as exc:
        check_alive_after(exc)
        raise Unavailable(f"LLM(attention_backend={backend!r}, enforce_eager={eager}) failed: {short(exc)}") from exc
    runner = llm.engine.runner
    print(
        f"   LLM({backend}, enforce_eager={eager}): backend {runner.backend.name}, {runner.num_kv_blocks} KV "
        f"blocks of {runner.block_size}, CUDA graphs {uses_graphs(runner)}, built in {time.perf_counter() - t:.1f} s"
    )
    return llm


def uses_graphs(runner) -> bool:
    return getattr(runner, "graphs", None) is not None


def make_chunks(runner, batch: int, ctx: int, new: int, seed: int) -> list:
    """``batch`` sequences of ``ctx`` random tokens whose first ``ctx - new`` are already computed.

    Blocks are disjoint and drawn at random from the runner's pool (the engine's block manager is
    not involved: nothing else runs).
    """
    from nanostream.engine.scheduler import ScheduledChunk
    from nanostream.engine.sequence import Sequence
    from nanostream.sampling_params import SamplingParams

    per = -(-ctx // runner.block_size)
    if batch * per > runner.num_kv_blocks:
        raise RuntimeError(
            f"{batch} sequences of {ctx} tokens need {batch * per} KV blocks; the pool has {runner.num_kv_blocks}"
        )
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(runner.num_kv_blocks, generator=gen)[: batch * per].tolist()
    ids = torch.randint(runner.vocab_size, (batch, ctx), generator=gen).tolist()
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=1)
    chunks = []
    for i in range(batch):
        seq = Sequence(f"bench-{i}", ids[i], params, max_tokens=1, sampling_seed=i, stop_token_ids=frozenset())
        seq.num_computed_tokens = ctx - new
        seq.block_table = blocks[i * per : (i + 1) * per]
        chunks.append(ScheduledChunk(seq, new))  # start = ctx - new; samples: the chunk reaches the end
    return chunks


def time_execute(runner, chunks: list, steps: int, warmup: int) -> list[float]:
    """Seconds of each of ``steps`` calls of ``runner.execute(chunks)``, synchronized around each."""
    for _ in range(warmup):
        runner.execute(chunks)
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        runner.execute(chunks)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times


def randomize_kv(runner) -> None:
    """Random K/V over the whole pool: attention should not read the zeros the pool starts with."""
    try:
        for cache in runner.kv_caches:
            cache.k.normal_()
            cache.v.normal_()
    except Exception as exc:
        print(f"   KV pool left as allocated (cannot fill it: {short(exc)})")


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # tied embeddings counted once


def bench_steps(run: Run, path: Path, backend: str, eager: bool, batches: tuple[int, ...]) -> None:
    ceil = run.ceilings()
    llm = make_llm(path, backend, eager)
    try:
        runner = llm.engine.runner
        randomize_kv(runner)
        kv_token_bytes = runner.kv_block_bytes / runner.block_size  # K and V of every layer, in the pool's dtype
        steps = min(run.args.steps, 10) if run.args.quick else run.args.steps
        for batch in batches:
            row: dict[str, Any] = {"backend": backend, "mode": "eager" if eager else "graph", "batch": batch}
            row["cuda_graphs"] = uses_graphs(runner)
            run.report["steps"].append(row)
            try:
                chunks = make_chunks(runner, batch, STEP_CONTEXT, 1, run.args.seed + batch)
                times = time_execute(runner, chunks, steps, warmup=5)
            except Exception as exc:
                row["error"] = short(exc)
                traceback.print_exc()
                check_alive_after(exc)
                continue
            row["ms"] = statistics.median(times) * 1e3
            row["min_ms"] = min(times) * 1e3
            row["tok_s"] = batch / (row["ms"] * 1e-3)
            row["bytes"] = weight_bytes(runner.model) + batch * STEP_CONTEXT * kv_token_bytes
            row["floor_ms"] = row["bytes"] / (ceil["copy_tbs"] * 1e12) * 1e3 if ceil else None
            print(f"   B={batch}: {row['ms']:.3f} ms/step (min {row['min_ms']:.3f}), {row['tok_s']:.0f} tok/s")
    finally:
        del llm


def section_steps(run: Run) -> None:
    need_cuda()
    path = run.model_path()
    batches = (1, 64) if run.args.quick else (1, 8, 64, 256)
    for backend in run.args.backends:
        for eager in (True, False):
            uid = f"steps/{backend}/{'eager' if eager else 'graph'}"
            run.unit(uid, lambda b=backend, e=eager: bench_steps(run, path, b, e, batches))


def prefill_flops(runner, seq_lens: list[int], q_lens: list[int]) -> int:
    """Matmul FLOPs of one prefill step: linears over every token, the LM head over the last ones, attention."""
    spec = runner.spec
    linear = sum(p.numel() for p in runner.model.parameters() if p.dim() == 2 and p.shape[0] != spec.vocab_size)
    head = 2 * spec.vocab_size * spec.hidden_size * len(seq_lens)
    pairs = sum(causal_pairs(q, n) for q, n in zip(q_lens, seq_lens))
    return 2 * linear * sum(q_lens) + head + spec.num_layers * 4 * spec.head_dim * spec.num_heads * pairs


def bench_prefill(run: Run, path: Path, backend: str) -> None:
    ceil = run.ceilings()
    num_seqs, length = 8, 1024
    llm = make_llm(path, backend, eager=True)  # prefill steps run eagerly either way
    row: dict[str, Any] = {"backend": backend, "seqs": num_seqs, "len": length, "tokens": num_seqs * length}
    run.report["prefill"].append(row)
    try:
        runner = llm.engine.runner
        chunks = make_chunks(runner, num_seqs, length, length, run.args.seed)
        times = time_execute(runner, chunks, 3 if run.args.quick else 7, warmup=2)
        row["ms"] = statistics.median(times) * 1e3
        row["tok_s"] = row["tokens"] / (row["ms"] * 1e-3)
        row["flops"] = prefill_flops(runner, [length] * num_seqs, [length] * num_seqs)
        row["floor_ms"] = row["flops"] / (ceil["matmul_tflops"] * 1e12) * 1e3 if ceil else None
        print(f"   {backend}: {row['ms']:.2f} ms per {row['tokens']}-token step, {row['tok_s']:.0f} tok/s")
    finally:
        del llm


def section_prefill(run: Run) -> None:
    need_cuda()
    path = run.model_path()
    for backend in run.args.backends:
        run.unit(f"prefill/{backend}", lambda b=backend: bench_prefill(run, path, b))
