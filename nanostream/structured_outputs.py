"""What a request's output must match: a JSON schema, any JSON, a regular expression, a choice of
strings, an EBNF grammar or an xgrammar structural tag (``SamplingParams(structured_outputs=...)``).

Plain data, no xgrammar: clients build and send it, the engine compiles it (engine/grammar.py) and
masks every sampled token with it.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Annotated, Any

from msgspec import Meta

MAX_GRAMMAR_CHARS = 131_072
"""The most characters a schema, regex, grammar or structural tag may have (the choices together too)."""
MAX_CHOICES = 1024

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")

_Text = Annotated[str, Meta(max_length=MAX_GRAMMAR_CHARS)]
MAX_TAG_CHARS = 64
_Tag = Annotated[str, Meta(max_length=MAX_TAG_CHARS)]


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint; vLLM's names. Example::

        SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object"}), max_tokens=64)
        StructuredOutputsParams(choice=["yes", "no"])
        StructuredOutputsParams(regex=r"\\d{3}-\\d{4}")
        StructuredOutputsParams(grammar='root ::= "a" root | "b"')   # EBNF (xgrammar's GBNF dialect)

    ``json`` is a JSON schema (a dict, or its JSON text; kept as text). ``json_object``: any JSON
    object. ``structural_tag``: an xgrammar structural tag, as JSON text. JSON comes in one fixed
    layout unless ``any_whitespace``: no newlines or indentation, ``", "`` and ``": "`` between items
    (what ``json.dumps`` writes), so the model spends no tokens on whitespace the grammar would allow.

    ``reasoning`` = (start tag, end tag): the output may open with free reasoning between the two
    tags (then newlines), and the constraint holds for what follows, as vLLM does with a reasoning
    parser; ``reasoning_open``: the prompt opened the block, so the output starts inside it and must
    close it. A client with a reasoning parser sets both for its constrained requests, unless
    ``enable_in_reasoning`` asks for the constraint to cover the reasoning too.
    """

    json: _Text | None = None
    json_object: bool = False
    regex: _Text | None = None
    choice: Annotated[tuple[_Text, ...], Meta(max_length=MAX_CHOICES)] | None = None
    grammar: _Text | None = None
    structural_tag: _Text | None = None
    any_whitespace: bool = False
    reasoning: tuple[_Tag, _Tag] | None = None
    reasoning_open: bool = False
    enable_in_reasoning: bool = False

    def __post_init__(self) -> None:
        json = self.json
        if json is not None and not isinstance(json, str):
            try:
                json = _json.dumps(json, ensure_ascii=False)
            except (TypeError, ValueError) as exc:
                raise ValueError(
                    f"structured_outputs.json must be a JSON schema (a dict or JSON text): {exc}"
                ) from None
            object.__setattr__(self, "json", json)
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice):
                raise ValueError(f"structured_outputs.choice must be a list of strings, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice:
                raise ValueError("structured_outputs.choice must hold at least one string")
        if self.reasoning is not None:
            tags = self.reasoning
            if (
                isinstance(tags, str)
                or len(tags) != 2
                or not all(isinstance(t, str) and 0 < len(t) <= MAX_TAG_CHARS for t in tags)
            ):
                raise ValueError(
                    f"structured_outputs.reasoning must be a (start tag, end tag) pair of non-empty strings of at most "
                    f"{MAX_TAG_CHARS} characters, got {tags!r}"
                )
            object.__setattr__(self, "reasoning", tuple(tags))
        elif self.reasoning_open:
            raise ValueError("structured_outputs.reasoning_open needs reasoning: the block's (start tag, end tag)")
        for name in ("json_object", "any_whitespace", "reasoning_open", "enable_in_reasoning"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs takes exactly one of {', '.join(KINDS)}; got "
                + (", ".join(given) if given else "none")
            )
        if self.size > MAX_GRAMMAR_CHARS:
            raise ValueError(f"structured_outputs.{given[0]} has {self.size} characters, more than {MAX_GRAMMAR_CHARS}")
        if json is not None:
            try:
                schema = _json.loads(json)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"structured_outputs.json must be a JSON schema object, got {type(schema).__name__}")

    @property
    def kind(self) -> str:
        """Which constraint this is: one of ``KINDS``."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def size(self) -> int:
        value = getattr(self, self.kind)
        return sum(map(len, value)) if isinstance(value, tuple) else len(value) if isinstance(value, str) else 0

    def describe(self) -> dict[str, Any]:
        """The constraint as the request field it came from (for messages): ``{"regex": "..."}``."""
        return {self.kind: getattr(self, self.kind)}
