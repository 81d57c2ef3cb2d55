"""The demo model's corpus, tokenizer and training data: what apps/train_demo_model.py trains on.

Corpus (``corpus.txt``, plain text, documents separated by one blank line), built from Debian 12
(bookworm) packages fetched with ``apt-get download`` and unpacked with ``dpkg-deb -x``:

- ``bible-kjv-text`` 4.38 (text) read through ``bible-kjv`` 4.38's ``bible`` program: the King James
  Version of the Bible (1611), public domain ("The copyright for the King James Version text of the
  Bible is expired", /usr/share/doc/bible-kjv-text/copyright). One document per chapter: a heading
  line ("Genesis 1") and then one verse per line, without verse numbers.
- ``fortunes`` and ``fortunes-min`` 1:1.99.1-7.3: the BSD fortune cookie files, in Debian main under
  the BSD licence of fortune-mod (Copyright (c) 1991 The Regents of the University of California;
  redistribution with or without modification permitted, clause 3 deleted; /usr/share/doc/fortunes/
  copyright). The files are collections of short quotations; upstream's Notes say they were gathered
  from many sources as fair use. Files that are excerpts of one identifiable copyrighted work are
  left out (zippy: Bill Griffith's comic strip; pratchett: Terry Pratchett's novels; startrek: the
  TV scripts; tao: Geoffrey James's "The Tao of Programming"; songs-poems: mostly modern song
  lyrics), as are files that are not English prose (ascii-art, translate-me) and the stereotype
  jokes (ethnic, men-women). The kept files are ``FORTUNE_FILES``. One document per fortune, with
  backspace overstrikes removed, mis-decoded UTF-8 repaired, curly quotes made ASCII, whitespace
  collapsed, and exact duplicates (a fortune in several files) dropped.

The corpus built on 2026-11-29: 13,995 documents (1,189 KJV chapters, 12,806 fortunes), 6,186,035
characters (6.19 MB), sha256 f0d56e78f7d59cf74b342688a1657c2d1c3c04e5030db3efd378e41cd07b13d0;
with the default 6000-token vocabulary, 1.71M training and 28k validation tokens.

Rebuild the corpus (needs the four .deb files unpacked into one root)::

    cd .gpu/corpus/debs && apt-get download bible-kjv-text bible-kjv fortunes fortunes-min
    for d in *.deb; do dpkg-deb -x "$d" ../root; done
    python apps/train_demo_model.py --build-corpus .gpu/corpus/root --corpus .gpu/corpus/corpus.txt
"""

from __future__ import annotations

import random
import re
import subprocess
from pathlib import Path

from nanostream.testing import build_tokenizer

FORTUNE_FILES = (
    "art", "computers", "cookie", "debian", "definitions", "disclaimer", "drugs", "education", "food",
    "fortunes", "goedel", "humorists", "kids", "knghtbrd", "law", "linux", "linuxcookie", "literature",
    "love", "magic", "medicine", "miscellaneous", "news", "paradoxum", "people", "perl", "pets",
    "platitudes", "politics", "riddles", "science", "sports", "wisdom", "work",
)  # fmt: skip
KJV_BOOKS = (
    "Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy", "Joshua", "Judges", "Ruth", "1 Samuel",
    "2 Samuel", "1 Kings", "2 Kings", "1 Chronicles", "2 Chronicles", "Ezra", "Nehemiah", "Esther", "Job",
    "Psalms", "Proverbs", "Ecclesiastes", "Song of Solomon", "Isaiah", "Jeremiah", "Lamentations", "Ezekiel",
    "Daniel", "Hosea", "Joel", "Amos", "Obadiah", "Jonah", "Micah", "Nahum", "Habakkuk", "Zephaniah",
    "Haggai", "Zechariah", "Malachi", "Matthew", "Mark", "Luke", "John", "Acts", "Romans", "1 Corinthians",
    "2 Corinthians", "Galatians", "Ephesians", "Philippians", "Colossians", "1 Thessalonians",
    "2 Thessalonians", "1 Timothy", "2 Timothy", "Titus", "Philemon", "Hebrews", "James", "1 Peter",
    "2 Peter", "1 John", "2 John", "3 John", "Jude", "Revelation",
)  # fmt: skip
_HEADING = re.compile(rf"^({'|'.join(re.escape(b) for b in KJV_BOOKS)}) (\d+)$")
FORTUNE_PROMPTS = ("Tell me a fortune.", "Tell me something.", "Say something wise.", "Give me a quote.")


