"""Structured outputs in the engine, with xgrammar: grammars compiled off the busy loop, one matcher
per request, the masks of a step's constrained rows.

    add_request ──▶ GrammarCompiler.submit(spec) ──▶ a worker thread: parse (a bad spec fails the future
                    with InvalidRequestError), compile against the model's vocabulary; cached by spec
    the request waits (not in the scheduler) until its future is done ──▶ RequestGrammar
    each step ──▶ fill_token_bitmask(): one row per constrained sample, after the grammar took the
                  previous token ──▶ the sampler masks those rows' logits (sampler.apply_token_bitmask)
    each token ──▶ RequestGrammar.accept(token); ``terminated`` once it took a stop token

xgrammar is imported on the first constrained request, so engines that never see one never load it.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import threading
import weakref
from collections import OrderedDict
from concurrent import futures
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from nanostream.engine.sequence import Sequence
from nanostream.errors import InvalidRequestError
from nanostream.structured_outputs import StructuredOutputsParams

log = logging.getLogger(__name__)

CACHE_SIZE = 128
"""Compiled grammars kept (least recently used dropped first): repeated schemas compile once."""

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


class GrammarCompiler:
    """Compiles specs for one model's vocabulary in a worker thread; a spec compiles once while cached.

    The tokenizer and xgrammar's vocabulary tables are built on the worker, on the first submit.
    ``vocab_size`` is the model's (its logits' width), which may exceed the tokenizer's.
    """

    def __init__(self, tokenizer_path: str | Path, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._cache: OrderedDict[StructuredOutputsParams, Future] = OrderedDict()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._compiler: Any = None  # xgrammar's GrammarCompiler, built by the worker

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """A future of the compiled grammar (done at once when cached); it fails with InvalidRequestError."""
        future = self._cache.get(spec)
        if future is not None:
            self._cache.move_to_end(spec)
            return future
        if self._worker is None:
            # One worker (xgrammar spreads a compilation over threads of its own), a daemon: a compilation
            # still running never holds up the process's exit.
            self._worker = threading.Thread(
                target=_work, args=(self._jobs, weakref.ref(self)), name="nanostream-grammar", daemon=True
            )
            self._worker.start()
        future: Future = Future()
        self._jobs.put((future, spec))
        self._cache[spec] = future
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return future

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        return self._xgrammar_compiler().compile_grammar(parse(spec))

    def _xgrammar_compiler(self) -> Any:  # on the worker only
        if self._compiler is None:
            import xgrammar as xgr
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer,
                vocab_size=max(self.vocab_size, len(tokenizer)),
                stop_token_ids=sorted(self.eos_token_ids) or None,
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=min(8, os.cpu_count() or 1))
            log.info("structured outputs: xgrammar ready for %s (vocabulary %d)", self.tokenizer_path, info.vocab_size)
        return self._compiler

    def __del__(self) -> None:
        self._jobs.put(None)  # the worker ends


def _work(jobs: queue.SimpleQueue, owner: weakref.ref) -> None:
    """The worker: compile each job's spec into its future, until the compiler is gone."""
    while (job := jobs.get()) is not None:
        future, spec = job
        compiler = owner()
        if compiler is None:
            return
        try:
            future.set_result(compiler._compile(spec))
        except BaseException as exc:  # the request that waits on it gets the error, the worker goes on
            future.set_exception(exc)
        del compiler


class GrammarWaitlist:
    """Constrained requests whose grammar is still compiling, in arrival order (the scheduler never
    sees them until it is ready). ``stop``: a request's stop tokens, else the model's EOS, end its grammar."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._waiting: dict[str, tuple[Sequence, Future]] = {}
        self.num_prompt_tokens = 0  # of the requests waiting here

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiting

    def add(self, seq: Sequence) -> bool:
        """True if the grammar is ready now (a cached one): ``seq.grammar`` is set. Raises the
        InvalidRequestError of a spec that failed before; otherwise ``seq`` waits here."""
        future = self.compiler.submit(seq.params.structured_outputs)
        if future.done():
            self._attach(seq, future.result())  # raises what the compilation raised
            return True
        self._waiting[seq.request_id] = (seq, future)
        self.num_prompt_tokens += seq.num_prompt_tokens
        return False

    def pop(self, request_id: str) -> Sequence | None:
        entry = self._waiting.pop(request_id, None)
        if entry is None:
            return None
        self.num_prompt_tokens -= entry[0].num_prompt_tokens
        return entry[0]

    def take_ready(self, wait: float = 0.0) -> list[tuple[Sequence, Exception | None]]:
        """The requests whose compilation ended (waiting up to ``wait`` seconds for one), each with
        ``seq.grammar`` set, or with the exception it failed with."""
        if wait > 0:
            futures.wait([f for _, f in self._waiting.values()], wait, futures.FIRST_COMPLETED)
        done = []
        for rid, (seq, future) in list(self._waiting.items()):
            if future.done():
                del self._waiting[rid]
                self.num_prompt_tokens -= seq.num_prompt_tokens
                try:
                    self._attach(seq, future.result())
                except Exception as exc:
                    done.append((seq, exc))
                else:
                    done.append((seq, None))
        return done

    def _attach(self, seq: Sequence, compiled: Any) -> None:
        seq.grammar = RequestGrammar(compiled, seq.stop_token_ids or self.compiler.eos_token_ids)


class RequestGrammar:
    """One request's matcher. ``stop_token_ids``: what ends the output once the grammar is complete (the
    request's stop tokens, else the model's EOS); taking one terminates the grammar."""

    def __init__(self, compiled: Any, stop_token_ids: frozenset[int]) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(stop_token_ids) or None)
        self.vocab_size = compiled.tokenizer_info.vocab_size  # the masks' width, >= the model's

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it (the matcher is unchanged)."""
        return self.matcher.accept_token(token_id)

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


MASK_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))
"""Threads that fill a step's masks: a row costs ~80 us at a 152k vocabulary inside a JSON string (its
tokens with quotes and escapes are checked one by one), so 128 rows on one thread outlast a decode step."""

_batch_matcher: Any = None


def fill_token_bitmask(grammars: list[RequestGrammar], pin: bool) -> torch.Tensor:
    """[len(grammars), ceil(V / 32)] int32 masks of the next token, on the host (pinned: ``pin``); V is
    the vocabulary the grammars were compiled for (all the same). Rows are filled by ``MASK_THREADS``."""
    global _batch_matcher
    bitmask = torch.empty(len(grammars), -(-grammars[0].vocab_size // 32), dtype=torch.int32, pin_memory=pin)
    if len(grammars) == 1:
        grammars[0].fill(bitmask, 0)
        return bitmask
    if _batch_matcher is None:
        import xgrammar as xgr

        _batch_matcher = xgr.BatchGrammarMatcher(max_threads=MASK_THREADS)
    _batch_matcher.batch_fill_next_token_bitmask([g.matcher for g in grammars], bitmask)
    return bitmask
