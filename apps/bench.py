"""Offline throughput: nano-vLLM's bench workload through ``LLM.generate``, optionally against HF ``generate``.

Usage::

    python apps/bench.py                                       # tiny random model, the full workload
    python apps/bench.py --num-requests 32 --max-input-len 256 --min-output-len 32 --max-output-len 128 --hf
    python apps/bench.py --preset qwen3-0.6b                   # Qwen3-0.6B's shape, random weights (GPU)
    python apps/bench.py --preset qwen3-30b-a3b                # Qwen3-30B-A3B's shape, load_format dummy (GPU)
    python apps/bench.py --model /models/Qwen3-0.6B --hf

Workload: nano-vLLM's ``bench.py`` draws (apps/workload.py): 256 requests, seed 0, 142,827 prompt and
133,966 output tokens at the defaults, temperature 0.6 with ignore_eos.

What is timed:

- nanostream: one ``LLM.generate(all prompts as token ids, one SamplingParams each, use_tqdm=False)``
  after a short warm-up generate. This includes scheduling, the model, sampling and the offline
  API's incremental detokenization; it excludes model loading and KV-cache allocation.
- HF (``--hf``): ``model.generate`` over static batches of ``--hf-batch-size`` requests in workload
  order, after a warm-up batch. Prompts are left-padded to the batch's longest with an attention
  mask; every row generates the batch's largest max_tokens (EOS ignored, temperature 0.6, no top-k
  or top-p). The timer covers building the padded batch, ``generate`` and the device sync, for all
  batches. Only the tokens each request asked for are counted: the extra tokens that shorter
  requests generate to fill the batch are paid for in time but not counted.

Output tok/s = counted output tokens / elapsed; total tok/s = (prompt tokens + output tokens) /
elapsed. The HF model runs first and is freed before the engine starts, so on a GPU the engine's
memory profiling sees the whole device.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from presets import engine_defaults
from step_stats import StepStats
from tables import format_table
from workload import (
    PROMPT_VOCAB,
    TEMPERATURE,
    Request,
    add_workload_args,
    check_workload_args,
    engine_options,
    load_workload,
    make_warmup,
    model_dir,
    params_of,
    sync,
)

from nanostream import LLM, SamplingParams
from nanostream.config import EngineConfig
from nanostream.options import add_engine_args


@dataclass(frozen=True)
class Result:
    name: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int  # only the tokens the workload asked for
    elapsed: float  # seconds

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.elapsed

    @property
    def total_tps(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed

    def rates(self) -> tuple[str, str]:
        return f"{self.output_tps:.1f}", f"{self.total_tps:.1f}"

    def line(self) -> str:
        return (
            f"{self.name}: {self.num_requests} requests, {self.output_tokens} output tokens "
            f"(+{self.prompt_tokens} prompt) in {self.elapsed:.2f} s: {self.output_tps:.1f} output tok/s, "
            f"{self.total_tps:.1f} total tok/s"
        )


def run_nanostream(
    model: Path,
    workload: list[Request],
    warmup: list[Request],
    engine_kwargs: dict,
    seed: int,
    instrument: Callable[[LLM], None] | None = None,
    after: Callable[[LLM], None] | None = None,
    step_stats: bool = False,
) -> Result:
    """Warm up, then time one ``generate`` of the workload; ``instrument(llm)`` runs between the two,
    ``after(llm)`` once the timed run is over."""
    llm = LLM(str(model), seed=seed, **engine_kwargs)
    cfg = llm.config
    kv_dtype = str(llm.engine.runner.kv_dtype).removeprefix("torch.")
    print(
        f"nanostream: {cfg.device} {cfg.dtype}, {llm.engine.block_manager.num_blocks} KV blocks of "
        f"{cfg.kvcache_block_size} ({kv_dtype}), max_num_seqs {cfg.max_num_seqs}, max_num_batched_tokens "
        f"{cfg.max_num_batched_tokens}, attention {llm.engine.runner.backend.name}"
    )
    llm.generate([r.prompt_token_ids for r in warmup], [params_of(r) for r in warmup], use_tqdm=False)
    if instrument is not None:
        instrument(llm)
    # What start-up and warm-up made lives for the whole run: keep the collector's full passes off it (one
    # stalled a step for 280 ms on an H200), as `nanostream serve` does. Given back with the engine below.
    gc.collect()
    gc.freeze()
    stats = StepStats(llm) if step_stats else None
    params = [params_of(r) for r in workload]
    prompts = [r.prompt_token_ids for r in workload]
    sync(cfg.device)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    sync(cfg.device)
    elapsed = time.perf_counter() - start
    got = [len(o.token_ids) for o in outputs]
    short = sum(g < r.max_tokens for g, r in zip(got, workload))
    if short:
        print(f"warning: nanostream returned fewer tokens than max_tokens for {short} request(s)")
    # Count what was asked for and delivered, never more.
    counted = sum(min(g, r.max_tokens) for g, r in zip(got, workload))
    if stats is not None:
        stats.close()
        print(f"steps of the timed run ({llm.engine.runner.backend.name}):\n{stats.table()}")
        del llm.engine.step
    if after is not None:
        after(llm)
    name = "nanostream" if "attention_backend" not in engine_kwargs else f"nanostream[{llm.engine.runner.backend.name}]"
    del llm  # free the engine (weights, KV pool, graphs) before the next one starts
    gc.unfreeze()
    gc.collect()
    if cfg.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return Result(name, len(workload), sum(map(len, prompts)), counted, elapsed)


def run_hf(
    model: Path, workload: list[Request], warmup: list[Request], cfg: EngineConfig, batch_size: int, seed: int
) -> Result:
    """Time HF generate; the model is freed on return (the caller collects and empties the CUDA cache)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    dtype = getattr(torch, cfg.dtype)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(cfg.device).eval()
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    hf.generation_config.eos_token_id = None  # ignore_eos: with no EOS, every row runs to max_new_tokens
    print(f"hf: transformers generate, {cfg.device} {cfg.dtype}, {hf.config._attn_implementation} attention, ", end="")
    print(f"static batches of {batch_size}, left-padded")

    def generate(batch: list[Request]) -> None:
        width = max(len(r.prompt_token_ids) for r in batch)
        new = max(r.max_tokens for r in batch)
        ids = [[pad] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids for r in batch]
        mask = [[0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids) for r in batch]
        gen = GenerationConfig(
            do_sample=True, temperature=TEMPERATURE, top_k=0, top_p=1.0, max_new_tokens=new, pad_token_id=pad
        )
        out = hf.generate(
            input_ids=torch.tensor(ids, device=cfg.device),
            attention_mask=torch.tensor(mask, device=cfg.device),
            generation_config=gen,
        )
        if out.shape[1] != width + new:
            raise RuntimeError(f"HF generated {out.shape[1] - width} tokens per row, expected {new}")

    with torch.inference_mode():
        generate(warmup[:batch_size])
        torch.manual_seed(seed)
        sync(cfg.device)
        start = time.perf_counter()
        for i in range(0, len(workload), batch_size):
            generate(workload[i : i + batch_size])
        sync(cfg.device)
        elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(r.prompt_token_ids) for r in workload)
    output_tokens = sum(r.max_tokens for r in workload)
    return Result(f"hf (bs={batch_size})", len(workload), prompt_tokens, output_tokens, elapsed)