# ---- corpus ---------------------------------------------------------------------------------------


def kjv_documents(dump: str) -> list[str]:
    """One document per chapter from ``bible -f`` output (lines like ``1Sm3:4 And the LORD called``)."""
    chapters: dict[tuple[str, int], list[str]] = {}
    for line in dump.splitlines():
        m = re.match(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$", line)
        if m is None:
            raise ValueError(f"unexpected line in the KJV dump: {line[:80]!r}")
        chapters.setdefault((m[1], int(m[2])), []).append(" ".join(m[4].split()))
    abbrevs = list(dict.fromkeys(book for book, _ in chapters))
    if len(abbrevs) != len(KJV_BOOKS):
        raise ValueError(f"the KJV dump has {len(abbrevs)} books, expected {len(KJV_BOOKS)}")
    names = dict(zip(abbrevs, KJV_BOOKS))
    return [f"{names[book]} {ch}\n" + "\n".join(verses) for (book, ch), verses in chapters.items()]


_ASCII_PUNCT = str.maketrans(
    {"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "\u2014": "--", "\u2013": "-", "\u2026": "..."}
)


def _fix_mojibake(line: str) -> str:
    """Undo UTF-8 read as Latin-1 (once or twice: "donÃ¢ÂÂt" -> "don’t"); other text stays."""
    for _ in range(2):
        try:
            line = line.encode("latin-1").decode("utf-8")
        except (UnicodeEncodeError, UnicodeDecodeError):
            break
    return line


def fortune_entries(text: str) -> list[str]:
    """The fortunes of one strfile source: ``%`` lines separate them; overstrikes and layout go."""
    text = re.sub(r"_+\x08+", "", text)  # "__\b\bON" and "_\bO_\bN" underline ON; they print as ON
    text = re.sub(r"[^\n]?\x08", "", text)  # "X\bX" (bold) prints as X
    entries = []
    for block in re.split(r"^%[ \t]*$", text, flags=re.M):
        lines = [" ".join(_fix_mojibake(line).translate(_ASCII_PUNCT).split()) for line in block.splitlines()]
        entry = "\n".join(line for line in lines if line)
        if entry:
            entries.append(entry)
    return entries


def build_corpus(root: Path) -> str:
    """The corpus text from the unpacked packages under ``root`` (see the module docstring)."""
    bible = root / "usr/bin/bible"
    dump = subprocess.run(
        [str(bible), "-f", "-p", str(root / "usr/lib"), "gen1:1-rev22:21"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    docs = kjv_documents(dump)
    for name in FORTUNE_FILES:
        raw = (root / "usr/share/games/fortunes" / name).read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = raw.decode("latin-1")
        docs += fortune_entries(text)
    docs = list(dict.fromkeys(docs))  # some fortunes are in several files; a copy would leak into validation
    return "\n\n".join(docs) + "\n"


def read_documents(path: Path) -> list[str]:
    docs = [d.strip("\n") for d in path.read_text(encoding="utf-8").split("\n\n")]
    return [d for d in docs if d.strip()]


# ---- tokenizer and data ---------------------------------------------------------------------------


def train_tokenizer(docs: list[str], vocab_size: int):
    """nanostream's byte-level BPE (special tokens, chat template) trained on the corpus, NFC-normalised."""
    return build_tokenizer(vocab_size, docs, nfc=True)


def chat_prompt(doc: str, rng: random.Random) -> str:
    m = _HEADING.match(doc.split("\n", 1)[0])
    if m:
        return f"Read me {m[1]} chapter {m[2]}."
    return rng.choice(FORTUNE_PROMPTS)


def encode_documents(tokenizer, docs: list[str], rng: random.Random, chat_fraction: float) -> list[list[int]]:
    """Token ids per document, each ending with ``<|endoftext|>``; some wrapped as a chat turn."""
    texts = []
    for doc in docs:
        if rng.random() < chat_fraction:
            messages = [{"role": "user", "content": chat_prompt(doc, rng)}, {"role": "assistant", "content": doc}]
            doc = tokenizer.apply_chat_template(messages, tokenize=False)
        texts.append(doc)
    eos = tokenizer.eos_token_id
    return [[*ids, eos] for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def split_documents(n: int, val_fraction: float, rng: random.Random) -> tuple[list[int], list[int]]:
    order = list(range(n))
    rng.shuffle(order)
    n_val = max(1, round(n * val_fraction))
    return sorted(order[n_val:]), sorted(order[:n_val])
