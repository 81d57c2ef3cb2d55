"""A conversation rendered into prompt token ids with the model's chat template: one function for
``LLM.chat``, ``AsyncClient.chat`` and the HTTP frontend, so all three send the model the same tokens.

Messages go to the template as given (OpenAI's shapes: an assistant's ``tool_calls``, ``tool``
messages with their ``tool_call_id``), and so do ``tools`` and the template's own options
(``chat_template_kwargs``, e.g. Qwen3's ``enable_thinking``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jinja2

from nanostream.errors import InvalidRequestError

_RESERVED = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
"""apply_chat_template's own parameters: not for chat_template_kwargs to set."""


def check_template_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """``chat_template_kwargs`` as a dict, or ``ValueError`` saying what is wrong with it."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError(f"chat_template_kwargs must map names to values, got {kwargs!r}")
    reserved = sorted(set(kwargs) & _RESERVED)
    if reserved:
        raise ValueError(
            f"chat_template_kwargs may not set {', '.join(reserved)}: that is a parameter of its own, not a "
            "variable of the template"
        )
    return dict(kwargs)


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    require_template: bool = False,
    add_special_tokens: bool = False,
) -> list[int]:
    """The prompt token ids of ``messages`` (and ``tools``) as the model's chat template renders them.

    A tokenizer without a template renders a plain "role: content" transcript ending in "assistant:"
    (``require_template``: raises ``ValueError`` instead). A template that refuses the messages raises
    ``InvalidRequestError`` with its reason. ``continue_final_message``: the final message is left open
    (no end-of-turn after its content), so the model continues it, a prefilled reply say; it excludes
    ``add_generation_prompt``. ``add_special_tokens``: also those the tokenizer adds to any text (a BOS);
    templates write their own, so off by default.
    """
    kwargs = check_template_kwargs(chat_template_kwargs)
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError(
            "continue_final_message cannot be combined with add_generation_prompt (which starts a new message after "
            "the final one, and is true by default): set add_generation_prompt to false"
        )
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(
                messages,
                tools=tools or None,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **kwargs,
            )
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"the model's chat template refused these messages: {exc}") from None
        except ValueError:  # transformers: the template does not render the final message's content as given
            if not continue_final_message:
                raise
            raise InvalidRequestError(
                "continue_final_message cannot leave the final message open: the model's chat template does not "
                "render its content as given; send the messages without continue_final_message"
            ) from None
    elif require_template:
        raise ValueError("this model's tokenizer has no chat template; use generate() with a plain prompt")
    elif tools:
        raise InvalidRequestError("this model has no chat template to show it tools; leave tools out")
    else:
        text = "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages)
        text = text.removesuffix("\n") if continue_final_message else text
        text += "assistant:" if add_generation_prompt else ""
    return tokenizer(text, add_special_tokens=add_special_tokens).input_ids
