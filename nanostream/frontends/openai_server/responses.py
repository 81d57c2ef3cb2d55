"""How a request's chunks become OpenAI's JSON: one choice per sample (``index``), text or a chat message
with ``reasoning_content`` and ``tool_calls``, logprobs, usage counting each prompt once.

Streamed, each chunk becomes one event for its choice; whole, each choice's chunks are merged and
parsed at once, with the same parsers, so the two add up to the same reply.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from nanostream.frontends.openai_server.logprobs import (
    TextOffsets,
    TokenText,
    chat_logprobs,
    completion_logprobs,
    echoed_prompt_logprobs,
    prompt_logprobs_json,
)
from nanostream.frontends.openai_server.tool_parsers import CallArguments, CallStart, Content, Event, ToolParser
from nanostream.outputs import StreamChunk
from nanostream.protocol import Usage


@dataclass
class ReplyOptions:
    chat: bool
    model: str
    request_id: str
    tokens: TokenText
    prompts: list[list[int]]  # token ids of each prompt
    n: int = 1  # samples per prompt: choice index = prompt * n + sample
    top_logprobs: int | None = None  # None: no logprobs asked for
    tool_parser: type[ToolParser] | None = None  # parse tool calls out of chat replies
    reasoning: bool = False  # chunks carry reasoning_content (a reasoning parser runs)
    # Each prompt's text, put before its choices' text: completions' echo; chat's (one prompt) is the final
    # message's content, streamed as its own event after the role's (as vLLM does).
    echo: list[str] | None = None
    prompt_logprobs: bool = False  # report the prompt logprobs the chunks carry
    role: str = "assistant"  # of a chat reply
    continuous_usage: bool = False  # every streamed event carries its choice's usage so far
    token_ids: bool = False  # vLLM's return_token_ids: the prompt's ids, and each choice's (or event's) ids


# The fields of OpenAI's response objects (the openai package's models) that this server never fills: sent
# as null, as OpenAI does, so that a client reading one finds it (tests/test_openai_api.py checks them all).
_COMPLETION_NULLS = {"system_fingerprint": None}
_CHAT_NULLS = {"system_fingerprint": None, "service_tier": None, "moderation": None}
_WHOLE_CHAT_NULLS = {**_CHAT_NULLS, "metadata": None}
_CHUNK_NULLS = {**_CHAT_NULLS, "obfuscation": None}
_MESSAGE_NULLS = {"refusal": None, "annotations": None, "audio": None, "function_call": None}
_DELTA_NULLS = {"role": None, "refusal": None, "audio": None, "function_call": None}
_PROMPT_DETAILS_NULLS = {"audio_tokens": None, "cache_write_tokens": None, "image_tokens": None, "text_tokens": None}


@dataclass
class _Choice:
    index: int
    parser: ToolParser | None
    offsets: TextOffsets = field(default_factory=TextOffsets)  # completions' logprobs
    started: bool = False  # its first event went out
    calls: int = 0  # tool calls started
    tokens: int = 0  # generated so far
    usage: Usage | None = None


def _usage_json(prompt: int, completion: int, cached: int | None) -> dict[str, Any]:
    """OpenAI's usage; ``cached`` None: not known yet (a streamed event's usage so far)."""
    details = None if cached is None else {"cached_tokens": cached, **_PROMPT_DETAILS_NULLS}
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": details,
        "completion_tokens_details": None,
    }


class Reply:
    def __init__(self, options: ReplyOptions) -> None:
        self.o = options
        self.created = int(time.time())
        self.choices: dict[int, _Choice] = {}
        self.prompt_lps: dict[int, list] = {}  # per prompt, from its first sample's first chunk
        # The objects' fields in order, choices and usage to fill in: an event copies its dict, cheaper than
        # building one (events are the hot path: a chat event, nulls and all, builds in less than before them).
        chat = options.chat
        self._chunk = self._head("chat.completion.chunk" if chat else "text_completion", _CHUNK_NULLS)
        self._whole = self._head("chat.completion" if chat else "text_completion", _WHOLE_CHAT_NULLS)

    def _head(self, kind: str, chat_nulls: dict[str, None]) -> dict[str, Any]:
        chat = self.o.chat
        out = {"id": ("chatcmpl-" if chat else "cmpl-") + self.o.request_id, "object": kind, "created": self.created}
        out.update(model=self.o.model, choices=[], usage=None)
        return {**out, **(chat_nulls if chat else _COMPLETION_NULLS)}

    def _choice(self, index: int) -> _Choice:
        if index not in self.choices:
            parser = self.o.tool_parser() if self.o.tool_parser is not None else None
            self.choices[index] = _Choice(index, parser)
        return self.choices[index]

    # ---- the response objects

    def whole(self, chunks: list[StreamChunk]) -> dict[str, Any]:
        """The non-streamed response from every chunk of the request."""
        by_index: dict[int, list[StreamChunk]] = {}
        for chunk in chunks:
            by_index.setdefault(chunk.index, []).append(chunk)
        key = "message" if self.o.chat else "text"
        choices = [self._render(self._merged(by_index[i]), key) for i in sorted(by_index)]
        return self._object(choices, usage=self._usage())

    def role_events(self) -> list[dict[str, Any]]:
        """Chat streams start each choice with its role, then (echo) each with the echoed message."""
        deltas = [{**_DELTA_NULLS, "role": self.o.role, "content": "", "tool_calls": None}]
        if self.o.echo is not None:
            deltas.append({**_DELTA_NULLS, "content": self.o.echo[0], "tool_calls": None})
        events = []
        for delta in deltas:
            for i in range(len(self.o.prompts) * self.o.n):
                choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}
                events.append(self._object([choice], streamed=True, usage=self._usage_so_far(i)))
        if self.o.token_ids:  # the conversation's ids on the first event, as vLLM sends them
            events[0]["prompt_token_ids"] = self.o.prompts[0]
        return events

    def event(self, chunk: StreamChunk) -> dict[str, Any] | None:
        """The streamed event of one chunk (None: it adds nothing a client would see)."""
        choice = self._render(chunk, "delta" if self.o.chat else "text")
        if choice is None:
            return None
        return self._object([choice], streamed=True, usage=self._usage_so_far(chunk.index))

    def usage_event(self) -> dict[str, Any]:
        return self._object([], streamed=True, usage=self._usage())

    def _object(self, choices: list[dict], *, streamed: bool = False, usage: dict | None = None) -> dict[str, Any]:
        out = (self._chunk if streamed else self._whole).copy()
        out["choices"], out["usage"] = choices, usage
        if self.o.token_ids and self.o.chat and not streamed:
            out["prompt_token_ids"] = self.o.prompts[0]
        if self.o.chat and not streamed:  # vLLM's: the conversation's prompt logprobs
            lps = self.prompt_lps.get(0) if self.o.prompt_logprobs else None
            out["prompt_logprobs"] = (
                None if lps is None else prompt_logprobs_json(self.o.tokens, self.o.prompts[0], lps)
            )
        return out

    def _usage(self) -> dict[str, Any]:
        prompt = sum(map(len, self.o.prompts))
        completion = sum(c.usage.completion_tokens for c in self.choices.values() if c.usage)
        cached = sum(c.usage.cached_tokens for c in self.choices.values() if c.usage and c.index % self.o.n == 0)
        return _usage_json(prompt, completion, cached)

    def _usage_so_far(self, index: int) -> dict[str, Any] | None:
        """vLLM's continuous usage: the choice's prompt and its tokens so far (None: not asked for)."""
        if not self.o.continuous_usage:
            return None
        c = self.choices.get(index)
        return _usage_json(len(self.o.prompts[index // self.o.n]), c.tokens if c else 0, None)

    # ---- one choice

    def _merged(self, chunks: list[StreamChunk]) -> StreamChunk:
        last = chunks[-1]
        merged = StreamChunk("".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids])
        merged.finish_reason, merged.usage, merged.index = last.finish_reason, last.usage, last.index
        merged.logprobs = [lp for c in chunks for lp in c.logprobs or []] if self.o.top_logprobs is not None else None
        merged.reasoning_content = "".join(c.reasoning_content for c in chunks)
        merged.prompt_logprobs = next((c.prompt_logprobs for c in chunks if c.prompt_logprobs is not None), None)
        return merged

    def _render(self, chunk: StreamChunk, key: str) -> dict[str, Any] | None:
        c = self._choice(chunk.index)
        prompt = chunk.index // self.o.n
        if chunk.prompt_logprobs is not None:
            self.prompt_lps.setdefault(prompt, chunk.prompt_logprobs)
        if chunk.usage is not None:
            c.usage = chunk.usage
        c.tokens += len(chunk.token_ids)
        first, c.started = not c.started, True
        final = chunk.finish_reason is not None
        finish = chunk.finish_reason
        if self.o.chat:
            body, visible = self._message(c, chunk, final, whole=key == "message")
            if key == "message" and self.o.echo is not None:
                body["content"] = self.o.echo[0] + (body["content"] or "")
            if c.calls and finish == "stop":
                finish = "tool_calls"
            choice: dict[str, Any] = {"index": chunk.index, key: body, "logprobs": None}
            if self.o.top_logprobs is not None and chunk.logprobs is not None:
                choice["logprobs"] = chat_logprobs(self.o.tokens, chunk.token_ids, chunk.logprobs, self.o.top_logprobs)
                visible = visible or bool(chunk.logprobs)
            visible = visible or (self.o.token_ids and bool(chunk.token_ids))  # (every id streamed, shown or not)
            if key == "delta" and not (visible or final):
                return None
        else:
            text, lps = chunk.text, None
            if first and self.o.echo is not None:
                text = self.o.echo[prompt] + text
            if self.o.top_logprobs is not None and chunk.logprobs is not None:
                echoed = None
                if first and self.o.echo is not None and prompt in self.prompt_lps:
                    ids = self.o.prompts[prompt]
                    echoed = echoed_prompt_logprobs(self.o.tokens, ids, self.prompt_lps[prompt], c.offsets)
                lps = completion_logprobs(self.o.tokens, chunk.token_ids, chunk.logprobs, c.offsets)
                if echoed is not None:
                    lps = {k: echoed[k] + lps[k] for k in lps}
            choice = {"index": chunk.index, "text": text, "logprobs": lps, "prompt_logprobs": None}
            if first and self.o.prompt_logprobs and prompt in self.prompt_lps:
                choice["prompt_logprobs"] = prompt_logprobs_json(
                    self.o.tokens, self.o.prompts[prompt], self.prompt_lps[prompt]
                )
        choice["finish_reason"] = finish
        if self.o.token_ids:  # a completion's prompt ids on its choice's first event (or whole), as vLLM's
            choice["token_ids"] = chunk.token_ids
            if not self.o.chat:
                choice["prompt_token_ids"] = self.o.prompts[prompt] if first else None
        return choice

    def _message(self, c: _Choice, chunk: StreamChunk, final: bool, whole: bool) -> tuple[dict[str, Any], bool]:
        """A chat choice's message (``whole``) or delta, and whether it shows anything."""
        out: dict[str, Any] = {"role": self.o.role, **_MESSAGE_NULLS} if whole else _DELTA_NULLS.copy()
        if c.parser is None:  # plain text (an event per chunk, as ever), or with reasoning beside it
            plain = not self.o.reasoning
            text, calls = chunk.text, None
            out["content"] = text if (text or whole or plain) else None
        else:
            plain = False
            events = c.parser.feed(chunk.text, final)
            text = "".join(e.text for e in events if isinstance(e, Content))
            calls = _call_deltas(events, whole)
            c.calls += sum(isinstance(e, CallStart) for e in events)
            out["content"] = text or None
        out["tool_calls"] = calls or None
        if self.o.reasoning and (chunk.reasoning_content or whole):
            out["reasoning_content"] = chunk.reasoning_content or None
        return out, plain or bool(text or calls or chunk.reasoning_content)


def _call_deltas(events: list[Event], whole: bool) -> list[dict[str, Any]]:
    """Tool-call deltas (one per call index, in order), or whole tool calls."""
    calls: dict[int, dict[str, Any]] = {}
    for e in events:
        if isinstance(e, CallStart):
            calls[e.index] = {"id": e.id, "type": "function", "function": {"name": e.name, "arguments": ""}}
            if not whole:
                calls[e.index]["index"] = e.index
        elif isinstance(e, CallArguments):
            # a later delta of the call: its type again (the openai client's stream helper takes a type of
            # null for the call's), no id or name
            new = {"index": e.index, "id": None, "type": "function", "function": {"name": None, "arguments": ""}}
            entry = calls.setdefault(e.index, new)
            entry["function"]["arguments"] += e.text
    return [calls[i] for i in sorted(calls)]
