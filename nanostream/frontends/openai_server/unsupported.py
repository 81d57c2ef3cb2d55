"""Request fields this server does not implement and that would change the result if honoured: a 400
naming the field, never silently ignored. (Fields that change nothing, such as ``user`` or
``metadata``, are ignored as OpenAI ignores them.)"""

from __future__ import annotations

from typing import Any

from nanostream.frontends.openai_server.chat_protocol import ChatRequest
from nanostream.frontends.openai_server.protocol import BaseRequest, bad_request

_GUIDED = 'use structured_outputs (e.g. {{"structured_outputs": {{"{}": ...}}}}) instead'

UNSUPPORTED: dict[str, str] = {
    "functions": "use tools instead (the functions field is OpenAI's deprecated form)",
    "function_call": "use tool_choice instead (function_call is OpenAI's deprecated form)",
    "audio": "this server produces text only",
    "reasoning_effort": "this server cannot set a model's reasoning effort; leave it out",
    "web_search_options": "this server has no web search",
    "verbosity": "this server cannot set a model's verbosity; leave it out",
    "guided_json": _GUIDED.format("json"),
    "guided_regex": _GUIDED.format("regex"),
    "guided_choice": _GUIDED.format("choice"),
    "guided_grammar": _GUIDED.format("grammar"),
    "guided_decoding_backend": "this server's structured outputs always use xgrammar; leave it out",
    "guided_whitespace_pattern": "use structured_outputs.any_whitespace instead",
    "include_stop_str_in_output": "stop strings are always cut from the output",
    "use_beam_search": "this server has no beam search",
    "length_penalty": "this server has no beam search",
    "allowed_token_ids": "use logit_bias or structured_outputs instead",
    "bad_words": "use logit_bias instead",
    "logits_processors": "this server runs no custom logits processors",
    "chat_template": "this server renders with the model's own chat template",
    "documents": "this server's templates take no documents",
    "mm_processor_kwargs": "this server serves text models",
    "prompt_embeds": "send the prompt as text or token ids",
    "prompt_logprobs_temperature": "prompt logprobs are the model's own distribution (temperature 1)",
}
_CHAT_ONLY = {"continue_final_message": "it is for /v1/chat/completions; a completion always continues its prompt"}


def check_supported(body: BaseRequest) -> None:
    """Raise the 400 of the first field that is given but not implemented."""
    extra: dict[str, Any] = body.model_extra or {}
    table = {**UNSUPPORTED, **({} if isinstance(body, ChatRequest) else _CHAT_ONLY)}
    for name, value in extra.items():
        if name in table and value is not None:
            raise bad_request(f"{name} is not supported: {table[name]}", name)
    modalities = extra.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise bad_request(
            f'modalities must be ["text"] (this server produces text only), got {modalities!r}', "modalities"
        )
    if extra.get("spaces_between_special_tokens") is False:
        raise bad_request(
            "spaces_between_special_tokens false is not supported; leave it out", "spaces_between_special_tokens"
        )


def check_extra_fields(extra: dict[str, Any] | None, unsupported: dict[str, str], ignored: set[str], api: str) -> None:
    """The Responses and Messages APIs' rule for fields beyond their models: one this server does not
    implement (``unsupported``, given a value) or that the API does not have is a 400 naming it; ``ignored``
    ones change nothing and pass."""
    for name, value in (extra or {}).items():
        if name in unsupported and value not in (None, False, []):
            raise bad_request(f"{name} is not supported: {unsupported[name]}", name)
        if name not in unsupported and name not in ignored:
            raise bad_request(f"{name} is not a field of the {api} API; leave it out", name)
