"""The one check of a prompt's token ids: the engine's admission runs it, and so do ``LLM`` and ``AsyncClient``
before a detokenizer or the wire sees the prompt (an id out of range would fail there with no useful message)."""

from __future__ import annotations

from nanostream.errors import InvalidRequestError


def check_token_ids(prompt: list, vocab_size: int) -> None:
    """Raise ``InvalidRequestError`` naming the first id of ``prompt`` that is no plain int in
    [0, ``vocab_size``)."""
    # Plain ints in range, checked at C speed (the engine checks each prompt once, in its busy loop);
    # only a prompt that fails it is looked at id by id.
    if prompt and set(map(type, prompt)) == {int} and min(prompt) >= 0 and max(prompt) < vocab_size:
        return
    bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"prompt token id {bad[0]!r} is outside the model's vocabulary [0, {vocab_size}); "
            "tokenize the prompt with this model's tokenizer"
        )
