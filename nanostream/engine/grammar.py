"""Structured outputs in the engine, with xgrammar: grammars compiled off the busy loop, one matcher
per request, the masks of a step's constrained rows.

    add_request ──▶ GrammarCompiler.submit(spec) ──▶ a worker thread: parse (a bad spec fails the future
                    with InvalidRequestError), compile against the model's vocabulary; cached by spec
    the request waits (not in the scheduler) until its future is done ──▶ RequestGrammar
    each step ──▶ GrammarMasks.fill(): one row per constrained sample, after the grammar took the
                  previous token ──▶ the sampler masks those rows' logits (sampler.apply_token_bitmask)
    each token ──▶ RequestGrammar.accept(token); ``terminated`` once it took a stop token

xgrammar is imported on the first constrained request, so engines that never see one never load it.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import weakref
from collections import OrderedDict
from concurrent import futures
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from nanostream.engine.grammar_text import parse
from nanostream.engine.sequence import Sequence
from nanostream.structured_outputs import StructuredOutputsParams

log = logging.getLogger(__name__)

CACHE_SIZE = 128
"""Compiled grammars kept (least recently used dropped first): repeated schemas compile once."""


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


class GrammarMasks:
    """Fills a step's masks of the next token; one per engine (``LLMEngine`` owns it), with its own xgrammar
    ``BatchGrammarMatcher`` (its threads), made on the first step with two constrained rows::

        masks = GrammarMasks()
        bitmask = masks.fill([seq.grammar for seq in constrained], pin=True)"""

    def __init__(self, threads: int = MASK_THREADS) -> None:
        self.threads = threads
        self._batch_matcher: Any = None

    def fill(self, grammars: list[RequestGrammar], pin: bool) -> torch.Tensor:
        """[len(grammars), ceil(V / 32)] int32 masks of the next token, on the host (pinned: ``pin``); V is
        the vocabulary the grammars were compiled for (all the same). Rows are filled by ``threads``."""
        bitmask = torch.empty(len(grammars), -(-grammars[0].vocab_size // 32), dtype=torch.int32, pin_memory=pin)
        if len(grammars) == 1:
            grammars[0].fill(bitmask, 0)
            return bitmask
        if self._batch_matcher is None:
            import xgrammar as xgr

            self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=self.threads)
        self._batch_matcher.batch_fill_next_token_bitmask([g.matcher for g in grammars], bitmask)
        return bitmask
