"""Logprobs in OpenAI's shapes: token texts and bytes from the tokenizer, chat and completions forms."""

from __future__ import annotations

import codecs
from typing import Any

import tokenizers

# ---- logprobs -------------------------------------------------------------------------------------


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character → byte: such tokens spell raw bytes in printable characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


class TokenText:
    """Each token's text and bytes as OpenAI reports them, cached by id.

    With byte-level BPE (GPT-2, Qwen, Llama 3) a token may hold part of a UTF-8 character: its bytes are
    exact and its text is then OpenAI's ``bytes:\\xe6\\x9d`` form (decoding it alone, as vLLM does,
    gives U+FFFD for many distinct tokens). Other tokens: the token decoded alone, and that text's UTF-8.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._alphabet = _byte_level_alphabet() if isinstance(decoder, tokenizers.decoders.ByteLevel) else None
        self._added = set(getattr(tokenizer, "added_tokens_decoder", {}))  # spelled as they are, not in bytes
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def text_of(self, token_id: int) -> str:
        return self._describe(token_id)[0]

    def bytes_of(self, token_id: int) -> list[int]:
        return self._describe(token_id)[1]

    def _describe(self, token_id: int) -> tuple[str, list[int]]:
        if token_id in self._cache:
            return self._cache[token_id]
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if self._alphabet is None or token_id in self._added or not all(c in self._alphabet for c in piece):
            text = self.tokenizer.decode([token_id])
            found = text, list(text.encode())
        else:
            raw = bytes(self._alphabet[c] for c in piece)
            try:
                found = raw.decode(), list(raw)
            except UnicodeDecodeError:
                found = "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)
        self._cache[token_id] = found
        return found


class TextOffsets:
    """Where each token starts in the text, in characters; a token inside a character gets its start."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._chars = 0

    def next(self, token_bytes: list[int]) -> int:
        start = self._chars
        self._chars += len(self._decoder.decode(bytes(token_bytes)))
        return start


def _ranked(logprobs: dict[int, float]) -> list[tuple[int, float]]:
    # JSON has no -inf: clamp as vLLM does
    return sorted(((t, max(lp, -9999.0)) for t, lp in logprobs.items()), key=lambda item: -item[1])


def chat_logprobs(tokens: TokenText, ids: list[int], logprobs: list[dict[int, float]], top: int) -> dict[str, Any]:
    """OpenAI's chat format: per token its text, logprob, bytes and the ``top`` most likely alternatives."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": tokens.text_of(token_id), "logprob": logprob, "bytes": tokens.bytes_of(token_id)}

    content = []
    for token_id, ranked in zip(ids, map(_ranked, logprobs)):
        own = dict(ranked)[token_id]
        content.append({**entry(token_id, own), "top_logprobs": [entry(t, lp) for t, lp in ranked[:top]]})
    return {"content": content, "refusal": None}


def completion_logprobs(
    tokens: TokenText, ids: list[int], logprobs: list[dict[int, float]], offsets: TextOffsets
) -> dict[str, Any]:
    """OpenAI's legacy format; ``top_logprobs`` holds the top N and the sampled token (N or N+1 entries)."""
    ranked = [_ranked(lps) for lps in logprobs]
    return {
        "tokens": [tokens.text_of(t) for t in ids],
        "token_logprobs": [dict(r)[t] for t, r in zip(ids, ranked)],
        "top_logprobs": [{tokens.text_of(t): lp for t, lp in r} for r in ranked],
        "text_offset": [offsets.next(tokens.bytes_of(t)) for t in ids],
    }


def echoed_prompt_logprobs(
    tokens: TokenText, ids: list[int], prompt_logprobs: list[dict[int, float] | None], offsets: TextOffsets
) -> dict[str, Any]:
    """The legacy format for an echoed prompt: its first token has no logprob, as OpenAI reports it."""
    ranked = [None if lps is None else _ranked(lps) for lps in prompt_logprobs]
    return {
        "tokens": [tokens.text_of(t) for t in ids],
        "token_logprobs": [None if r is None else dict(r)[t] for t, r in zip(ids, ranked)],
        "top_logprobs": [None if r is None else {tokens.text_of(t): lp for t, lp in r} for r in ranked],
        "text_offset": [offsets.next(tokens.bytes_of(t)) for t in ids],
    }


def prompt_logprobs_json(
    tokens: TokenText, ids: list[int], prompt_logprobs: list[dict[int, float] | None]
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, None for the first, else {token id: {logprob, decoded_token}}
    for the token and the top N."""
    return [
        None if lps is None else {str(t): {"logprob": lp, "decoded_token": tokens.text_of(t)} for t, lp in _ranked(lps)}
        for lps in prompt_logprobs
    ]
