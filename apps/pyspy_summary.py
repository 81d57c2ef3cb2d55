"""Summarise a ``py-spy record --format raw --threads`` profile: samples per thread, and each
thread's functions by own (leaf) samples and by samples anywhere on the stack.

    python apps/pyspy_summary.py engine.pyspy [--top 12]
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    threads: Counter[str] = Counter()
    own: dict[str, Counter[str]] = defaultdict(Counter)
    anywhere: dict[str, Counter[str]] = defaultdict(Counter)
    for line in Path(args.path).read_text().splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        thread = re.sub(r"\s*\(?0x[0-9a-f]+\)?", "", frames[0]).strip() or frames[0]
        n = int(count)
        threads[thread] += n
        calls = [re.sub(r" \(.*/", " (", f) for f in frames[1:]] or ["(idle)"]
        own[thread][calls[-1]] += n
        for f in set(calls):
            anywhere[thread][f] += n
    total = sum(threads.values())
    for thread, n in threads.most_common():
        print(f"== {thread}: {n} samples ({100 * n / max(total, 1):.0f}%) ==")
        for f, k in own[thread].most_common(args.top):
            print(f"  own {100 * k / n:5.1f}%  {f}")
        for f, k in anywhere[thread].most_common(args.top):
            print(f"  all {100 * k / n:5.1f}%  {f}")


if __name__ == "__main__":
    main()
