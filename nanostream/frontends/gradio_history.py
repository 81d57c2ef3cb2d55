"""Gradio's chat history and new message as chat-template messages, images included (the Gradio chat's input).

    conversation("Be brief.", history, {"text": "What is this?", "files": ["/tmp/gradio/.../cat.png"]})
    # [{"role": "system", "content": "Be brief."}, ...earlier turns...,
    #  {"role": "user", "content": [{"type": "image", "image": Path(".../cat.png")},
    #                               {"type": "text", "text": "What is this?"}]}]

A turn's uploaded files become image parts (``AsyncClient.chat`` reads them), before its text as Gradio shows
them; a turn without files keeps its content a string, so text chats render as they always did. Earlier turns
keep their images: every reply is to the whole conversation, and the engine's prefix and encoder caches
make the images already seen cost nothing new. The paths are files of Gradio's upload folder: Gradio
refuses a browser's history that names any other file, and an API session's history lives on the server.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

NOTICE_TITLE = "⚠️ No reply"
"""The title of this app's notices (an error in place of a reply), which ``conversation`` leaves out."""


def conversation(
    system_prompt: str, history: list[dict[str, Any]], message: str | dict[str, Any]
) -> list[dict[str, Any]]:
    """Chat-template messages from Gradio's history (messages format) and the new user message.

    ``message`` is a string (a text box's) or a multimodal box's ``{"text": ..., "files": [path, ...]}``.
    Gradio gives a history message's content as a string or a list of parts: ``{"type": "text", "text": ...}``
    and ``{"type": "file", "file": {"path": ...}}`` as a browser's chatbot sends them, strings and
    ``{"path": ...}`` as an API session's state holds them; components (an assistant's) are left out. Titled
    messages (thoughts, tool calls, this app's notices) are left out, and so is a user message whose only
    answer was a notice: the notice asked the user to send it again.
    """
    messages: list[dict[str, Any]] = [{"role": "system", "content": system_prompt}] if system_prompt.strip() else []
    for turn in history:
        title = (turn.get("metadata") or {}).get("title")
        if title:
            if title == NOTICE_TITLE:
                while messages and messages[-1]["role"] == "user":  # (one turn, or a file and its text apart)
                    messages.pop()
            continue
        messages.append({"role": turn["role"], "content": _content(turn["content"])})
    if isinstance(message, dict):  # (its files: paths, or FileData dicts)
        files = [{"path": f} if isinstance(f, str) else f for f in message.get("files") or []]
        message = _content([*files, message.get("text") or ""])
    messages.append({"role": "user", "content": message})
    return messages


def resent_images(messages: list[dict[str, Any]]) -> int:
    """The image parts of ``conversation``'s messages before the new one: earlier turns' images, sent again."""
    return sum(isinstance(p, dict) and p.get("type") == "image" for m in messages[:-1] for p in _parts(m["content"]))


def _parts(content: Any) -> list[Any]:
    return content if isinstance(content, list) else [content]


def _content(content: Any) -> str | list[dict[str, Any]]:
    """A history message's content: its text, or its image parts then a text part when it holds files."""
    parts = _parts(content)
    paths = [path for path in map(_file_path, parts) if path]
    text = "".join(p if isinstance(p, str) else p.get("text", "") for p in parts if isinstance(p, (str, dict)))
    if not paths:
        return text
    images: list[dict[str, Any]] = [{"type": "image", "image": Path(path)} for path in paths]
    return [*images, {"type": "text", "text": text}] if text else images


def _file_path(part: Any) -> str | None:
    """The path of a file part (a dict with ``path``, ``{"type": "file", "file": {...}}``, or a FileData)."""
    if isinstance(part, dict):
        inner = part.get("file") if part.get("type") == "file" or "file" in part else part
        path = inner.get("path") if isinstance(inner, dict) else getattr(inner, "path", None)
    else:
        path = getattr(part, "path", None)
    return path if isinstance(path, str) and path else None
