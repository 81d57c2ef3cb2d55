"""The busy loop's host work per decode step that is plain Python, without a model: the scheduler's
``schedule()``, ``launched()`` and ``resolve()`` for N running sequences (prefix caching on), and
``pack_step()`` of their chunks and ``make_sampling_batch()`` of their sequences (host lists and their
uploads, on the CPU), and the engine process's routing of their tokens to 4 clients, encoded.

    python3 apps/bench_scheduler.py --seqs 256 --block-size 256
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from nanostream import protocol as p
from nanostream.config import ServerConfig
from nanostream.engine.block_manager import BlockManager
from nanostream.engine.process.request_book import RequestBook, _Pending
from nanostream.engine.runner.sampling_batch import make_sampling_batch
from nanostream.engine.runner.step_inputs import Uploads, pack_step
from nanostream.engine.scheduler import Scheduler
from nanostream.engine.sequence import Sequence
from nanostream.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, default=256, help="running sequences (default: 256)")
    parser.add_argument("--block-size", type=int, default=256, help="KV block size (default: 256, the engine's)")
    parser.add_argument("--steps", type=int, default=300, help="timed decode steps (default: 300)")
    args = parser.parse_args()
    bs, rng = args.block_size, random.Random(0)
    manager = BlockManager(num_blocks=args.seqs * (4096 // bs + 1), block_size=bs)
    scheduler = Scheduler(manager, max_num_seqs=args.seqs, max_num_batched_tokens=16384, max_model_len=4096)
    for i in range(args.seqs):
        prompt = [rng.randrange(3, 500) for _ in range(rng.randrange(100, 1000))]
        params = SamplingParams(max_tokens=2000, ignore_eos=True)
        scheduler.add(Sequence(f"r{i}", prompt, params, max_tokens=2000, sampling_seed=i, stop_token_ids=frozenset()))

    def step() -> list:
        chunks = scheduler.schedule()
        scheduler.launched(chunks)
        scheduler.resolve(chunks, {c.seq.request_id: 7 for c in chunks if c.samples})
        return chunks

    for _ in range(20):  # the prompts' prefill, then decodes
        step()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    scheduling = (time.perf_counter() - start) / args.steps
    chunks, cpu = scheduler.schedule(), torch.device("cpu")  # decode rows whose tokens are known
    uploads = Uploads(cpu)  # a runner's upload memory
    start = time.perf_counter()
    for _ in range(args.steps):
        uploads.new_step()
        pack_step(chunks, bs, cpu, uploads=uploads)
    packing = (time.perf_counter() - start) / args.steps
    seqs = [c.seq for c in chunks]
    start = time.perf_counter()
    for _ in range(args.steps):
        make_sampling_batch(seqs, 151_936, cpu, uploads)  # Qwen3's vocabulary
    sampling = (time.perf_counter() - start) / args.steps
    routing = route_and_flush(args.seqs, args.steps)
    print(f"{args.seqs} decode rows, blocks of {bs}: schedule + launched + resolve {scheduling * 1e6:.0f} us, "
          f"pack_step {packing * 1e6:.0f} us, make_sampling_batch {sampling * 1e6:.0f} us, "
          f"route + flush (4 clients) {routing * 1e6:.0f} us a step")  # fmt: skip


def route_and_flush(num_requests: int, steps: int) -> float:
    """Seconds per step to route one token of each of ``num_requests`` running requests of 4 clients
    (the engine process's RequestBook) and encode the 4 Outputs messages."""
    book, sent = RequestBook(None, ServerConfig(), {}), []
    clients = [bytes([c]) * 5 for c in range(4)]
    for i in range(num_requests):
        book.pending[f"e{i}"] = _Pending(clients[i % 4], f"c{i}", 500)
    seconds = 0.0
    for _ in range(steps):
        deltas = [p.RequestDelta(f"e{i}", [1234]) for i in range(num_requests)]
        start = time.perf_counter()
        book.route(deltas, time.monotonic())
        book.flush(lambda identity, message: sent.append(p.encode(message)))
        seconds += time.perf_counter() - start
        sent.clear()
    return seconds / steps


if __name__ == "__main__":
    main()
