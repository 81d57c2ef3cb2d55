"""A request's constraint (``StructuredOutputsParams``) as the EBNF text that xgrammar compiles: JSON
schemas compact unless asked otherwise, choices as literals, structural tags, a block of reasoning
before the constraint. Parsed here, so a bad spec is an ``InvalidRequestError`` saying what is wrong,
on the client (``LLM`` checks before it adds) and in the engine's compiler alike.
"""

from __future__ import annotations

import json
import re
from typing import Any

from nanostream.errors import InvalidRequestError
from nanostream.structured_outputs import StructuredOutputsParams

_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[11:18:34] /project/cpp/x.cc:82: " on its messages
_WHAT = {
    "json": "JSON schema",
    "json_object": "JSON schema",
    "regex": "regular expression",
    "choice": "choice",
    "grammar": "EBNF grammar",
    "structural_tag": "structural tag",
}


def _ebnf_literal(text: str) -> str:
    """``text`` as an EBNF string literal that matches exactly it."""
    escaped = "".join(
        "\\" + ch if ch in '"\\' else f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch for ch in text
    )
    return f'"{escaped}"'


# xgrammar 0.2.9 lets a length-limited JSON string hold raw control characters, which JSON forbids (and
# json.loads refuses): such strings' character class is narrowed to what JSON allows.
_LAX_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\"\\\0-\x1f]"


# xgrammar 0.2.9 prints U+0080-U+00FF as "\xNN" and reads "\x" with every hex digit after it, so the
# printed "n\xe9e" of "née" reads back as "n\u0e9e"; compile_grammar() of a Grammar object reads its
# printed form, and a JSON enum of "née" refused "née". Grammars go to the compiler as text instead, with
# those escapes written "\u00NN" (fixed width). An escaped backslash is matched first, so "\\x41" stays.
_HEX_ESCAPE = re.compile(r"\\(\\|x([0-9a-fA-F]{2}))")


def _ebnf(grammar: Any) -> str:
    """``grammar``'s EBNF text, which reads back as the same grammar."""
    return _HEX_ESCAPE.sub(lambda m: m.group(0) if m.group(2) is None else "\\u00" + m.group(2), str(grammar))


def _json_grammar(schema: str | dict, any_whitespace: bool) -> str:
    import xgrammar as xgr

    text = schema if isinstance(schema, str) else json.dumps(schema, ensure_ascii=False)
    return _ebnf(xgr.Grammar.from_json_schema(text, any_whitespace=any_whitespace)).replace(
        _LAX_STRING_CHAR, _JSON_STRING_CHAR
    )


def _compact_tag(node: Any) -> Any:
    """A structural tag whose JSON-schema parts are compact JSON grammars (xgrammar's own conversion
    there allows any whitespace)."""
    if isinstance(node, list):
        return [_compact_tag(x) for x in node]
    if not isinstance(node, dict):
        return node
    if (
        node.get("type") == "json_schema"
        and set(node) <= {"type", "json_schema", "style"}
        and node.get("style", "json") == "json"
    ):
        return {"type": "grammar", "grammar": _json_grammar(node["json_schema"], any_whitespace=False)}
    return {k: _compact_tag(v) for k, v in node.items()}


def parse(spec: StructuredOutputsParams) -> str:
    """The EBNF text of ``spec``'s grammar (parsed, so it is valid); ``InvalidRequestError`` (saying what
    is wrong) if it has none."""
    import xgrammar as xgr

    kind = spec.kind
    try:
        if kind in ("json", "json_object"):
            text = _json_grammar(spec.json if kind == "json" else '{"type": "object"}', spec.any_whitespace)
        elif kind == "regex":
            text = _ebnf(xgr.Grammar.from_regex(spec.regex))
        elif kind == "choice":
            text = "root ::= " + " | ".join(map(_ebnf_literal, spec.choice))
        elif kind == "grammar":
            text = spec.grammar
        else:
            tag = json.loads(spec.structural_tag)
            text = _ebnf(xgr.Grammar.from_structural_tag(json.dumps(tag if spec.any_whitespace else _compact_tag(tag))))
        xgr.Grammar.from_ebnf(text)
        if spec.reasoning is not None:
            text = _after_reasoning(text, spec)
        return text
    except Exception as exc:  # xgrammar raises RuntimeError, ValueError, its own JSON and tag errors
        why = _XGRAMMAR_PREFIX.sub("", str(exc).strip()) or type(exc).__name__
        raise InvalidRequestError(f"structured_outputs.{kind} is not a valid {_WHAT[kind]}: {why}") from None


def _after_reasoning(text: str, spec: StructuredOutputsParams) -> str:
    """The grammar ``text`` after a block of free reasoning between ``spec.reasoning``'s tags (and any
    newlines): optional, or begun already when the prompt opened it (``reasoning_open``)."""
    import xgrammar as xgr

    start, end = spec.reasoning
    block: dict[str, Any] = {
        "type": "tag",
        "begin": "" if spec.reasoning_open else start,
        "content": {"type": "any_text"},
        "end": end,
    }
    if not spec.reasoning_open:
        block = {"type": "optional", "content": block}
    elements = [block, {"type": "regex", "pattern": "\\n*"}, {"type": "grammar", "grammar": text}]
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": elements}}
    return _ebnf(xgr.Grammar.from_structural_tag(json.dumps(tag)))
