"""The offline API: ``LLM(model).generate(prompts)`` runs an engine in this process."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as SequenceABC
from typing import Any

from tqdm.auto import tqdm
from transformers import AutoTokenizer

from nanostream.client.output_processor import OutputProcessor
from nanostream.config import EngineConfig
from nanostream.engine.llm_engine import LLMEngine
from nanostream.errors import InvalidRequestError
from nanostream.outputs import RequestOutput
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
        ``RequestFailedError`` is raised and nothing is left running.
        """
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
        # Validate everything first, then add: a bad prompt leaves the engine untouched.
        added = []
        try:
            for rid, _, ids, p in requests:
                self.engine.add_request(rid, ids, p)
                added.append(rid)
        except Exception:
            for rid in added:
                self.engine.abort(rid)
            raise
        return self._run(requests, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, with the tokenizer's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("this model's tokenizer has no chat template; use generate() with a plain prompt")
        prompts = [
            self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=add_generation_prompt)
            for c in conversations
        ]
        prompt_ids = [self.tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
        return self.generate(prompt_ids, sampling_params, use_tqdm)

    def _run(self, requests: list, use_tqdm: bool) -> list[RequestOutput]:
        outputs: dict[str, RequestOutput] = {}
        procs: dict[str, OutputProcessor] = {}
        for rid, text, ids, p in requests:
            outputs[rid] = RequestOutput(rid, text, ids, logprobs=[] if p.logprobs is not None else None)
            procs[rid] = OutputProcessor(self.tokenizer, ids, p, incremental=False)
        pending = set(outputs)
        bar = tqdm(total=len(requests), desc="generate", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        prefill_tokens = decode_tokens = 0
        start = time.perf_counter()
        try:
            while pending:
                result = self.engine.step()
                prefill_tokens += result.num_prefill_tokens
                decode_tokens += result.num_decode_tokens
                for delta in result.deltas:
                    proc = procs[delta.request_id]
                    proc.put(delta)
                    if proc.detok is None and delta.finish_reason is None:
                        continue  # no stop strings: its deltas merge, and are decoded once at the end
                    chunk = proc.take()  # raises for a request the engine failed; the rest are aborted below
                    if proc.abort:  # a stop string ended it
                        self.engine.abort(delta.request_id, "stop")
                    if chunk is None:
                        continue
                    out = outputs[delta.request_id]
                    out.token_ids += chunk.token_ids
                    out.text += chunk.text
                    if out.logprobs is not None:
                        out.logprobs += chunk.logprobs
                    if chunk.finish_reason is not None:
                        out.finish_reason, out.stop_reason = chunk.finish_reason, proc.stop_reason
                        out.num_cached_tokens = chunk.usage.cached_tokens
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
        return [outputs[rid] for rid, *_ in requests]
