"""The scheduler's host time per decode step, without a model: ``schedule()``, ``launched()`` and
``resolve()`` for N running sequences (prefix caching on), the busy loop's share of a step that is
plain Python.

    python3 apps/bench_scheduler.py --seqs 256
"""

from __future__ import annotations

import argparse
import random
import time

from nanostream.engine.block_manager import BlockManager
from nanostream.engine.scheduler import Scheduler
from nanostream.engine.sequence import Sequence
from nanostream.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, default=256, help="running sequences (default: 256)")
    parser.add_argument("--steps", type=int, default=300, help="timed decode steps (default: 300)")
    args = parser.parse_args()
    block_size, rng = 16, random.Random(0)
    manager = BlockManager(num_blocks=args.seqs * 80, block_size=block_size)
    scheduler = Scheduler(manager, max_num_seqs=args.seqs, max_num_batched_tokens=16384, max_model_len=4096)
    for i in range(args.seqs):
        prompt = [rng.randrange(3, 500) for _ in range(rng.randrange(100, 1000))]
        params = SamplingParams(max_tokens=2000, ignore_eos=True)
        scheduler.add(Sequence(f"r{i}", prompt, params, max_tokens=2000, sampling_seed=i, stop_token_ids=frozenset()))

    def step() -> None:
        chunks = scheduler.schedule()
        scheduler.launched(chunks)
        scheduler.resolve(chunks, {c.seq.request_id: 7 for c in chunks if c.samples})

    for _ in range(20):  # the prompts' prefill, then decodes
        step()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    per_step = (time.perf_counter() - start) / args.steps
    print(f"schedule + launched + resolve: {per_step * 1e6:.0f} us per decode step at {args.seqs} sequences")


if __name__ == "__main__":
    main()
