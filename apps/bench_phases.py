"""Where an offline run's time goes, phase by phase: the prefill phase (every step up to the last one with
prompt tokens) and the decode phase after it, per round of the bench workload (fresh prompt ids each
round, so no round hits the prefix cache of another), from a trace of every ``LLMEngine.step``.

    python3 apps/bench_phases.py --preset qwen3-0.6b --build-dir /tmp/qwen3-0.6b-random \\
        --attention-backend triton --rounds 4 [--enforce-eager] [--profile-steps 8]

Per phase: steps, wall time, and per step the host's time in ``step`` other than waiting for the device
and the time it waited (``ModelRunner.device_wait_seconds``). A phase whose waits are ~0 runs at the
host's pace. ``--profile-steps N``: torch.profiler over N prefill steps (from the second step) of each round in
``--profile-rounds`` (the first, unless told), and where the time went, host and device; with it, each
round prints the SM clock read at its fifth step.
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import dataclass

import torch
from workload import (
    add_workload_args,
    check_workload_args,
    engine_options,
    load_workload,
    make_warmup,
    model_dir,
    params_of,
    round_workload,
    sync,
)

from nanostream import LLM
from nanostream.options import add_engine_args


@dataclass
class Step:
    start: float
    seconds: float
    wait: float  # of it, waiting for the device
    prefill_tokens: int


def phase(steps: list[Step]) -> str:
    if not steps:
        return "0 steps"
    wall = steps[-1].start + steps[-1].seconds - steps[0].start
    host = 1e3 * sum(s.seconds - s.wait for s in steps) / len(steps)
    wait = 1e3 * sum(s.wait for s in steps) / len(steps)
    per_step = 1e3 * wall / len(steps)
    return f"{len(steps)} steps, {1e3 * wall:.0f} ms ({per_step:.2f} ms/step: host {host:.2f} + wait {wait:.2f})"


def profile_table(prof, steps: int) -> str:
    """Host time by op and device time by kernel, per step, from a torch.profiler run."""
    events = prof.key_averages()
    device = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    host = sorted(events, key=lambda e: -e.self_cpu_time_total)[:8]
    lines = [f"  host, self time of the op, ms/step: {sum(e.self_cpu_time_total for e in events) / 1e3 / steps:.1f}"]
    lines += [
        f"    {e.key[:60]:60} {e.self_cpu_time_total / 1e3 / steps:6.2f}  ({e.count // steps} calls)" for e in host
    ]
    if device:
        total = sum(e.self_device_time_total for e in device) / 1e3 / steps
        lines.append(f"  device, kernels, ms/step: {total:.1f}")
        for e in sorted(device, key=lambda e: -e.self_device_time_total)[:8]:
            lines.append(
                f"    {e.key[:60]:60} {e.self_device_time_total / 1e3 / steps:6.2f}  ({e.count // steps} calls)"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add_workload_args(parser)
    parser.add_argument("--rounds", type=int, default=4, help="rounds, each with fresh prompt ids")
    parser.add_argument("--profile-steps", type=int, default=0, help="torch.profiler over this many prefill steps")
    parser.add_argument("--profile-rounds", default="0", help="the rounds that --profile-steps profiles: '0,1'")
    parser.add_argument(
        "--floor",
        action="store_true",
        help="CUDA: print the decode phase's floor, this rank's weights and KV read per step at the measured "
        "copy bandwidth (for fixed lengths: --min-input-len = --max-input-len, likewise outputs)",
    )
    add_engine_args(parser, skip=("seed",))
    args = parser.parse_args()
    check_workload_args(parser, args)
    options = engine_options(args)
    with model_dir(args) as model:
        hf_config, _, workload = load_workload(args, model, options)
        llm = LLM(str(model), seed=args.seed, **options)
        warmup = make_warmup(args.seed, hf_config.vocab_size, 16)
        llm.generate([r.prompt_token_ids for r in warmup], [params_of(r) for r in warmup], use_tqdm=False)
        gc.collect()
        gc.freeze()
        engine, runner = llm.engine, llm.engine.runner
        trace: list[Step] = []
        step, profiling = engine.step, {}

        def traced():
            wait, start = runner.device_wait_seconds, time.perf_counter()
            if len(trace) == 1 and "prof" in profiling:
                profiling["prof"].start()
            result = step()
            trace.append(Step(start, time.perf_counter() - start, runner.device_wait_seconds - wait,
                              result.num_prefill_tokens))  # fmt: skip
            if len(trace) == 1 + args.profile_steps and "prof" in profiling:
                sync(llm.config.device)
                profiling["done"] = profiling.pop("prof")
                profiling["done"].stop()
            if len(trace) == 5 and args.profile_steps and torch.cuda.is_available():
                profiling["clock"] = torch.cuda.clock_rate(llm.config.device)  # MHz, through NVML
            return result

        engine.step = traced
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profile_rounds = {int(r) for r in args.profile_rounds.split(",")} if args.profile_steps else set()
        for i in range(args.rounds):
            if i in profile_rounds:
                profiling["prof"] = torch.profiler.profile(activities=activities)
            requests = round_workload(workload, args.seed, i + 1, hf_config.vocab_size)
            trace.clear()
            before = engine.stats()
            before_mem = torch.cuda.memory_stats(llm.config.device) if torch.cuda.is_available() else {}
            sync(llm.config.device)
            start = time.perf_counter()
            outputs = llm.generate([r.prompt_token_ids for r in requests], [params_of(r) for r in requests],
                                   use_tqdm=False)  # fmt: skip
            sync(llm.config.device)
            elapsed = time.perf_counter() - start
            after = engine.stats()
            after_mem = torch.cuda.memory_stats(llm.config.device) if torch.cuda.is_available() else {}
            n = max(after.first_tokens - before.first_tokens, 1)
            queue = 1e3 * (after.queue_seconds - before.queue_seconds) / n
            prefill = 1e3 * (after.prefill_seconds - before.prefill_seconds) / n
            last = max((j for j, s in enumerate(trace) if s.prefill_tokens), default=-1)
            tokens = sum(len(o.token_ids) for o in outputs)
            print(f"round {i}: {tokens / elapsed:,.0f} out tok/s, {len(trace)} steps; prefill phase "
                  f"{phase(trace[: last + 1])}; decode phase {phase(trace[last + 1 :])}; first token: "
                  f"queue {queue:.0f} + prefill {prefill:.0f} ms", flush=True)  # fmt: skip
            if args.profile_steps:
                steps_ms = " ".join(f"{1e3 * s.seconds:.1f}" for s in trace[: last + 1])
                print(f"  prefill steps, ms: {steps_ms}", flush=True)
                if torch.cuda.is_available():
                    mem = {k: after_mem.get(k, 0) - before_mem.get(k, 0) for k in after_mem}
                    print(f"  allocator: {mem.get('num_device_alloc', 0)} cudaMalloc, {mem.get('num_device_free', 0)} "
                          f"cudaFree, {mem.get('num_alloc_retries', 0)} retries", flush=True)  # fmt: skip
            if "clock" in profiling:
                print(f"  SM clock at step 5: {profiling.pop('clock')} MHz", flush=True)
            if "done" in profiling:
                print(profile_table(profiling.pop("done"), args.profile_steps), flush=True)
        if args.floor:
            print(decode_floor(runner, workload), flush=True)


def decode_floor(runner, workload) -> str:
    """ms per decode step of the workload's batch if the step only read this rank's weights (less an
    untied embedding, of which a step reads a row per sequence) and each sequence's KV at its mean
    decode context (prompt + half the output), at the device's copy bandwidth (bytes read + written)."""
    if not torch.cuda.is_available():
        return "decode floor: needs CUDA (the copy bandwidth)"
    from kernel_bench.peaks import copy_bandwidth

    model = runner.model
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    embed = model.model.embed_tokens.weight
    if embed is not model.lm_head.weight:
        weights -= embed.numel() * embed.element_size()
    per_token = runner.kv_block_bytes / runner.block_size  # this rank's K and V of every layer
    kv = sum((len(r.prompt_token_ids) + r.max_tokens / 2) * per_token for r in workload)
    bandwidth = copy_bandwidth()  # bytes/s, read + written
    return (
        f"decode floor at batch {len(workload)}: {1e3 * (weights + kv) / bandwidth:.2f} ms/step (weights "
        f"{weights / 1e9:.2f} GB + KV {kv / 1e9:.2f} GB a step, copy {bandwidth / 1e12:.2f} TB/s)"
    )


if __name__ == "__main__":
    main()
