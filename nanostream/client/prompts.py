"""What a prompt may be, for ``LLM`` and ``AsyncClient`` alike: a string (tokenized here) or a list of
token ids; several prompts are a list of those. Anything else is an ``InvalidRequestError``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from nanostream.errors import InvalidRequestError

Prompt = str | list[int]


def as_prompts(prompt: Any) -> list[Any]:
    """``prompt`` as a list of prompts: one prompt (a string, a list of token ids) or several (an
    iterable of them; an empty list has none), as given: ``prompt_ids`` checks each."""
    if isinstance(prompt, (str, Mapping)) or not isinstance(prompt, Iterable):
        return [prompt]
    if isinstance(prompt, Sequence) and prompt and isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def prompt_ids(tokenizer: Any, prompt: Any) -> list[int]:
    """The token ids of one prompt: a string tokenized, a sequence of ids as given."""
    if isinstance(prompt, str):
        return tokenizer(prompt).input_ids
    if isinstance(prompt, Sequence):
        return list(prompt)
    raise InvalidRequestError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
