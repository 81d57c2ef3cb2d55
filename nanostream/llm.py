"""The offline API: ``LLM(model).generate(prompts)`` runs an engine in this process."""

from __future__ import annotations

import gc
import itertools
import time
from collections.abc import Sequence as SequenceABC
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from nanostream.client.chat_template import render_chat
from nanostream.client.embeddings import EMBED_PARAMS, embedding_pooling, finish_vector
from nanostream.client.prompts import Prompt, as_prompts, prompt_and_images, prompt_ids
from nanostream.client.reasoning import get_reasoning_parser
from nanostream.client.samples import SampleGroup
from nanostream.config import EngineConfig
from nanostream.engine.grammar_text import parse as parse_grammar
from nanostream.engine.llm_engine import LLMEngine
from nanostream.multimodal import ImagePolicy, split_image_parts
from nanostream.multimodal.request import load_preparer, prompt_images
from nanostream.outputs import RequestOutput
from nanostream.sampling_params import SamplingParams


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
        self.image_preparer, self._no_images = load_preparer(self.engine.model_path)  # None: text only
        self.image_policy = ImagePolicy.trusted()  # local files anywhere; http(s) URLs with allowed_domains only
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's tensor-parallel worker processes and give back this process's device memory (the
        weights, the KV pool, the CUDA graphs), so that another LLM can be built here; the end of ``with LLM(...)
        as llm:`` does it. The LLM cannot generate afterwards."""
        self.engine.close()
        runner = getattr(self.engine, "runner", None)
        if runner is None:
            return
        device = runner.device
        del self.engine.runner, runner  # its graphs refer back to it: the collector frees the cycle
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

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
        """Generate for each prompt (a string or a list of token ids); outputs come in prompt order. A prompt with
        images (a vision-language model) is a dict, ``{"prompt": text or ids, "multi_modal_data": {"image": [...]}}``,
        one image token (Qwen's ``<|image_pad|>``) where each image goes; an image is a PIL image, bytes, a path or a
        data URL.

        Every prompt is checked before any runs: a bad one raises ``InvalidRequestError`` (a
        ``ValueError``) and the engine is left as it was. If a step fails (an internal error),
        ``RequestFailedError`` is raised and nothing is left running. With ``n`` > 1 in the
        SamplingParams, each output's ``outputs`` holds the n samples.
        """
        return self._generate(prompts, sampling_params, use_tqdm)

    def embed(self, prompts: Prompt | SequenceABC[Prompt], *, dimensions: int | None = None) -> list[np.ndarray]:
        """One vector per prompt, in order, from an engine of ``runner="pooling"`` (an embedding checkpoint), as
        ``AsyncClient.embed`` gives them; ``dimensions`` cuts each (a Matryoshka model's only). Example::

            llm = LLM("/models/Qwen3-Embedding-0.6B", runner="pooling")
            query, document = llm.embed(["a query", "a document"])
        """
        pooling = embedding_pooling(self.engine.pooling, dimensions)
        outputs = self._generate(prompts, EMBED_PARAMS, use_tqdm=False)
        return [finish_vector(out.outputs[0].embedding, pooling, dimensions) for out in outputs]

    def _generate(
        self,
        prompts: Prompt | SequenceABC[Prompt],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None,
        use_tqdm: bool,
        reasoning_parser: str | None = None,
    ) -> list[RequestOutput]:
        prompts = as_prompts(prompts)
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
            prompt, sources = prompt_and_images(prompt)
            ids = prompt_ids(self.tokenizer, prompt, self.engine.vocab_size)
            ids, images = prompt_images(ids, sources, self.image_preparer, self.image_policy, self._no_images)
            requests.append((f"offline-{next(self._ids)}", prompt if isinstance(prompt, str) else None, ids, p, images))
        if reasoning_parser is not None:
            get_reasoning_parser(reasoning_parser)  # raises ValueError for an unknown name
        for spec in {r[3].structured_outputs for r in requests if r[3].structured_outputs is not None}:
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
        rendered = []
        for conversation in conversations:
            conversation, sources = split_image_parts(conversation)  # image parts: {"type": "image"} for the template
            ids = render_chat(
                self.tokenizer, conversation, tools=tools, add_generation_prompt=add_generation_prompt,
                chat_template_kwargs=chat_template_kwargs, require_template=True,
            )  # fmt: skip
            rendered.append({"prompt": ids, "multi_modal_data": {"image": sources}} if sources else ids)
        return self._generate(rendered, sampling_params, use_tqdm, reasoning_parser)

    def _run(self, requests: list, use_tqdm: bool, reasoning_parser: str | None) -> list[RequestOutput]:
        if not hasattr(self.engine, "runner"):
            raise RuntimeError("this LLM is closed: build a new one to generate")
        groups = [
            SampleGroup(
                rid, self.tokenizer, [ids], p, reasoning_parser=reasoning_parser, incremental=False, collect=True
            )
            for rid, _, ids, p, _ in requests
        ]
        images = {s.request_id: r[4] for group, r in zip(groups, requests) for s in group.samples}
        samples = {s.request_id: (group, s) for group in groups for s in group.samples}  # by engine request id
        # Validated, now added (a bad prompt left the engine untouched). Of n > 1 samples the first goes
        # now, the others once it has a token (client/samples.py).
        pending: set[str] = set()  # engine request ids in the engine, unfinished
        try:
            for group in groups:
                for sample in group.leaders:
                    self.engine.add_request(sample.request_id, sample.prompt, sample.params, images[sample.request_id])
                    pending.add(sample.request_id)
        except Exception:
            for rid in pending:
                self.engine.abort(rid)
            raise
        bar = tqdm(total=len(samples), desc="generate", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        prefill_tokens = decode_tokens = 0
        start = time.perf_counter()
        try:
            while pending:
                result = self.engine.step()
                prefill_tokens += result.num_prefill_tokens
                decode_tokens += result.num_decode_tokens
                for delta in result.deltas:
                    group, sample = samples[delta.request_id]
                    for follower in group.followers_of(sample):  # its prompt's blocks are cached now
                        rid = follower.request_id
                        self.engine.add_request(rid, follower.prompt, follower.params, images[rid])
                        pending.add(follower.request_id)
                    sample.processor.put(delta)
                    chunk, stop_now = group.take(sample)  # raises for a request the engine failed (see finally)
                    if stop_now:  # a stop string ended it
                        self.engine.abort(delta.request_id, "stop")
                    if chunk is not None and chunk.finish_reason is not None:
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
        return [
            RequestOutput.of(
                group.request_id,
                text,
                ids,
                group.outputs(),
                group.samples[0].processor.usage.cached_tokens,
                group.prompt_logprobs(),
            )
            for group, (_, text, ids, _, _) in zip(groups, requests)
        ]
