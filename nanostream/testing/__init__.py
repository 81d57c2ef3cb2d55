"""Fixtures for tests and demos: a tiny random-weight model built with transformers' own classes."""

from nanostream.testing.tiny_model import (
    LLAMA3_ROPE_SCALING,
    TINY_ARCHITECTURES,
    TINY_PRESETS,
    build_tokenizer,
    make_tiny_model,
)

__all__ = ["LLAMA3_ROPE_SCALING", "TINY_ARCHITECTURES", "TINY_PRESETS", "build_tokenizer", "make_tiny_model"]
