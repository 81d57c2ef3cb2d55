"""The offline API: ``LLM(model).generate(prompts)`` runs an engine in this process."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as SequenceABC
from typing import Any

from tqdm.auto import tqdm
from transformers import AutoTokenizer

from nanostream.client.chat_template import render_chat
from nanostream.client.output_processor import OutputProcessor
from nanostream.client.reasoning import get_reasoning_parser
from nanostream.client.samples import sample_params, sample_request_id
from nanostream.config import EngineConfig
from nanostream.engine.grammar_text import parse as parse_grammar
from nanostream.engine.llm_engine import LLMEngine
from nanostream.errors import InvalidRequestError
from nanostream.outputs import CompletionOutput, RequestOutput
from nanostream.sampling_params import SamplingParams

Prompt = str | list[int]


def load_tokenizer(path: Any) -> Any:
    return AutoTokenizer.from_pretrained(path)


class LLM:
    """An engine in this process, for batch generation.

    Example::

        llm = LLM("/models/Qwen3-0.6B", max_model_len=4096)
        out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
        print(out[0].text)

    Unknown keyword arguments raise ``TypeError``; see ``EngineConfig`` for the options. With
    ``tensor_parallel_size=N`` it starts N-1 worker processes; ``with LLM(...) as llm:`` stops them at the end.
    """

    def __init__(self, model: str, **engine_config: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **engine_config))
        self.config = self.engine.config
        self.tokenizer = load_tokenizer(self.config.tokenizer or self.engine.model_path)
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's tensor-parallel worker processes now (they stop with the LLM's last reference,
        or at exit, otherwise). Nothing to do at ``tensor_parallel_size=1``."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | SequenceABC[Prompt],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for each prompt (a string or a list of token ids); outputs come in prompt order.

        Every prompt is checked before any runs: a bad one raises ``InvalidRequestError`` (a
        ``ValueError``) and the engine is left as it was. If a step fails (an internal error),
        ``RequestFailedError`` is raised and nothing is left running. With ``n`` > 1 in the
        SamplingParams, each output's ``outputs`` holds the n samples.
        """
        return self._generate(prompts, sampling_params, use_tqdm)

    def _generate(
        self,
        prompts: Prompt | SequenceABC[Prompt],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None,
        use_tqdm: bool,
        reasoning_parser: str | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (
            isinstance(prompts, SequenceABC) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ValueError(
                f"got {len(prompts)} prompts but {len(params)} SamplingParams; give one, or one per prompt"
            )
        requests = []
        for prompt, p in zip(prompts, params):
            if isinstance(prompt, str):
                ids = self.tokenizer(prompt).input_ids
            elif isinstance(prompt, SequenceABC):
                ids = list(prompt)
            else:
                raise InvalidRequestError(
                    f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}"
                )
            requests.append((f"offline-{next(self._ids)}", prompt if isinstance(prompt, str) else None, ids, p))
        if reasoning_parser is not None:
            get_reasoning_parser(reasoning_parser)  # raises ValueError for an unknown name
        for spec in {p.structured_outputs for _, _, _, p in requests if p.structured_outputs is not None}:
            parse_grammar(spec)  # InvalidRequestError now, rather than after others have run
        return self._run(requests, use_tqdm, reasoning_parser)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        reasoning_parser: str | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, with the tokenizer's chat template.

        ``tools`` (OpenAI's function definitions) and ``chat_template_kwargs`` (the template's own
        options, e.g. ``{"enable_thinking": False}`` for Qwen3) go to the template. ``reasoning_parser``
        (``"qwen3"``) splits each output's ``<think>`` reasoning into ``reasoning_content``. Example::

            llm.chat([{"role": "user", "content": "Hi"}], chat_template_kwargs={"enable_thinking": False})
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompt_ids = [
            render_chat(
                self.tokenizer,
                c,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                chat_template_kwargs=chat_template_kwargs,
                require_template=True,
            )
            for c in conversations
        ]
        return self._generate(prompt_ids, sampling_params, use_tqdm, reasoning_parser)

    def _run(self, requests: list, use_tqdm: bool, reasoning_parser: str | None) -> list[RequestOutput]:
        outputs: dict[str, RequestOutput] = {}
        procs: dict[str, OutputProcessor] = {}  # by engine request id: one per sample
        samples: dict[str, tuple[str, CompletionOutput]] = {}  # engine request id -> (request id, its output)
        later: dict[str, list[tuple[str, list[int], SamplingParams]]] = {}  # a first sample's id -> the others
        for rid, text, ids, p in requests:
            outputs[rid] = RequestOutput(rid, text, ids, logprobs=[] if p.logprobs is not None else None)
            for i, sp in enumerate(sample_params(p)):
                sid = sample_request_id(rid, i)
                procs[sid] = OutputProcessor(
                    self.tokenizer, ids, sp, incremental=False, reasoning_parser=reasoning_parser, index=i
                )
                samples[sid] = rid, CompletionOutput(i, logprobs=[] if p.logprobs is not None else None)
                outputs[rid].outputs.append(samples[sid][1])
                if i:
                    later.setdefault(rid, []).append((sid, ids, procs[sid].params))
        # Validated, now added (a bad prompt left the engine untouched). Of n > 1 samples the first goes
        # now, the others once it has a token (client/samples.py).
        added = []
        try:
            for rid, _, ids, _ in requests:
                self.engine.add_request(rid, ids, procs[sample_request_id(rid, 0)].params)
                added.append(rid)
        except Exception:
            for rid in added:
                self.engine.abort(rid)
            raise
        pending = {rid for rid, *_ in requests}  # engine request ids in the engine, unfinished
        bar = tqdm(total=len(samples), desc="generate", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        prefill_tokens = decode_tokens = 0
        start = time.perf_counter()
        try:
            while pending:
                result = self.engine.step()
                prefill_tokens += result.num_prefill_tokens
                decode_tokens += result.num_decode_tokens
                for delta in result.deltas:
                    for sid, ids, sp in later.pop(delta.request_id, ()):  # its prompt's blocks are cached now
                        self.engine.add_request(sid, ids, sp)
                        pending.add(sid)
                    proc = procs[delta.request_id]
                    proc.put(delta)
                    if proc.detok is None and delta.finish_reason is None:
                        continue  # no stop strings: its deltas merge, and are decoded once at the end
                    chunk, stop_now = proc.take()  # raises for a request the engine failed; the rest are aborted below
                    if stop_now:  # a stop string ended it
                        self.engine.abort(delta.request_id, "stop")
                    if chunk is None:
                        continue
                    rid, out = samples[delta.request_id]
                    out.token_ids += chunk.token_ids
                    out.text += chunk.text
                    if chunk.reasoning_content:
                        out.reasoning_content = (out.reasoning_content or "") + chunk.reasoning_content
                    if out.logprobs is not None:
                        out.logprobs += chunk.logprobs
                    if chunk.prompt_logprobs is not None:
                        outputs[rid].prompt_logprobs = chunk.prompt_logprobs
                    if chunk.finish_reason is not None:
                        out.finish_reason, out.stop_reason = chunk.finish_reason, proc.stop_reason
                        if out.index == 0:
                            outputs[rid].num_cached_tokens = chunk.usage.cached_tokens
                        pending.discard(delta.request_id)
                        bar.update(1)
                elapsed = time.perf_counter() - start
                bar.set_postfix_str(
                    f"prefill {prefill_tokens / elapsed:.0f} tok/s, decode {decode_tokens / elapsed:.0f} tok/s"
                )
        finally:
            bar.close()
            for rid in pending:  # interrupted (Ctrl-C, an error): leave nothing running in the engine
                self.engine.abort(rid)
        for out in outputs.values():  # the top-level fields are the first sample's
            first = out.outputs[0]
            out.token_ids, out.text, out.finish_reason = first.token_ids, first.text, first.finish_reason
            out.stop_reason, out.logprobs, out.reasoning_content = (
                first.stop_reason,
                first.logprobs,
                first.reasoning_content,
            )
        return [outputs[rid] for rid, *_ in requests]
