"""Incremental detokenization with stop strings.

Text is released only when it is final: never half a UTF-8 character (a trailing U+FFFD means the
next token completes it), and never the first ``max(len(stop)) - 1`` characters that could still
turn out to begin a stop string. ``finish()`` releases what was held back. A character that the
prompt began and the output completes is the output's text, whole.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

# Prompt tokens decoded ahead of the output, so tokenizers that drop a leading space at the start of
# a decode (SentencePiece) still render the first output token as it appears in context.
_CONTEXT_TOKENS = 5


def _new_text(prefix: str, full: str) -> str:
    """The text of ``full`` (the decode of ``prefix``'s tokens and more) that ``prefix`` did not show."""
    if full.startswith(prefix):
        return full[len(prefix) :]
    # A prompt that ends inside a UTF-8 character decodes to a trailing U+FFFD, which the output tokens
    # turn into the completed character: it is the output's, so cut where the two decodes first differ.
    # (Moving the token offset back over the partial pieces instead would repeat what a token holds
    # before them: GPT-2-style byte-level BPEs have tokens like "ĠðŁ", a space and an emoji's first bytes.)
    n = 0
    while n < min(len(prefix), len(full)) and prefix[n] == full[n]:
        n += 1
    return full[n:]


def rust_tokenizer(tokenizer: Any) -> Any | None:
    """The Rust tokenizer behind a fast tokenizer whose decode transformers passes straight to it (no
    clean-up of spaces, no override), else None: the same text at a fraction of the cost, which a
    client that detokenizes hundreds of streams pays for every token of each."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    cls = type(tokenizer)
    if cls.decode is PreTrainedTokenizerBase.decode and cls._decode is PreTrainedTokenizerFast._decode:
        return backend
    return None


def decoder_of(tokenizer: Any) -> Callable[[list[int], bool], str]:
    """``tokenizer.decode`` as a function of (ids, skip_special_tokens), through Rust where it may."""
    return _decoder(tokenizer, rust_tokenizer(tokenizer))


def _decoder(tokenizer: Any, backend: Any | None) -> Callable[[list[int], bool], str]:
    if backend is not None:
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


def _dropped_by_decoder(backend: Any) -> tuple[int, frozenset[int]]:
    """What a Rust tokenizer's decode leaves out before its decoder runs: every id from the first
    returned on (the tokenizer knows none of them) and, when skipping special tokens, the second."""
    return _dropped_by_decoder_of_size(backend, backend.get_vocab_size(with_added_tokens=True))


@functools.lru_cache(maxsize=16)
def _dropped_by_decoder_of_size(backend: Any, size: int) -> tuple[int, frozenset[int]]:
    # (keyed by the size too: tokens added to the tokenizer later are known to it, and not dropped)
    known = backend.get_vocab(with_added_tokens=True).values()
    special = frozenset(i for i, token in backend.get_added_tokens_decoder().items() if token.special)
    return max(known, default=-1) + 1, special


def _decode_stream(backend: Any, context: list[int], context_text: str, skip: bool) -> Any | None:
    """The tokenizers library's own incremental decoder, primed with the prompt's tail: one Rust call
    per token. None where it cannot stand in for the Python path: no Rust tokenizer, a tokenizers
    too old to prime one, or a prompt that ends inside a character (the stream would emit the
    prompt's text with the character's end)."""
    if backend is None or context_text.endswith("\ufffd"):
        return None
    try:
        from tokenizers.decoders import DecodeStream

        return DecodeStream(ids=context, skip_special_tokens=skip)
    except (ImportError, TypeError):
        return None


def decode_output(
    tokenizer: Any, prompt_token_ids: list[int], output_token_ids: list[int], *, skip_special_tokens: bool = True
) -> str:
    """A finished output's text in one pass: all that an ``IncrementalDetokenizer`` without stop strings
    releases, at the cost of two decodes instead of two per token (the offline API's fast path)."""
    context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
    prefix = tokenizer.decode(context, skip_special_tokens=skip_special_tokens)
    return _new_text(prefix, tokenizer.decode(context + output_token_ids, skip_special_tokens=skip_special_tokens))


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        *,
        stop: tuple[str, ...] = (),
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self._rust = rust_tokenizer(tokenizer)
        self._decode_ids = _decoder(tokenizer, self._rust)
        self.stop = stop
        self.skip_special_tokens = skip_special_tokens
        self.min_tokens = min_tokens
        self.holdback = max(map(len, stop), default=1) - 1
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        # Ids the decode leaves out (unknown to the tokenizer, or special ones skipped) never join the
        # window: as long as nothing adds text, the window and each token's decode would grow with them
        # (a model whose vocabulary is larger than its tokenizer's samples such ids).
        self._unknown_from, self._skipped = (
            _dropped_by_decoder(self._rust) if self._rust is not None else (float("inf"), frozenset())
        )
        if not skip_special_tokens:
            self._skipped = frozenset()
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.num_output_tokens = 0
        # Final text not handed out yet: what a stop string may still begin in (the hold-back), and
        # what one add() appends. Only this much is kept: a long output costs no more per token.
        self.held = ""
        self.stopped_by: str | None = None  # the stop string that ended the text
        # Where it may, tokenizers' DecodeStream does what _advance does, keeping the same offsets, so
        # that the Python path can take over at any token (finish() always takes it).
        context_text = self._decode(self.ids) if self._rust is not None else ""
        self._stream = _decode_stream(self._rust, self.ids, context_text, skip_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, self.skip_special_tokens)

    def _advance(self, final: bool) -> None:
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        # Not ``len(full) > len(prefix)``: completing the prompt's last character keeps the length.
        if full != prefix and (final or not full.endswith("\ufffd")):
            self._append(_new_text(prefix, full))
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def _append(self, delta: str) -> None:
        start = max(0, len(self.held) - self.holdback)  # a stop string ends in the new text
        self.held += delta
        if self.stop and self.num_output_tokens >= self.min_tokens:
            hits = [i for i in (self.held.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                cut = min(hits)
                self.stopped_by = next(s for s in self.stop if self.held.find(s, start) == cut)
                self.held = self.held[:cut]

    def add(self, token_ids: list[int]) -> str:
        """Feed new output tokens; return the text that became final (may be empty)."""
        for token_id in token_ids:
            if self.stopped_by is not None:
                break
            self.num_output_tokens += 1
            if token_id >= self._unknown_from or token_id in self._skipped:
                continue  # it adds no text
            self.ids.append(token_id)
            if self._stream is None:
                self._advance(final=False)
                continue
            try:
                piece = self._stream.step(self._rust, token_id)
            except Exception:  # text the stream refuses (it does not begin with what came before)
                self._stream = None
                self._advance(final=False)
                continue
            if piece is not None:  # what _advance would have released for this token
                self._append(piece)
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._release(len(self.held) if self.stopped_by is not None else len(self.held) - self.holdback)

    def finish(self) -> str:
        """The request ended: flush everything still held back."""
        if self.stopped_by is None and self.read_offset < len(self.ids):
            self._advance(final=True)
        return self._release(len(self.held))

    def _release(self, end: int) -> str:
        """Hand out the first ``end`` characters held."""
        if end <= 0:
            return ""
        out, self.held = self.held[:end], self.held[end:]
        return out
