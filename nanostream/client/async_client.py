"""``AsyncClient``: stream tokens from an engine process (``nanostream serve``) into async code.

    async with AsyncClient("ipc:///run/user/1000/nanostream-….sock") as client:
        async for chunk in client.stream("Once upon a time", max_tokens=64, temperature=0.7):
            print(chunk.text, end="", flush=True)

One DEALER socket per client and one reader (the event loop's callback on that socket) multiplex
every stream: the reader only merges each request's new tokens into that request's mailbox, so a
slow consumer never blocks the engine, the reader or other streams, and holds at most its own
request's tokens. Text is decoded here, in the client, incrementally (see
``IncrementalDetokenizer``). Leaving a stream early (break, cancel, ``aclose()``) aborts its request
in the engine at once.

The client has a ``Connection`` (connection.py: registration, heartbeats, the reader,
reconnecting), which any task may close.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from nanostream import protocol as p
from nanostream.client.chat_template import render_chat
from nanostream.client.connection import ADDRESS_ENV, AUTH_TOKEN_ENV, Connection
from nanostream.client.embeddings import EMBED_PARAMS, embedding_pooling, finish_vector
from nanostream.client.prompts import as_prompts, prompt_and_images, prompt_ids
from nanostream.client.reasoning import get_reasoning_parser
from nanostream.client.stream import Stream
from nanostream.client.tokenizer_cache import load_image_preparer
from nanostream.errors import InvalidRequestError
from nanostream.multimodal import ImagePolicy, split_image_parts
from nanostream.multimodal.request import prompt_images
from nanostream.outputs import Completion, Embeddings
from nanostream.sampling_params import SamplingParams

__all__ = ["ADDRESS_ENV", "AUTH_TOKEN_ENV", "AsyncClient"]


class AsyncClient:
    """A client of one engine process.

    ``address`` defaults to the ``NANOSTREAM_ADDRESS`` environment variable, ``auth_token`` to
    ``NANOSTREAM_AUTH_TOKEN``. ``timeout`` bounds connecting, how long a request waits for the client
    to register again after a lost connection, and how long the engine may stay silent before every
    open stream raises ``EngineDeadError``.

    Example::

        async with AsyncClient() as client:
            out = await client.generate("The capital of France is", max_tokens=8, temperature=0)
            async for chunk in client.chat([{"role": "user", "content": "Hi!"}], max_tokens=64):
                print(chunk.text, end="")
    """

    def __init__(self, address: str | None = None, *, timeout: float = 10.0, auth_token: str | None = None) -> None:
        self.connection = Connection(address, timeout=timeout, auth_token=auth_token)
        self._images: tuple[str, Any, str] | None = None  # (tokenizer digest, image preparer, refusal): image_preparer

    async def connect(self) -> None:
        """Connect (``async with`` does): EngineDeadError if no engine answers within ``timeout``."""
        await self.connection.connect()

    async def close(self) -> None:
        """Abort this client's open streams and disconnect; any task may. Safe to call twice."""
        await self.connection.close()

    async def __aenter__(self) -> AsyncClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def address(self) -> str:
        return self.connection.address

    @property
    def timeout(self) -> float:
        return self.connection.timeout

    @property
    def client_id(self) -> str:
        """This client's id in the engine's stats."""
        return self.connection.client_id

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer (a transformers tokenizer), loaded when connecting."""
        return self.connection.tokenizer

    @property
    def model(self) -> str:
        return self.connection.welcome.model

    @property
    def max_model_len(self) -> int:
        return self.connection.welcome.max_model_len

    @property
    def chat_template(self) -> str | None:
        return self.connection.welcome.chat_template

    @property
    def eos_token_ids(self) -> list[int]:
        return self.connection.welcome.eos_token_ids

    def _params(self, sampling_params: SamplingParams | None, kwargs: dict[str, Any]) -> SamplingParams:
        if sampling_params is None:
            return SamplingParams(**kwargs)
        return dataclasses.replace(sampling_params, **kwargs) if kwargs else sampling_params

    def stream(
        self,
        prompt: str | list[int] | list[str] | list[list[int]],
        sampling_params: SamplingParams | None = None,
        *,
        timeout: float | None = None,
        **sampling_kwargs: Any,
    ) -> Stream:
        """Stream the completion of ``prompt`` (text or token ids), or of several prompts at once (a list
        of them: sample j of prompt p has index ``p * n + j``).

        ``sampling_kwargs`` are SamplingParams fields (``max_tokens=64, temperature=0``), applied over
        ``sampling_params`` when both are given. ``timeout`` (seconds) bounds the whole request: the
        engine aborts it then and the stream raises ``RequestTimeoutError``. With ``n=3`` the three
        samples' chunks interleave, each with its ``index``. A prompt of another type raises
        ``InvalidRequestError``, as ``LLM.generate`` does.
        """
        return self._stream(prompt, sampling_params, timeout, sampling_kwargs)

    def _stream(
        self,
        prompt: Any,
        sampling_params: SamplingParams | None,
        timeout: float | None,
        kwargs: dict,
        collect: bool = False,
    ) -> Stream:
        self.connection.check_reachable()
        params = self._params(sampling_params, kwargs)
        # (no prompt at all: an empty one, which the engine refuses with its own message)
        vocab = self.connection.welcome.vocab_size
        split = [prompt_and_images(one) for one in as_prompts(prompt)]  # (vLLM's dicts: their images apart)
        prompts = [prompt_ids(self.tokenizer, one, vocab) for one, _ in split] or [[]]
        images = []
        if any(sources for _, sources in split):
            if len(split) > 1:
                raise InvalidRequestError("a stream of several prompts takes no images; stream each with its images")
            preparer, refusal = self.image_preparer()
            prompts[0], images = prompt_images(prompts[0], split[0][1], preparer, ImagePolicy.trusted(), refusal)
        return Stream(
            self.connection, prompts[0], params, timeout, extra_prompts=prompts[1:], collect=collect, images=images
        )

    def chat(
        self,
        messages: list[dict[str, Any]],
        sampling_params: SamplingParams | None = None,
        *,
        timeout: float | None = None,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        reasoning_parser: str | None = None,
        add_generation_prompt: bool = True,
        **sampling_kwargs: Any,
    ) -> Stream:
        """Stream a reply to ``messages`` ([{"role": ..., "content": ...}]) with the model's chat template.

        ``tools`` (OpenAI's function definitions) and ``chat_template_kwargs`` (the template's own
        options) go to the template, with the messages as given (an assistant's ``tool_calls``, ``tool``
        messages). ``reasoning_parser`` ("qwen3") puts the ``<think>`` part of the reply in each chunk's
        ``reasoning_content`` and the rest in ``text``. A vision-language model takes image parts in the messages
        (``{"type": "image_url", "image_url": {"url": "data:..."}}``, or ``{"type": "image", "image": ...}`` with a
        PIL image, bytes or a path). A model without a chat template gets a plain
        "role: content" transcript ending in "assistant:". Example::

            client.chat(msgs, chat_template_kwargs={"enable_thinking": False}, reasoning_parser="qwen3")
        """
        self.connection.check_reachable()
        if reasoning_parser is not None:
            get_reasoning_parser(reasoning_parser)  # an unknown name: ValueError now
        messages, sources = split_image_parts(messages)
        ids = render_chat(
            self.tokenizer,
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
        )
        images = []
        if sources:  # (a vision-language model's: prepared here, on this process's CPU)
            preparer, refusal = self.image_preparer()
            ids, images = prompt_images(ids, sources, preparer, ImagePolicy.trusted(), refusal)
        params = self._params(sampling_params, sampling_kwargs)
        return Stream(self.connection, ids, params, timeout, reasoning_parser=reasoning_parser, images=images)

    def image_preparer(self) -> tuple[Any, str]:
        """(the engine's model's image preparer, None for a text model; what a request with images is told then),
        loaded once from the files the engine's welcome carried."""
        digest = self.connection.welcome.tokenizer_digest  # (another engine after a reconnection: its own)
        if self._images is None or self._images[0] != digest:
            self._images = (digest, *load_image_preparer(digest))
        return self._images[1:]

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        *,
        timeout: float | None = None,
        **sampling_kwargs: Any,
    ) -> Completion:
        """The whole completion of ``prompt``; with ``n`` > 1 its ``outputs`` hold every sample."""
        async with self._stream(prompt, sampling_params, timeout, sampling_kwargs, collect=True) as stream:
            async for _ in stream:
                pass
        return stream.completion()

    async def embed(
        self,
        prompt: str | list[int] | list[str] | list[list[int]],
        *,
        dimensions: int | None = None,
        timeout: float | None = None,
    ) -> Embeddings:
        """The embedding of ``prompt``, or of each of several prompts (batched in the engine beside the
        generating requests), from an engine started as an embedding server (``--runner pooling``);
        ``dimensions`` cuts each vector (a Matryoshka model's only). Example::

            out = await client.embed(["a query", "a document"])
            similarity = out.vectors[0] @ out.vectors[1]   # normalised: the cosine
        """  # fmt: skip
        pooling = embedding_pooling(self.connection.welcome.pooling, dimensions)
        raw: dict[int, bytes] = {}
        async with self._stream(prompt, EMBED_PARAMS, timeout, {}) as stream:
            async for chunk in stream:
                if chunk.embedding is not None:
                    raw[chunk.index] = chunk.embedding
        vectors = [finish_vector(raw[i], pooling, dimensions) for i in range(len(stream.prompts))]
        return Embeddings(vectors, stream.num_prompt_tokens)

    async def stats(self) -> p.Stats:
        """The engine's counters: running and waiting requests, free KV blocks, clients."""
        return await self.connection.stats()
