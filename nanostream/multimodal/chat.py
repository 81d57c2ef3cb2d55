"""Images in chat messages: the sources taken out, ``{"type": "image"}`` parts left for the chat template.

The part kinds read, in a message whose ``content`` is a list::

    {"type": "image_url", "image_url": {"url": "https://...", "detail": "low"}}    OpenAI Chat Completions
    {"type": "image_url", "image_url": "data:image/png;base64,..."}                 (a bare URL too)
    {"type": "input_image", "image_url": "https://..."}                             OpenAI Responses
    {"type": "image", "image": <PIL image | bytes | path | URL>}                    transformers / vLLM style
    {"type": "image", "url": "..."} or {"type": "image", "path": "..."}             transformers' processors

``detail`` is ignored. Qwen's chat templates (Qwen2-VL to Qwen3.5) write
``<|vision_start|><|image_pad|><|vision_end|>`` for a part whose type is ``image``, so the parts given
back render the placeholder there; every other part and message is passed on as it came.
"""

from __future__ import annotations

from typing import Any

from nanostream.multimodal.policy import ImageError
from nanostream.multimodal.sources import ImageSource

IMAGE_PART_TYPES = ("image_url", "input_image", "image")


def split_image_parts(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[ImageSource]]:
    """(messages for the chat template, the image sources in order of appearance). The messages given are
    not changed; a message with no image part is passed on as the same object.

    >>> split_image_parts([{"role": "user", "content": [
    ...     {"type": "text", "text": "What is this?"},
    ...     {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}}]}])
    ([{'role': 'user', 'content': [{'type': 'text', 'text': 'What is this?'}, {'type': 'image'}]}], \
['data:image/png;base64,iVBO'])
    """
    template_messages: list[dict[str, Any]] = []
    sources: list[ImageSource] = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(_is_image_part(part) for part in content):
            template_messages.append(message)
            continue
        parts = []
        for part in content:
            if _is_image_part(part):
                sources.append(_source(part, len(sources)))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        template_messages.append({**message, "content": parts})
    return template_messages, sources


def _is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES


def _source(part: dict[str, Any], index: int) -> ImageSource:
    kind, what = part["type"], f"image {index + 1}"
    if kind == "image":
        found = [part[key] for key in ("image", "url", "path") if part.get(key) is not None]
        if len(found) != 1:
            raise ImageError(f'{what}: an "image" part holds one of "image", "url" or "path"; this one {_keys(part)}')
        return found[0]
    if kind == "input_image" and part.get("image_url") is None:
        raise ImageError(
            f'{what}: an "input_image" part needs "image_url" (a URL or data: URL); file_id is not supported'
        )
    url = part.get("image_url")
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str) or not url:
        raise ImageError(f'{what}: an "{kind}" part needs "image_url": {{"url": "<http(s) or data: URL>"}}')
    return url


def _keys(part: dict[str, Any]) -> str:
    return "has " + ", ".join(sorted(f'"{k}"' for k in part if k != "type")) if len(part) > 1 else "has none"
