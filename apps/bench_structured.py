"""What structured outputs cost: one engine runs bench.py's workload plain, then with a share of its
requests constrained by a grammar, and the two runs' throughput and step times are compared.

Usage::

    python apps/bench_structured.py --model /models/Qwen3-0.6B                  # a real tokenizer's masks
    python apps/bench_structured.py --preset qwen3-0.6b --constrained 0.5 --kind regex
    python apps/bench_structured.py --num-requests 16 --max-input-len 64 --max-output-len 64   # CPU smoke run

Both runs draw the same workload (bench.py's, temperature 0.6, ignore_eos) in the same engine, after
one warm-up that also compiles the grammar (the compile is reported apart). A constrained request
ends when its grammar does, so output tokens are counted as delivered, and throughput is output
tokens / elapsed. ``--kind json``: an object with a list of free strings, compact; ``regex``: words of
lowercase letters. A random-weight preset carries the tiny test tokenizer (512 tokens): its masks are
cheaper than a real vocabulary's, so measure with ``--model`` for the real cost.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
from tables import format_table
from workload import add_workload_args, check_workload_args, engine_options, load_workload, model_dir, sync

from nanostream import LLM, SamplingParams
from nanostream.options import add_engine_args
from nanostream.structured_outputs import StructuredOutputsParams

TEMPERATURE = 0.6
GRAMMARS = {
    "json": StructuredOutputsParams(
        json={
            "type": "object",
            "properties": {"title": {"type": "string"}, "lines": {"type": "array", "items": {"type": "string"}}},
            "required": ["title", "lines"],
        }
    ),
    "regex": StructuredOutputsParams(regex=r"[a-z]+( [a-z]+)*"),
}


def timed(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, int, float, int]:
    """(elapsed s, output tokens, mean step ms, steps) of one generate."""
    before = llm.engine.stats()
    sync(llm.config.device)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    sync(llm.config.device)
    elapsed = time.perf_counter() - start
    after = llm.engine.stats()
    steps = sum(after.steps.values()) - sum(before.steps.values())
    step_ms = (after.step_seconds - before.step_seconds) / max(steps, 1) * 1e3
    return elapsed, sum(len(o.token_ids) for o in outputs), step_ms, steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(parser)
    parser.add_argument("--constrained", type=float, default=0.5, help="share of the requests with a grammar (0-1)")
    parser.add_argument("--kind", choices=sorted(GRAMMARS), default="json", help="the grammar of those requests")
    add_engine_args(parser, skip=("seed",))
    args = parser.parse_args(argv)
    check_workload_args(parser, args)
    if not 0 <= args.constrained <= 1:
        parser.error("--constrained must be in [0, 1]")
    if args.threads:
        torch.set_num_threads(args.threads)
    with model_dir(args) as model:
        _, cfg, workload = load_workload(args, model, engine_options(args))
        llm = LLM(str(model), seed=args.seed, **engine_options(args))
        grammar = GRAMMARS[args.kind]
        every = round(1 / args.constrained) if args.constrained else 0

        def params(constrained: bool) -> list[SamplingParams]:
            return [
                SamplingParams(
                    temperature=TEMPERATURE,
                    ignore_eos=True,
                    max_tokens=r.max_tokens,
                    structured_outputs=grammar if constrained and every and i % every == 0 else None,
                )
                for i, r in enumerate(workload)
            ]

        start = time.perf_counter()  # warm-up: a few requests of each kind, the grammar compiled
        llm.generate([r.prompt_token_ids[:32] for r in workload[:4]], params(True)[:4], use_tqdm=False)
        warmup = time.perf_counter() - start
        gc.collect()
        gc.freeze()
        prompts = [r.prompt_token_ids for r in workload]
        rows = [["run", "constrained", "output tokens", "elapsed s", "output tok/s", "mean step ms", "steps"]]
        for name, constrained in (("plain", False), (f"{args.kind} grammar", True)):
            ps = params(constrained)
            elapsed, tokens, step_ms, steps = timed(llm, prompts, ps)
            n = sum(p.structured_outputs is not None for p in ps)
            rows.append(
                [name, str(n), str(tokens), f"{elapsed:.2f}", f"{tokens / elapsed:.1f}", f"{step_ms:.2f}", str(steps)]
            )
        print(f"warm-up (grammar compiled): {warmup:.2f} s; {cfg.device} {cfg.dtype}")
        print("\n".join(format_table(rows)))
        del llm
        gc.unfreeze()


if __name__ == "__main__":
    main()
