"""Offline throughput: nano-vLLM's bench workload through ``LLM.generate``, optionally against HF ``generate``.

Usage::

    python apps/bench.py                                       # tiny random model, the full workload
    python apps/bench.py --num-requests 32 --max-input-len 256 --min-output-len 32 --max-output-len 128 --hf
    python apps/bench.py --preset qwen3-0.6b                   # Qwen3-0.6B's shape, random weights (GPU)
    python apps/bench.py --preset qwen3-30b-a3b                # Qwen3-30B-A3B's shape, load_format dummy (GPU)
    python apps/bench.py --model /models/Qwen3-0.6B --hf

Workload (nano-vLLM's ``bench.py``): ``random.seed(seed)``; then, for each request, a prompt length in
[min_input_len, max_input_len] and that many token ids in [0, min(10000, vocab - 1)] (``randint``, both
ends included: 142,827 prompt and 133,966 output tokens at the defaults); then, for each
request, max_tokens in [min_output_len, max_output_len]. Every request samples at temperature 0.6
with ignore_eos, so it generates exactly max_tokens tokens.

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
import contextlib
import gc
import json
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from presets import PRESETS, engine_defaults, random_model
from tables import format_table

from nanostream import LLM, SamplingParams
from nanostream.config import EngineConfig
from nanostream.options import add_engine_args
from nanostream.options import engine_kwargs as engine_args

TEMPERATURE = 0.6
PROMPT_VOCAB = 10000  # nano-vLLM draws prompt ids below this


@dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]
    max_tokens: int


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


def make_workload(args: argparse.Namespace, vocab_size: int) -> list[Request]:
    """nano-vLLM's draws, in its order: all prompts first, then all max_tokens."""
    random.seed(args.seed)
    high = min(PROMPT_VOCAB, vocab_size - 1)  # inclusive, as nano-vLLM's randint(0, 10000)
    prompts = [
        [random.randint(0, high) for _ in range(random.randint(args.min_input_len, args.max_input_len))]
        for _ in range(args.num_requests)
    ]
    max_tokens = [random.randint(args.min_output_len, args.max_output_len) for _ in range(args.num_requests)]
    return [Request(p, m) for p, m in zip(prompts, max_tokens)]


@contextlib.contextmanager
def model_dir(args: argparse.Namespace) -> Iterator[Path]:
    """``--model``, or a random model built into ``--build-dir`` (reused when built alike) or a temp dir."""
    if args.model:
        yield Path(args.model)
        return
    with random_model(args.preset, args.tiny_config, args.build_dir) as path:
        yield path


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def environment(device: str) -> str:
    import platform

    import transformers

    if device.startswith("cuda"):
        where = torch.cuda.get_device_name(device)
    else:
        where = f"cpu, {torch.get_num_threads()} torch threads"
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    return f"python {platform.python_version()}, {versions}; {where}"


def make_warmup(seed: int, vocab_size: int, n: int) -> list[Request]:
    """Short requests of their own random ids, so warm-up leaves nothing in the prefix cache for the workload."""
    rng = random.Random(seed + 1)
    return [Request([rng.randrange(min(PROMPT_VOCAB, vocab_size)) for _ in range(32)], 8) for _ in range(n)]


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
    llm.generate(
        [r.prompt_token_ids for r in warmup],
        [SamplingParams(temperature=TEMPERATURE, ignore_eos=True, max_tokens=r.max_tokens) for r in warmup],
        use_tqdm=False,
    )
    if instrument is not None:
        instrument(llm)
    # What start-up and warm-up made lives for the whole run: keep the collector's full passes off it (one
    # stalled a step for 280 ms on an H200), as `nanostream serve` does. Given back with the engine below.
    gc.collect()
    gc.freeze()
    stats = StepStats(llm) if step_stats else None
    params = [SamplingParams(temperature=TEMPERATURE, ignore_eos=True, max_tokens=r.max_tokens) for r in workload]
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


