"""Reasoning parsers: a reasoning model's output split into its reasoning and its answer, as text arrives.

    parser = get_reasoning_parser("qwen3")(prompt_text)
    parser.feed("<think>\\nThe user gre")   -> ("\\nThe user gre", "")   (reasoning, content)
    parser.feed("ets me.</think>\\n\\nHi!") -> ("ets me.", "Hi!")
    parser.finish()                         -> ("", "")                  whatever was held back

A parser holds back only text that could still turn out to be a tag, so the pieces come out as
soon as they are known and their concatenation is what the whole text splits into. Parsers are
registered by name (``REASONING_PARSERS``); ``AsyncClient.chat(..., reasoning_parser="qwen3")``,
``LLM.chat`` and ``nanostream frontend openai --reasoning-parser qwen3`` choose one.
"""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

from nanostream.sampling_params import SamplingParams


class ReasoningParser:
    """Splits ``<think>…</think>`` reasoning from the answer; subclasses name the tags.

    The output is reasoning from the start when the prompt itself opened the block (a template that
    ends the generation prompt with the start tag); else it is reasoning only if it begins with the
    start tag. Everything after the end tag is content, its leading newlines dropped.
    """

    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"

    def __init__(self, prompt_text: str = "") -> None:
        opened = prompt_text.rfind(self.start_tag)
        in_prompt = opened >= 0 and self.end_tag not in prompt_text[opened:]
        self.closed_in_prompt = opened >= 0 and not in_prompt  # e.g. Qwen3's enable_thinking=False: no reasoning
        self.state = "reasoning" if in_prompt else "start"  # start -> reasoning -> after -> content
        self.pending = ""  # text not yet given out: maybe the start of a tag

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """``params`` with its structured output (if any) holding after the reasoning block, as the engine
        needs it (``StructuredOutputsParams.reasoning``); unchanged when the constraint is to cover the
        reasoning too (``enable_in_reasoning``), already names the block, or the prompt closed the block
        (there is no reasoning to come)."""
        so = params.structured_outputs
        if so is None or so.enable_in_reasoning or so.reasoning is not None or self.closed_in_prompt:
            return params
        tags, inside = (self.start_tag, self.end_tag), self.state == "reasoning"
        return replace(params, structured_outputs=replace(so, reasoning=tags, reasoning_open=inside))

    def feed(self, text: str) -> tuple[str, str]:
        """The (reasoning, content) that ``text`` (the next piece of the output) makes final."""
        self.pending += text
        reasoning, content = [], []
        while self.pending:
            if self.state == "start":
                if self.pending.startswith(self.start_tag):
                    self.pending, self.state = self.pending[len(self.start_tag) :], "reasoning"
                elif self.start_tag.startswith(self.pending):
                    break  # may still become the start tag
                else:
                    self.state = "content"
            elif self.state == "reasoning":
                end = self.pending.find(self.end_tag)
                if end >= 0:
                    reasoning.append(self.pending[:end])
                    self.pending, self.state = self.pending[end + len(self.end_tag) :], "after"
                    continue
                keep = _partial_suffix(self.pending, self.end_tag)
                reasoning.append(self.pending[: len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep :]
                break
            elif self.state == "after":
                self.pending = self.pending.lstrip("\n")
                if self.pending:
                    self.state = "content"
            else:
                content.append(self.pending)
                self.pending = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The output ended: what was held back (an unfinished tag is text of its part)."""
        rest, self.pending = self.pending, ""
        if self.state == "reasoning":
            return rest, ""
        return "", "" if self.state == "after" else rest


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (what may still grow into it)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 (and QwQ, DeepSeek-R1-style) ``<think>…</think>``."""


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {"qwen3": Qwen3ReasoningParser}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser registered as ``name``; ``ValueError`` naming the registered ones otherwise."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"reasoning_parser must be one of {', '.join(sorted(REASONING_PARSERS))}, got {name!r}"
        ) from None
