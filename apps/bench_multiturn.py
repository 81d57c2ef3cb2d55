"""Multi-turn chat on a random-weight model with prefix caching on and off: the time to the first token of each
conversation's last turn, and the share of prompt tokens served from the prefix cache.

A shared system prompt (``--system`` tokens), ``--conversations`` conversations of ``--turns`` turns: each turn's
prompt is the conversation's whole history (its earlier replies as generated) and a new user message
(``--message`` tokens); replies are ``--reply`` tokens (greedy, EOS ignored). The turns before the last run as
a batch per turn; the last turn runs one request at a time with ``max_tokens=1``, so its wall time is the
request's TTFT on an otherwise idle engine.

    python3 apps/bench_multiturn.py --preset qwen3.5-9b
    python3 apps/bench_multiturn.py --preset qwen3-8b --tiny-config '{"weights": false}' --load-format dummy
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from presets import PRESETS, engine_defaults, random_model

from nanostream import LLM, SamplingParams
from nanostream.options import add_engine_args, engine_kwargs


def run(path, options: dict, args: argparse.Namespace) -> tuple[list[float], float]:
    """(the last turn's TTFT of each conversation in seconds, the share of prompt tokens served from the cache)."""
    rng = random.Random(0)
    reply = SamplingParams(temperature=0.0, max_tokens=args.reply, ignore_eos=True)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    cached = total = 0
    ttfts = []
    with LLM(str(path), **options) as llm:
        vocab = min(10000, llm.engine.vocab_size)  # the bench workload's ids: randint(0, 10000)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(vocab) for _ in range(n)]

        system = tokens(args.system)
        histories = [system + tokens(args.message) for _ in range(args.conversations)]
        llm.generate([tokens(64)], first, use_tqdm=False)  # warm-up
        for _ in range(args.turns - 1):
            outputs = llm.generate(histories, reply, use_tqdm=False)
            cached += sum(o.num_cached_tokens for o in outputs)
            total += sum(len(h) for h in histories)
            histories = [h + o.token_ids + tokens(args.message) for h, o in zip(histories, outputs, strict=True)]
        for history in histories:
            start = time.perf_counter()
            (out,) = llm.generate([history], first, use_tqdm=False)
            ttfts.append(time.perf_counter() - start)
            cached += out.num_cached_tokens
            total += len(history)
    return ttfts, cached / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), help="a model shape (default: the tiny random model)")
    parser.add_argument("--tiny-config", default="{}", help="JSON overrides of the preset")
    parser.add_argument("--build-dir")
    parser.add_argument("--system", type=int, default=2000, help="system prompt tokens")
    parser.add_argument("--message", type=int, default=200, help="tokens of each user message")
    parser.add_argument("--reply", type=int, default=200, help="tokens of each reply")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--conversations", type=int, default=16)
    add_engine_args(parser)
    args = parser.parse_args()
    with random_model(args.preset, json.loads(args.tiny_config), args.build_dir) as path:
        options = {**engine_defaults(args.preset), **engine_kwargs(args)}
        rows = []
        for caching in (True, False):
            ttfts, share = run(path, {**options, "enable_prefix_caching": caching}, args)
            rows.append((caching, statistics.median(ttfts), max(ttfts), share, len(ttfts)))
    print(f"{args.preset}: turn {args.turns} of {args.conversations} conversations, one request at a time")
    print("prefix caching  median TTFT ms  max TTFT ms  prompt tokens from cache")
    for caching, median, worst, share, _ in rows:
        print(f"{'on' if caching else 'off':>14}  {median * 1e3:13.1f}  {worst * 1e3:11.1f}  {share:24.3f}")
    print(f"TTFT off / on: {rows[1][1] / rows[0][1]:.1f}x")


if __name__ == "__main__":
    main()
