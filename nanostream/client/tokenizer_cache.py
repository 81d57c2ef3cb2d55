"""The engine's tokenizer on the client's side: loaded from the files its welcome carries, kept in a
cache directory named by their digest (so a client that has them says so in its hello, and the
engine leaves them out)."""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

from nanostream.errors import ProtocolError

_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "nanostream" / "tokenizers"


_IMPORT_LOCK = threading.Lock()


def load_tokenizer(digest: str, files: dict[str, bytes]) -> Any:
    """Load the engine's tokenizer from its files, kept in a cache directory named by their digest."""
    with _IMPORT_LOCK:  # transformers' lazy first import is not thread-safe (clients in several threads)
        from transformers import AutoTokenizer

    if not files or not all(c in "0123456789abcdef" for c in digest):
        raise ProtocolError("the engine's welcome names no usable tokenizer")
    path = _CACHE / digest
    if not path.is_dir():
        _CACHE.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=_CACHE))
        for name, data in files.items():
            (tmp / Path(name).name).write_bytes(data)
        with contextlib.suppress(OSError):  # another process got there first
            tmp.rename(path)
    return AutoTokenizer.from_pretrained(path if path.is_dir() else tmp)


def load_image_preparer(digest: str) -> tuple[Any, str]:
    """The engine's image preparer, from the files its welcome carried (a vision-language model's processor and
    config beside the tokenizer's), and what a request with images is told where there is none."""
    from nanostream.multimodal.processor import has_image_processor
    from nanostream.multimodal.request import NO_IMAGES, load_preparer

    path = _CACHE / digest
    if not has_image_processor(path):
        return None, NO_IMAGES
    return load_preparer(path)
