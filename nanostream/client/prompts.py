"""What a prompt may be, for ``LLM`` and ``AsyncClient`` alike: a string (tokenized here) or a list of
token ids (numpy's integers too), or vLLM's dict of one of them and its images (``prompt_and_images``); several
prompts are a list of those. Anything else is an ``InvalidRequestError``, raised here, before a detokenizer or the
wire sees the prompt."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from numbers import Integral
from typing import Any

from nanostream.errors import InvalidRequestError
from nanostream.token_ids import check_token_ids

Prompt = str | list[int]
_NOT_IDS = (str, bytes, bytearray, memoryview, Mapping)  # sequences that are no list of token ids


def as_prompts(prompt: Any) -> list[Any]:
    """``prompt`` as a list of prompts: one prompt (a string, a list of token ids) or several (an
    iterable of them; an empty list has none), as given: ``prompt_ids`` checks each."""
    if isinstance(prompt, _NOT_IDS) or not isinstance(prompt, Iterable):
        return [prompt]
    if isinstance(prompt, Sequence) and prompt and isinstance(prompt[0], Integral):
        return [prompt]
    return list(prompt)


def prompt_ids(tokenizer: Any, prompt: Any, vocab_size: int) -> list[int]:
    """The token ids of one prompt: a string tokenized; a sequence of ids copied (numpy's integers as ints)
    and checked against the model's ``vocab_size`` as the engine checks them. An empty prompt passes (the
    engine says why it cannot run)."""
    if isinstance(prompt, str):
        return tokenizer(prompt).input_ids
    if not isinstance(prompt, Sequence) or isinstance(prompt, _NOT_IDS):
        raise InvalidRequestError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    ids = list(prompt)
    if set(map(type, ids)) != {int}:  # numpy's integers as ints; what is no integer the check names
        ids = [int(t) if isinstance(t, Integral) and not isinstance(t, bool) else t for t in ids]
    if ids:
        check_token_ids(ids, vocab_size)
    return ids


_PROMPT_KEYS = ("prompt", "prompt_token_ids")


def prompt_and_images(prompt: Any) -> tuple[Any, list]:
    """(the prompt, its images' sources) of one prompt: a string or token ids as they are (no images); vLLM's dict,
    ``{"prompt": text or ids (or "prompt_token_ids": ids), "multi_modal_data": {"image": one or a list}}``, split.
    A dict of other keys is an ``InvalidRequestError`` (as ``prompt_ids`` words its own)."""
    if not isinstance(prompt, Mapping):
        return prompt, []
    data = prompt.get("multi_modal_data") or {}
    keys = set(prompt)
    if (
        keys - {*_PROMPT_KEYS, "multi_modal_data"}
        or len(keys & set(_PROMPT_KEYS)) != 1
        or not isinstance(data, Mapping)
        or set(data) - {"image"}
    ):
        raise InvalidRequestError(
            'a prompt must be a string or a list of token ids, or a dict of "prompt" (or "prompt_token_ids") and '
            f'"multi_modal_data": {{"image": ...}}; got a dict of {sorted(map(str, keys))}'
        )
    images = data.get("image", [])
    return prompt[(keys & set(_PROMPT_KEYS)).pop()], list(images) if isinstance(images, (list, tuple)) else [images]
