"""A reply's chunks as a sequence of blocks — reasoning, text, tool calls — each opened, grown and closed:
the shape both the Responses API (output items) and Anthropic's Messages API (content blocks) stream.
The chat route's parsers do the reading (the stream's reasoning parser, the server's tool-call parser),
so every dialect splits a reply the same way; a dialect only names what each step is called.

    turn = Turn(tool_parser)
    for chunk in chunks:
        for step in turn.feed(chunk):   # Step("open", block), Step("delta", block, text), Step("close", block)
            ...
    turn.blocks, turn.finish_reason, turn.usage   # what the whole reply adds up to
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Literal

from nanostream.frontends.openai_server.tool_parsers import CallArguments, CallStart, Content, ToolParser
from nanostream.outputs import StreamChunk
from nanostream.protocol import Usage

Kind = Literal["reasoning", "text", "call"]


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


@dataclass
class Block:
    kind: Kind
    index: int  # its place in the reply (output_index, a content block's index)
    text: str = ""  # reasoning or text, or a call's arguments (JSON text)
    call_id: str | None = None
    name: str | None = None  # a call's function
    done: bool = False


@dataclass
class Step:
    op: Literal["open", "delta", "close"]
    block: Block
    text: str = ""  # a delta's new text


class Turn:
    """One reply (one choice): chunks in, steps out; ``blocks`` holds the reply so far."""

    def __init__(self, tool_parser: type[ToolParser] | None) -> None:
        self.parser = tool_parser() if tool_parser is not None else None
        self.blocks: list[Block] = []
        self.finish_reason: str | None = None  # "stop", "length" or "tool_calls" (a stop after a call)
        self.usage: Usage | None = None
        self._open: Block | None = None
        self._calls: dict[int, Block] = {}  # by the parser's call index

    def feed(self, chunk: StreamChunk) -> list[Step]:
        steps: list[Step] = []
        final = chunk.finish_reason is not None
        if chunk.reasoning_content:
            self._grow("reasoning", chunk.reasoning_content, steps)
        events = self.parser.feed(chunk.text, final) if self.parser is not None else [Content(chunk.text)]
        for e in events:
            if isinstance(e, Content):
                if e.text:
                    self._grow("text", e.text, steps)
            elif isinstance(e, CallStart):
                block = self._start("call", steps)
                block.call_id, block.name = e.id, e.name
                self._calls[e.index] = block
            elif isinstance(e, CallArguments) and e.text:
                block = self._calls[e.index]
                block.text += e.text
                steps.append(Step("delta", block, e.text))
        if chunk.usage is not None:
            self.usage = chunk.usage
        if final:
            self._close(steps)
            reason = chunk.finish_reason
            self.finish_reason = "tool_calls" if self._calls and reason == "stop" else reason
        return steps

    @property
    def calls(self) -> list[Block]:
        return [b for b in self.blocks if b.kind == "call"]

    def _grow(self, kind: Kind, text: str, steps: list[Step]) -> None:
        block = self._open if self._open is not None and self._open.kind == kind else self._start(kind, steps)
        block.text += text
        steps.append(Step("delta", block, text))

    def _start(self, kind: Kind, steps: list[Step]) -> Block:
        self._close(steps)
        block = self._open = Block(kind, len(self.blocks))
        self.blocks.append(block)
        steps.append(Step("open", block))
        return block

    def _close(self, steps: list[Step]) -> None:
        if self._open is not None:
            self._open.done = True
            steps.append(Step("close", self._open))
            self._open = None
