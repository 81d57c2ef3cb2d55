"""Images through the dialects (issues 58, 59): ``nanostream serve`` of a tiny Qwen3.5 vision-language model, the
official ``openai`` client's ``responses.create`` with an ``input_image`` and the ``anthropic`` client's
``messages.create`` with a base64 ``image`` block (and one in a ``tool_result``, as Claude Code sends screenshots),
each reply what ``LLM.chat`` gives for the same image and text; a stored response's image carried into the next
turn by ``previous_response_id``; ``count_tokens`` counting the image's tokens; and the images a client may get
wrong, each a 400 that says what to change. One server for the module (a start takes ~15 s)."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator

import anthropic
import numpy as np
import openai
import pytest
from helpers import served_openai
from PIL import Image

from nanostream import LLM, SamplingParams
from nanostream.frontends.openai_server.chat_protocol import tool_call
from nanostream.testing import TINY_PRESETS, make_tiny_model

pytestmark = pytest.mark.slow
GREEDY = dict(temperature=0, max_tokens=10, ignore_eos=True)  # every reply its 10 tokens: no early end to differ on
GREEDY_CLAUDE = {"temperature": 0, "ignore_eos": True}  # (anthropic 2.x has no temperature argument: the body has)


def _png(h: int, w: int, seed: int) -> str:
    """A random picture's PNG bytes as base64."""
    pixels = (np.random.default_rng(seed).random((h, w, 3)) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


PNG = _png(40, 56, 1)
DATA_URL = "data:image/png;base64," + PNG
ASK = [
    {
        "role": "user",
        "content": [{"type": "text", "text": "Describe it."}, {"type": "image_url", "image_url": DATA_URL}],
    }
]
CALL = tool_call("toolu_1", "screenshot", "{}")
SHOT = [
    {"role": "user", "content": "Look at the screen."},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "toolu_1", "content": [{"type": "image_url", "image_url": DATA_URL}]},
]


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[openai.OpenAI, anthropic.Anthropic, str, dict]]:
    """(the openai client, the anthropic client, the served model's name, LLM.chat's replies by name)."""
    root = tmp_path_factory.mktemp("dialect_images")
    path = make_tiny_model(root / "vl", **TINY_PRESETS["qwen3_5_vl"])
    with LLM(str(path), device="cpu", dtype="float32", kvcache_block_size=16, max_model_len=256) as llm:
        ask, shot = llm.chat([ASK, SHOT], SamplingParams(**GREEDY), use_tqdm=False)
        then = [*ASK, {"role": "assistant", "content": ask.outputs[0].text}, {"role": "user", "content": "And now?"}]
        (again,) = llm.chat(then, SamplingParams(**GREEDY), use_tqdm=False)
    want = {"ask": ask, "shot": shot, "again": again}
    (root / "run").mkdir()
    with pytest.MonkeyPatch.context() as monkeypatch, served_openai(path, root / "run", monkeypatch) as (api, _):
        claude = anthropic.Anthropic(base_url=str(api.base_url).removesuffix("/v1/"), api_key="none", max_retries=20)
        yield api, claude, path.name, want


def test_responses_input_image_and_previous_response_id(served):
    api, _, model, want = served
    parts = [
        {"type": "input_text", "text": "Describe it."},
        {"type": "input_image", "image_url": DATA_URL, "detail": "auto"},
    ]
    first = api.responses.create(model=model, input=[{"role": "user", "content": parts}], max_output_tokens=10,
                                 temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert first.output_text == want["ask"].outputs[0].text
    assert first.usage.input_tokens == len(want["ask"].prompt_token_ids)  # the image's tokens among them
    then = api.responses.create(model=model, input="And now?", previous_response_id=first.id, max_output_tokens=10,
                                temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert then.output_text == want["again"].outputs[0].text  # the stored turn kept its image
    assert then.usage.input_tokens == len(want["again"].prompt_token_ids)


def test_messages_image_blocks_in_a_user_turn_and_a_tool_result(served):
    _, claude, model, want = served
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "Describe it."}, image]}]
    reply = claude.messages.create(model=model, messages=messages, max_tokens=10,
                                   extra_body=GREEDY_CLAUDE)  # fmt: skip
    assert "".join(block.text for block in reply.content) == want["ask"].outputs[0].text
    counted = claude.messages.count_tokens(model=model, messages=messages).input_tokens
    assert (
        counted == len(want["ask"].prompt_token_ids) == reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    )
    shot = [
        {"role": "user", "content": "Look at the screen."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "screenshot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [image]}]},
    ]
    reply = claude.messages.create(model=model, messages=shot, max_tokens=10,
                                   extra_body=GREEDY_CLAUDE)  # fmt: skip
    assert "".join(block.text for block in reply.content) == want["shot"].outputs[0].text


def test_images_a_client_gets_wrong_are_400s_that_say_what_to_change(served):
    api, claude, model, want = served
    junk = base64.b64encode(b"\x89PNG junk").decode()
    responses = {
        "corrupt": ("data:image/png;base64," + junk, "image"),
        "remote": ("https://example.com/cat.png", "--allowed-media-domains"),
        "file_id": (None, "file_id"),
    }
    for name, (url, says) in responses.items():
        part = {"type": "input_image", "image_url": url} if url else {"type": "input_image", "file_id": "file-1"}
        with pytest.raises(openai.BadRequestError, match=says):  # (each case by its name in the failure)
            api.responses.create(
                model=model, input=[{"role": "user", "content": [part]}], max_output_tokens=2, user=name
            )
    sources = {
        "corrupt": ({"type": "base64", "media_type": "image/png", "data": junk}, "image"),
        "remote": ({"type": "url", "url": "https://example.com/cat.png"}, "--allowed-media-domains"),
        "file": ({"type": "file", "file_id": "file-1"}, "base64 and url"),
        "no media type": ({"type": "base64", "data": PNG}, "media_type"),
    }
    for name, (source, says) in sources.items():
        messages = [{"role": "user", "content": [{"type": "image", "source": source}]}]
        with pytest.raises(anthropic.BadRequestError, match=says) as err:
            claude.messages.create(model=model, messages=messages, max_tokens=2, metadata={"user_id": name})
        assert err.value.body["error"]["type"] == "invalid_request_error", name
    messages = [{"role": "user", "content": [{"type": "text", "text": "Describe it."}, {"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": PNG}}]}]  # fmt: skip
    reply = claude.messages.create(model=model, messages=messages, max_tokens=10,
                                   extra_body=GREEDY_CLAUDE)  # fmt: skip
    assert "".join(block.text for block in reply.content) == want["ask"].outputs[0].text  # the server serves on
