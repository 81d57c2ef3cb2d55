"""Fixtures for tests and demos: a tiny random-weight model built with transformers' own classes."""

from nanostream.testing.tiny_model import build_tokenizer, make_tiny_model

__all__ = ["build_tokenizer", "make_tiny_model"]