def profile_steps(llm: LLM, workload: list[Request], out_dir: str, num_steps: int = 12) -> None:
    """torch.profiler over engine steps, three times: ``num_steps`` steps at full batch (decode steady
    state, after 30 steps), the same at batch 8 (where a step's fixed costs show), then 4 prefill steps
    of fresh prompts (steps 2-5: nothing of them is cached).
    Prints the top ops by device and by host time and writes a gzipped Chrome trace of each into ``out_dir``."""
    import gzip
    import shutil

    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    engine, step = llm.engine, llm.engine.step
    vocab = min(PROMPT_VOCAB, llm.engine.vocab_size)
    fresh = [[(t + 1) % vocab for t in r.prompt_token_ids] for r in workload]
    # repeat=1: one cycle; a second would start over and report only its own, partial, steps.
    decode = schedule(wait=30, warmup=3, active=num_steps, repeat=1)
    runs = [
        ("decode", [r.prompt_token_ids for r in workload], decode, 35 + num_steps),
        ("decode-small", [r.prompt_token_ids for r in workload[:8]], decode, 35 + num_steps),
        ("prefill", fresh, schedule(wait=1, warmup=1, active=4, repeat=1), 2),
    ]
    for name, prompts, sched, max_tokens in runs:
        with profile(activities=activities, schedule=sched) as prof:

            def profiled_step(prof=prof):
                result = step()
                prof.step()
                return result

            engine.step = profiled_step
            try:
                params = SamplingParams(temperature=TEMPERATURE, ignore_eos=True, max_tokens=max_tokens)
                llm.generate(prompts, params, use_tqdm=False)
            finally:
                del engine.step
        device_sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        print(f"profile of {name} steps, {len(prompts)} requests, by device time:")
        print(prof.key_averages().table(sort_by=device_sort, row_limit=25, max_name_column_width=60))
        print(f"{name} steps by host time:")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
        trace = Path(out_dir) / f"trace-{name}-{llm.engine.runner.backend.name}.json"
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
        with trace.open("rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        trace.unlink()


def summary(results: list[Result]) -> str:
    rows = [("engine", "requests", "out tok", "time s", "out tok/s", "total tok/s")]
    rows += [(r.name, str(r.num_requests), str(r.output_tokens), f"{r.elapsed:.2f}", *r.rates()) for r in results]
    lines = format_table(rows)
    baseline = results[-1]
    if len(results) >= 2 and not baseline.name.startswith("nanostream"):
        for r in results[:-1]:
            lines.append(f"{r.name} / {baseline.name} output tok/s: {r.output_tps / baseline.output_tps:.2f}x")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add_workload_args(parser)
    hf_group = parser.add_argument_group("Hugging Face baseline")
    hf_group.add_argument("--hf", action="store_true", help="also time transformers' generate on the same workload")
    hf_group.add_argument("--hf-batch-size", type=int, default=16, help="requests per static HF batch")
    parser.add_argument(
        "--backends",
        help="comma-separated attention backends to time one after another (overrides --attention-backend)",
    )
    parser.add_argument(
        "--profile", metavar="DIR", help="after each timed run, profile a dozen full-batch steps; trace into DIR"
    )
    parser.add_argument("--step-stats", action="store_true", help="print the timed run's step wall times by batch size")
    add_engine_args(parser, skip=("seed",))
    args = parser.parse_args(argv)
    check_workload_args(parser, args)
    if args.hf_batch_size < 1:
        parser.error("--hf-batch-size must be positive")
    if args.hf and engine_defaults(args.preset):
        parser.error(f"--preset {args.preset} has no weights on disk (load_format dummy): --hf cannot load it")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    engine_kwargs = engine_options(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    with model_dir(args) as model:
        hf_config, cfg, workload = load_workload(args, model, engine_kwargs)
        warmup = make_warmup(args.seed, hf_config.vocab_size, max(2, args.hf_batch_size))
        results = []
        hf_result = run_hf(model, workload, warmup, cfg, args.hf_batch_size, args.seed) if args.hf else None
        if hf_result:
            print(hf_result.line())
            gc.collect()  # free the HF model before the engine sizes its KV cache
            if cfg.device.startswith("cuda"):
                torch.cuda.empty_cache()
        backends = args.backends.split(",") if args.backends else [None]
        for backend in backends:
            kwargs = engine_kwargs if backend is None else {**engine_kwargs, "attention_backend": backend}
            try:
                after = (lambda llm: profile_steps(llm, workload, args.profile)) if args.profile else None
                results.append(
                    run_nanostream(model, workload, warmup, kwargs, args.seed, after=after, step_stats=args.step_stats)
                )
            except ValueError as exc:  # a backend that cannot run here
                print(f"nanostream[{backend}]: skipped: {exc}")
                continue
            print(results[-1].line())
        if hf_result:
            results.append(hf_result)
    if not results:
        raise SystemExit("bench.py: nothing ran (every backend was skipped)")
    print(summary(results))


if __name__ == "__main__":
    main()
