"""Fixtures for tests and demos: a tiny random-weight model built with transformers' own classes (tiny_model.py)
and its tokenizer (tokenizer.py). Imports nothing of nanostream's outside this folder; transformers and
tokenizers when called."""

from nanostream.testing.tiny_model import (
    LLAMA3_ROPE_SCALING,
    TINY_ARCHITECTURES,
    TINY_PRESETS,
    make_tiny_model,
    tiny_config,
)
from nanostream.testing.tokenizer import build_tokenizer

__all__ = [
    "LLAMA3_ROPE_SCALING",
    "TINY_ARCHITECTURES",
    "TINY_PRESETS",
    "build_tokenizer",
    "make_tiny_model",
    "tiny_config",
]
