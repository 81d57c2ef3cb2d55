"""Images through the served API (issue 58): ``nanostream serve`` of a tiny Qwen3.5 vision-language model, the official
``openai`` client sending a data-URL image (the reply is what ``LLM.chat`` gives, which test_image_engine.py holds
to transformers' tokens), ``AsyncClient.chat`` with a PIL image, ``/v1/models`` saying it takes images, and the
hostile or disallowed images a client may send: each a 400 that says what to change, the engine serving on."""

from __future__ import annotations

import base64
import io

import anyio
import numpy as np
import openai
import pytest
from helpers import served_openai
from PIL import Image

from nanostream import LLM, AsyncClient, SamplingParams
from nanostream.testing import TINY_PRESETS, make_tiny_model

pytestmark = pytest.mark.slow


def _image(h, w, seed):
    return Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype(np.uint8))


def _data_url(image, fmt="PNG"):
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def _user(*parts):
    return [{"role": "user", "content": [{"type": "text", "text": "Describe it."}, *parts]}]


def _url(url):
    return {"type": "image_url", "image_url": {"url": url}}


def test_served_images_match_the_offline_engine_and_bad_ones_are_400s(tmp_path, monkeypatch):
    path = make_tiny_model(tmp_path / "vl", **TINY_PRESETS["qwen3_5_vl"])
    image = _image(40, 56, 1)
    messages = _user(_url(_data_url(image)))
    with LLM(str(path), device="cpu", dtype="float32", kvcache_block_size=16, max_model_len=256) as llm:
        (want,) = llm.chat(messages, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    inside = tmp_path / "media"
    inside.mkdir()
    image.save(inside / "photo.png")
    # one image's rows (140 patches of 96 float32 values) fit the server's image budget, two at once do not
    extra = ("--limit-images-per-prompt", "2", "--allowed-local-media-path", str(inside), "--max-image-bytes", "60000")
    (tmp_path / "run").mkdir()
    with served_openai(path, tmp_path / "run", monkeypatch, extra) as (api, said):
        address = said[-1].split(" at ")[-1].strip()
        reply = api.chat.completions.create(model=path.name, messages=messages, max_tokens=10, temperature=0,
                                            extra_body={"ignore_eos": True})  # fmt: skip
        assert reply.choices[0].message.content == want.outputs[0].text
        assert reply.usage.prompt_tokens == len(want.prompt_token_ids)
        local = api.chat.completions.create(model=path.name, messages=_user(_url((inside / "photo.png").as_uri())),
                                            max_tokens=10, temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
        assert local.choices[0].message.content == want.outputs[0].text
        (card,) = api.models.list().data
        assert card.model_extra["input_modalities"] == ["text", "image"]
        bad = {
            "corrupt": (_user(_url("data:image/png;base64," + base64.b64encode(b"\x89PNG junk").decode())), "image"),
            "not base64": (_user(_url("data:image/png;base64,@@@")), "base64"),
            "remote": (_user(_url("https://example.com/cat.png")), "--allowed-media-domains"),
            "outside": (_user(_url((tmp_path / "vl" / "config.json").as_uri())), "--allowed-local-media-path"),
            "three": (_user(*[_url(_data_url(_image(16, 16, k))) for k in range(3)]), "at most 2 images"),
        }
        for name, (sent, says) in bad.items():
            with pytest.raises(openai.BadRequestError, match=says):  # (each case by its name in the failure)
                api.chat.completions.create(model=path.name, messages=sent, max_tokens=4, user=name)
        held = api.chat.completions.create(model=path.name, messages=messages, max_tokens=150, stream=True,
                                           extra_body={"ignore_eos": True})  # fmt: skip
        next(iter(held))  # open in the engine, its image's rows held
        with pytest.raises(openai.RateLimitError, match="max-image-bytes"):
            api.with_options(max_retries=0).chat.completions.create(model=path.name, messages=messages, max_tokens=4)
        held.close()
        again = api.chat.completions.create(model=path.name, messages=messages, max_tokens=10, temperature=0,
                                            extra_body={"ignore_eos": True})  # fmt: skip
        assert again.choices[0].message.content == want.outputs[0].text
        assert again.usage.prompt_tokens_details.cached_tokens > 0  # the image's blocks, from the prefix cache

        async def through_the_client():
            async with AsyncClient(address) as client:
                parts = [{"type": "text", "text": "Describe it."}, {"type": "image", "image": image}]
                messages = [{"role": "user", "content": parts}]
                stream = client.chat(messages, max_tokens=10, temperature=0, ignore_eos=True)
                chat = "".join([chunk.text async for chunk in stream])
                raw = "<|im_start|>user\nDescribe it.<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n"
                raw += "<|im_start|>assistant\n"  # (the template's rendering, a prompt of vLLM's dict form)
                prompt = {"prompt": raw, "multi_modal_data": {"image": image}}
                return chat, (await client.generate(prompt, max_tokens=10, temperature=0, ignore_eos=True)).text

        assert anyio.run(through_the_client) == (want.outputs[0].text, want.outputs[0].text)


def test_a_text_model_says_it_takes_no_images(tmp_path, monkeypatch):
    path = make_tiny_model(tmp_path / "text", **TINY_PRESETS["qwen3_5"])
    (tmp_path / "run").mkdir()
    with served_openai(path, tmp_path / "run", monkeypatch) as (api, _):
        with pytest.raises(openai.BadRequestError, match="takes no images"):
            api.chat.completions.create(model=path.name, messages=_user(_url(_data_url(_image(16, 16, 0)))))
        (card,) = api.models.list().data
        assert card.model_extra["input_modalities"] == ["text"]
        assert api.chat.completions.create(model=path.name, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
