"""``POST /v1/completions`` and ``POST /v1/chat/completions``: a body, checked, becomes ``SamplingParams``
and a prompt (the chat template rendered here), a ``Stream`` on the engine, and a ``Reply`` (responses.py)
written out as JSON or server-sent events (sse.py).
"""

from __future__ import annotations

import dataclasses

import anyio.to_thread
from fastapi import Request
from fastapi.responses import Response

from nanostream.client.chat_template import check_template_kwargs, render_chat
from nanostream.client.stream import Stream
from nanostream.errors import InvalidRequestError
from nanostream.frontends.openai_server.chat_protocol import ChatRequest, template_error
from nanostream.frontends.openai_server.protocol import BaseRequest, CompletionRequest, bad_request
from nanostream.frontends.openai_server.responses import Reply, ReplyOptions
from nanostream.frontends.openai_server.sse import respond
from nanostream.frontends.openai_server.structured import ToolPlan, constraint_of, tool_plan
from nanostream.frontends.openai_server.unsupported import check_supported
from nanostream.multimodal import split_image_parts
from nanostream.multimodal.request import prompt_images
from nanostream.protocol import ImageInput


class Generation:
    """The generating routes of the server (``self.client``, ``self.check_model``, ``self.metrics``, the
    parsers and ``self.tokens`` come from it)."""

    def _checked(self, body: BaseRequest) -> None:
        self.check_model(body.model)
        check_supported(body)
        body.check()

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self._checked(body)
        params = body.sampling_params(body.max_tokens, body.logprobs, constraint_of(body))
        if body.echo and body.logprobs is not None and params.prompt_logprobs is None:
            params = dataclasses.replace(params, prompt_logprobs=body.logprobs)  # the echoed prompt's logprobs
        tokenizer = self.client.tokenizer
        prompts = body.prompts_kept(tokenizer, self.client.max_model_len)
        stream = self.client.stream(prompts if len(prompts) > 1 else prompts[0], params)
        echo = [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts] if body.echo else None
        options = self._options(stream, body, chat=False, top_logprobs=body.logprobs)
        options.echo = echo
        return await self._respond(request, body, stream, Reply(options))

    async def chat_completions(self, body: ChatRequest, request: Request) -> Response:
        self._checked(body)
        logprobs = body.num_logprobs()
        stream, plan = await self.chat_stream(body, logprobs)
        options = self._options(stream, body, chat=True, top_logprobs=logprobs)
        options.tool_parser = self.tool_parser if plan.parse else None
        options.reasoning = self.reasoning_parser is not None
        echoed = body.echoed()
        options.role, options.echo = body.role, None if echoed is None else [echoed]
        return await self._respond(request, body, stream, Reply(options))

    async def chat_stream(
        self, body: ChatRequest, logprobs: int | None = None, where: str = "messages"
    ) -> tuple[Stream, ToolPlan]:
        """The engine stream of a checked chat request, and how its tools are handled: the one path from
        a conversation to tokens, for the chat route and the dialects translated onto it (Responses, Messages).
        ``where``: the request's field an image error names (the Responses API's is ``input``)."""
        ids, plan, images = await self.chat_inputs(body, where)
        params = body.sampling_params(body.max_new_tokens(), logprobs, constraint_of(body, plan))
        if not images:  # (a prompt with images is not cut: its placeholders must stay whole)
            ids = body.truncated(ids, self.client.max_model_len, body.max_new_tokens())
        stream = Stream(self.client.connection, ids, params, reasoning_parser=self.reasoning_parser, images=images)
        return stream, plan

    async def chat_inputs(
        self, body: ChatRequest, where: str = "messages"
    ) -> tuple[list[int], ToolPlan, list[ImageInput]]:
        """A chat request's prompt token ids, each image's placeholder widened to its tokens (what the engine
        reads, so what a token count counts), its tool plan and its images (a vision-language model's: fetched,
        decoded and prepared off the event loop)."""
        ids, plan, sources = self.chat_prompt(body)
        images: list[ImageInput] = []
        if sources:
            preparer, refusal = self.client.image_preparer()
            policy = self.image_policy
            try:
                ids, images = await anyio.to_thread.run_sync(prompt_images, ids, sources, preparer, policy, refusal)
            except InvalidRequestError as exc:  # an image that cannot be had or read, a model without images
                raise bad_request(str(exc), where) from None
        return ids, plan, images

    def chat_prompt(self, body: ChatRequest) -> tuple[list[int], ToolPlan, list]:
        """A chat request's prompt token ids, rendered with the model's template (one image token per image), its
        tool plan and its images' sources."""
        plan = tool_plan(body, self.tool_parser)
        try:
            kwargs = check_template_kwargs(body.chat_template_kwargs)
        except ValueError as exc:
            raise bad_request(str(exc), "chat_template_kwargs") from None
        try:  # rendered here, not by AsyncClient.chat: the prompt may be left open, and truncated
            messages, sources = split_image_parts(body.template_messages())
            ids = render_chat(
                self.client.tokenizer,
                messages,
                tools=plan.tools,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                chat_template_kwargs=kwargs,
            )
        except InvalidRequestError as exc:
            raise template_error(exc) from None
        return ids, plan, sources

    def _options(self, stream: Stream, body: BaseRequest, *, chat: bool, top_logprobs: int | None) -> ReplyOptions:
        return ReplyOptions(
            chat,
            self.served_model_name,
            stream.request_id,
            self.tokens,
            stream.prompts,
            n=stream.params.n,
            top_logprobs=top_logprobs,
            prompt_logprobs=body.prompt_logprobs is not None,
            continuous_usage=body.continuous_usage,
            token_ids=body.return_token_ids,
        )

    async def _respond(self, request: Request, body: BaseRequest, stream: Stream, reply: Reply) -> Response:
        chunks = self.metrics.timed(stream, "chat" if reply.o.chat else "completions")
        return await respond(request, chunks, reply, stream=body.stream, include_usage=body.include_usage)
