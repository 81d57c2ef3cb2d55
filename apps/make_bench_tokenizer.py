"""A byte-level BPE tokenizer of a real model's size (151,643 tokens, Qwen's count of regular tokens),
trained on the Python sources of this interpreter, for benchmarks that need real-size vocabularies
without downloading one: grammar masks cost per token of the vocabulary (apps/bench_structured.py).

    python apps/make_bench_tokenizer.py .gpu/tok        # ~30 s; then TOKENIZER=.gpu/tok gpu_suite.sh structured

Its tokens are code and prose pieces (whitespace runs, quotes and escapes among them), as in a real
vocabulary; the special tokens are the test models' (nanostream.testing), so their ids match.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

from nanostream.testing.tokenizer import build_tokenizer


def sources(limit: int) -> Iterator[str]:
    """The text of the stdlib's and site-packages' .py files, up to ``limit`` characters, in a fixed order."""
    roots = {Path(sysconfig.get_paths()[k]) for k in ("stdlib", "purelib", "platlib")}
    seen = 0
    for path in sorted(p for root in sorted(roots) for p in root.rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        yield text
        seen += len(text)
        if seen >= limit:
            return


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the directory to write tokenizer.json and its config into")
    parser.add_argument("--vocab-size", type=int, default=151_643)
    parser.add_argument("--chars", type=int, default=120_000_000, help="characters of source to train on")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    tokenizer = build_tokenizer(vocab_size=args.vocab_size, texts=sources(args.chars))
    tokenizer.save_pretrained(args.out)
    print(f"{len(tokenizer)} tokens in {time.perf_counter() - start:.1f} s -> {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