class StepStats:
    """Wall time of every engine step of the timed run, by kind: steps that compute prompt tokens, and
    decode-only steps by batch size. With the pipelined step, a step's wall time is the longer of its
    host work and the device's work on the step before it."""

    def __init__(self, llm: LLM) -> None:
        self.steps: list[tuple[float, int, int]] = []  # (seconds, prefill tokens, decode tokens)
        self.contexts: list[list[int]] = []  # per step: the tokens each running sequence holds (the KV it reads)
        self.floor = StepFloor(llm) if llm.config.device.startswith("cuda") else None
        step, running = llm.engine.step, llm.engine.scheduler.running

        def timed_step():
            start = time.perf_counter()
            result = step()
            self.steps.append((time.perf_counter() - start, result.num_prefill_tokens, result.num_decode_tokens))
            self.contexts.append([seq.num_tokens for seq in running])
            return result

        llm.engine.step = timed_step
        # Other causes of a slow step: the collector's pauses, and the CUDA allocator freeing its cache
        # to retry an allocation (a device sync and cudaFree calls).
        self.pauses: list[tuple[int, int, float]] = []  # (step, generation, seconds) of collections over 5 ms
        self._gc_start = 0.0

        def collected(phase: str, info: dict) -> None:
            if phase == "start":
                self._gc_start = time.perf_counter()
            elif (seconds := time.perf_counter() - self._gc_start) > 5e-3:
                self.pauses.append((len(self.steps), info["generation"], seconds))

        self._gc_callback = collected
        gc.callbacks.append(collected)
        self._cuda = llm.config.device.startswith("cuda")
        self._retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) if self._cuda else 0
        # Triton kernels compiled inside the timed run (variants the warm-up did not reach), by step.
        self.compiles: list[tuple[int, str]] = []
        try:
            from triton import knobs
        except ImportError:
            return
        self._knobs = knobs

        def compiled(*, repr: str, **_: object) -> None:
            self.compiles.append((len(self.steps), repr))

        knobs.runtime.jit_post_compile_hook = compiled

    def close(self) -> None:
        gc.callbacks.remove(self._gc_callback)
        if self._cuda:
            self._retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) - self._retries
        if hasattr(self, "_knobs"):
            self._knobs.runtime.jit_post_compile_hook = None

    @staticmethod
    def group(prefill: int, decode: int) -> int:
        """-1 for a step with prompt tokens, else its decode batch rounded down to a power of two."""
        return -1 if prefill else 1 << max(0, decode.bit_length() - 1)

    @staticmethod
    def label(group: int) -> str:
        return "with prefill" if group < 0 else f"decode {group}-{2 * group - 1}" if group > 1 else "decode 1"

    def table(self, factor: float = 3.0, limit: int = 10) -> str:
        """Steps by group, then the steps over ``factor`` times their group's median (first-use costs)."""
        groups: dict[int, list[float]] = {}
        for seconds, prefill, decode in self.steps:
            groups.setdefault(self.group(prefill, decode), []).append(seconds)
        medians = {g: sorted(times)[len(times) // 2] for g, times in groups.items()}
        floors: dict[int, float] = {}  # s: the steps' floors, summed by group
        if self.floor is not None:
            for (_, prefill, decode), context in zip(self.steps, self.contexts):
                g = self.group(prefill, decode)
                floors[g] = floors.get(g, 0.0) + self.floor.seconds(prefill + decode, context)
        total = sum(s for s, _, _ in self.steps)
        rows = [("steps", "count", "total s", "share", "mean ms", "median ms", "floor s", "floor / time")]
        for g in sorted(groups, key=lambda g: (g >= 0, -g)):  # prefill first, then falling batch size
            times = groups[g]
            floor = (f"{floors[g]:.2f}", f"{floors[g] / sum(times):.2f}") if g in floors else ("", "")
            rows.append((self.label(g), str(len(times)), f"{sum(times):.2f}", f"{sum(times) / total:.0%}",
                         f"{1e3 * sum(times) / len(times):.2f}", f"{1e3 * medians[g]:.2f}", *floor))  # fmt: skip
        floor = (f"{sum(floors.values()):.2f}", f"{sum(floors.values()) / total:.2f}") if floors else ("", "")
        rows.append(("all", str(len(self.steps)), f"{total:.2f}", "100%", "", "", *floor))
        slow = [
            f"  step {i}: {1e3 * seconds:.1f} ms ({prefill} prefill + {decode} decode tokens)"
            for i, (seconds, prefill, decode) in enumerate(self.steps)
            if seconds > factor * medians[self.group(prefill, decode)]
        ]
        if slow:
            more = f" (the first {limit} of {len(slow)})" if len(slow) > limit else ""
            slow = [f"steps over {factor:g}x their group's median{more}:", *slow[:limit]]
        if self.pauses:
            slow.append(f"collector pauses over 5 ms ({len(self.pauses)}):")
            slow += [f"  step {i}: generation {g}, {1e3 * t:.1f} ms" for i, g, t in self.pauses[:limit]]
        if self._cuda:
            slow.append(f"CUDA allocator retries (cache freed to retry an allocation): {self._retries}")
        compiles = [f"  step {i}: {what[:240]}" for i, what in self.compiles]
        if compiles:
            compiles.insert(0, f"Triton kernels compiled during the timed run ({len(compiles)}):")
        notes = [self.floor.describe()] if self.floor is not None else []
        return "\n".join([*format_table(rows), *notes, *slow, *compiles[: limit + 1]])


class StepFloor:
    """A step's floor: the time to read, once, at the device's measured copy bandwidth, the weights it
    touches and the KV of its running sequences (of a sliding-window layer, at most the window of each).
    Weights: all but an untied embedding (a step reads a
    row of it per token), and of a mixture-of-experts layer only the experts its tokens can route to:
    E (1 - (1 - K/E)^T) of E for T tokens, as if each picked K experts uniformly. A prefill step is also
    bound by its arithmetic, which this does not count: its floor is the lowest."""

    def __init__(self, llm: LLM) -> None:
        from kernel_bench.ceilings import copy_ms

        from nanostream.layers.moe import SparseMoE

        runner = llm.engine.runner
        model = runner.model
        # (top_k, that layer's experts): their weights are read as far as tokens route to them
        self.experts = [(m.gate.top_k, m.experts) for m in model.modules() if isinstance(m, SparseMoE)]
        expert_params = {id(p) for _, m in self.experts for p in m.parameters()}
        self.dense = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in expert_params)
        embed = model.model.embed_tokens.weight
        if embed is not model.lm_head.weight:
            self.dense -= embed.numel() * embed.element_size()
        self.kv_per_token = runner.kv_block_bytes / runner.block_size  # K and V of every layer
        # a sliding layer reads at most its window of a sequence's context: (window, its share of the KV)
        windows = [w for w in runner.spec.layer_windows if w is not None]
        self.window_share = [(w, 1 / runner.spec.num_layers) for w in windows]
        nbytes = 1 << 30
        self.bandwidth = max(2 * nbytes / (copy_ms(nbytes) * 1e-3) for _ in range(2))  # bytes/s, read + written

    def seconds(self, tokens: int, contexts: list[int]) -> float:
        """``tokens`` of the step; ``contexts``: each running sequence's tokens."""
        read = sum(contexts) * (1 - sum(share for _, share in self.window_share))
        read += sum(share * min(c, w) for w, share in self.window_share for c in contexts)
        nbytes = self.dense + read * self.kv_per_token
        for k, m in self.experts:
            e = m.w13.shape[0]
            touched = e * (1 - (1 - k / e) ** tokens)
            nbytes += touched / e * (m.w13.numel() * m.w13.element_size() + m.w2.numel() * m.w2.element_size())
        return nbytes / self.bandwidth

    def describe(self) -> str:
        experts = sum(
            m.w13.numel() * m.w13.element_size() + m.w2.numel() * m.w2.element_size() for _, m in self.experts
        )
        return (
            f"floor: weights {self.dense / 1e9:.2f} GB dense + {experts / 1e9:.2f} GB of experts (the touched share), "
            f"KV {self.kv_per_token / 1024:.0f} KiB a context token (a sliding layer's share within its window), "
            f"at {self.bandwidth / 1e12:.2f} TB/s"
        )


def summary(results: list[Result]) -> str:
    rows = [("engine", "requests", "out tok", "time s", "out tok/s", "total tok/s")]
    rows += [(r.name, str(r.num_requests), str(r.output_tokens), f"{r.elapsed:.2f}", *r.rates()) for r in results]
    lines = format_table(rows)
    baseline = results[-1]
    if len(results) >= 2 and not baseline.name.startswith("nanostream"):
        for r in results[:-1]:
            lines.append(f"{r.name} / {baseline.name} output tok/s: {r.output_tps / baseline.output_tps:.2f}x")
    return "\n".join(lines)


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The workload's and the model's options (apps/bench_stream.py takes them too)."""
    parser.add_argument("--seed", type=int, default=0, help="random.seed of the workload; also the engine's seed")
    parser.add_argument("--num-requests", type=int, default=256, help="requests in the workload")
    parser.add_argument("--min-input-len", type=int, default=100, help="shortest prompt, in tokens")
    parser.add_argument("--max-input-len", type=int, default=1024, help="longest prompt, in tokens")
    parser.add_argument("--min-output-len", type=int, default=100, help="smallest max_tokens")
    parser.add_argument("--max-output-len", type=int, default=1024, help="largest max_tokens")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads of every engine; None: torch's own")
    model = parser.add_argument_group("model (default: the tiny random model, built into a temp dir)")
    model.add_argument("--model", help="a Hugging Face model directory (or hub id) instead of a built one")
    model.add_argument("--preset", choices=sorted(PRESETS), help="build a random-weight model of this shape")
    model.add_argument(
        "--tiny-config",
        help='JSON of make_tiny_model overrides, over --preset: \'{"hidden_size": 256, "num_hidden_layers": 4}\'',
    )
    model.add_argument("--build-dir", help="build the model here and keep it; reused when built with the same settings")


def check_workload_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``parser.error`` on bad workload or model options; parses ``--tiny-config`` in place."""
    for lo, hi in (("min_input_len", "max_input_len"), ("min_output_len", "max_output_len")):
        if not 1 <= getattr(args, lo) <= getattr(args, hi):
            parser.error(f"need 1 <= --{lo.replace('_', '-')} <= --{hi.replace('_', '-')}")
    if args.num_requests < 1:
        parser.error("--num-requests must be positive")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be positive")
    try:
        args.tiny_config = json.loads(args.tiny_config or "{}")
    except json.JSONDecodeError as exc:
        parser.error(f"--tiny-config is not valid JSON ({exc})")
    if not isinstance(args.tiny_config, dict):
        parser.error("--tiny-config must be a JSON object, e.g. '{\"num_hidden_layers\": 4}'")
    if args.model and (args.preset or args.tiny_config or args.build_dir):
        parser.error("--model runs an existing model; --preset, --tiny-config and --build-dir build one: pick one")


def engine_options(args: argparse.Namespace) -> dict:
    """The engine options given on the command line, less ``seed`` (``--seed`` is the workload's), over what
    the preset needs (``load_format="dummy"`` for the shapes built without weights)."""
    given = {k: v for k, v in engine_args(args).items() if k != "seed"}
    return {**engine_defaults(getattr(args, "preset", None)), **given}


def load_workload(
    args: argparse.Namespace, model: Path, engine_kwargs: dict
) -> tuple[Any, EngineConfig, list[Request]]:
    """The model's HF config, the resolved engine config and the workload; prints what they are."""
    from transformers import AutoConfig

    from nanostream.models.architectures import text_config

    hf_config = text_config(AutoConfig.from_pretrained(model))  # a multimodal checkpoint: its language model's
    cfg = EngineConfig.from_kwargs(str(model), **engine_kwargs).resolve(
        max_position_embeddings=hf_config.max_position_embeddings, cuda_available=torch.cuda.is_available()
    )
    if args.max_input_len + args.max_output_len > cfg.max_model_len:
        raise SystemExit(
            f"--max-input-len + --max-output-len ({args.max_input_len + args.max_output_len}) exceeds "
            f"max_model_len ({cfg.max_model_len}); lower them or raise --max-model-len"
        )
    workload = make_workload(args, hf_config.vocab_size)
    prompt_tokens = sum(len(r.prompt_token_ids) for r in workload)
    print(
        f"workload: {len(workload)} requests, seed {args.seed}, {prompt_tokens} prompt tokens "
        f"(len {args.min_input_len}-{args.max_input_len}), {sum(r.max_tokens for r in workload)} output tokens "
        f"(len {args.min_output_len}-{args.max_output_len}), temperature {TEMPERATURE}, ignore_eos"
    )
    print(f"env: {environment(cfg.device)}")
    print(
        f"model: {model}, {hf_config.num_hidden_layers} layers, hidden {hf_config.hidden_size}, "
        f"vocab {hf_config.vocab_size}"
    )
    return hf_config, cfg, workload


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
