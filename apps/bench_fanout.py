"""A client process's fan-out, without an engine: one message's deltas put into S streams' mailboxes, as
the connection's reader does, until every stream's ``async for`` has its chunk (real ``Stream``,
output processor, detokenizer and tokenizer; the connection is a stand-in that only keeps the mailboxes).

    python3 apps/bench_fanout.py --streams 32,64 --loops asyncio,uvloop [--model DIR] [--vocab N]

Per loop and stream count: after how long the median and the last stream had their chunk (p50 over
messages), and the last one's time divided by S: the cost of one stream's turn on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time

from stream_clients import loop_factory
from transformers import AutoTokenizer

from nanostream import SamplingParams
from nanostream import protocol as p
from nanostream.client.stream import Stream


class _Connection:
    """What a Stream asks of its connection, and nothing sent anywhere."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.mailboxes = {}

    async def submit(self, mailbox, request_id, prompt, params, timeout) -> None:
        self.mailboxes[request_id] = mailbox

    def abort(self, request_id: str) -> None:
        pass

    def forget(self, request_id: str) -> None:
        pass


async def fan_out(tokenizer, streams: int, messages: int, vocab: int | None = None) -> tuple[float, float]:
    """(median stream, last stream) seconds after the reader's put, p50 over ``messages``; output ids
    drawn from [0, ``vocab``) (default: the tokenizer's ids)."""
    conn, rng = _Connection(tokenizer), random.Random(0)
    high = vocab or len(tokenizer)
    params = SamplingParams(max_tokens=10**6, ignore_eos=True)
    prompt_high = min(len(tokenizer), 10_000)  # apps/bench.py's prompt ids
    all_streams = [Stream(conn, [rng.randrange(prompt_high) for _ in range(100)], params) for _ in range(streams)]
    arrived: list[float] = []

    async def consume(stream: Stream) -> None:
        async for _ in stream:
            arrived.append(time.perf_counter())

    tasks = [asyncio.create_task(consume(s)) for s in all_streams]
    while len(conn.mailboxes) < streams:
        await asyncio.sleep(0.001)
    spans = []
    for _ in range(messages):
        arrived.clear()
        start = time.perf_counter()
        for request_id, mailbox in conn.mailboxes.items():
            mailbox.put(p.RequestDelta(request_id, [rng.randrange(high)]), None, start)
        while len(arrived) < streams:
            await asyncio.sleep(0)
        spans.append((arrived[streams // 2] - start, arrived[-1] - start))
    for task in tasks:
        task.cancel()
    spans.sort(key=lambda s: s[1])
    return spans[len(spans) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="32,64", help="streams in the process, comma-separated")
    parser.add_argument("--loops", default="asyncio,uvloop", help="event loops, comma-separated")
    parser.add_argument("--messages", type=int, default=2000, help="messages per measurement")
    parser.add_argument("--model", help="a model directory for its tokenizer (default: the tiny random model)")
    parser.add_argument(
        "--vocab",
        type=int,
        help="output ids drawn from [0, VOCAB) (default: the tokenizer's size; a random model samples its config's "
        "vocab_size, 151,936 for apps/presets.py's qwen3-0.6b, of which the tiny tokenizer knows 512)",
    )
    args = parser.parse_args()
    model = args.model
    if model is None:
        from nanostream.testing import make_tiny_model

        model = tempfile.mkdtemp()
        make_tiny_model(model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    for loop in args.loops.split(","):
        for streams in (int(s) for s in args.streams.split(",")):
            with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
                median, last = runner.run(fan_out(tokenizer, streams, args.messages, args.vocab))
            print(f"{loop} {streams} streams: median stream +{1e6 * median:.0f} us, last +{1e6 * last:.0f} us, "
                  f"{1e6 * last / streams:.2f} us a stream's turn", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
