"""The model's files an engine's welcome carries, so that a client tokenizes (and prepares images) on its own CPU:
the tokenizer as ``save_pretrained`` writes it, and a vision-language model's config and image processor; and
their digest, which a client that has them names in its hello (client/tokenizer_cache.py keeps them by it)."""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

from nanostream.multimodal.processor import processor_files


def tokenizer_files(path: Path, images: Path | None = None) -> tuple[dict[str, bytes], str | None]:
    """The tokenizer as files a client can load on its own, and its chat template; ``images``: the directory of a
    vision-language model whose image processor and config go with them (the client prepares the images)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        files = {f.name: f.read_bytes() for f in Path(tmp).iterdir() if f.is_file()}
    files |= processor_files(images) if images is not None else {}
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
    return files, template


def files_digest(files: dict[str, bytes]) -> str:
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    return digest.hexdigest()[:32]
