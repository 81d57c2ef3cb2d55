"""Images in the Gradio chat (issue 58), against a real engine of a tiny Qwen3.5 vision-language model (CPU).

What a user of the chat relies on: the reply to an uploaded image is the model's reply to that image and text
(``LLM.chat``'s, greedy); a later turn sends the earlier images again, so the reply is to the whole conversation
and the engine's prefix cache holds the image's blocks; a broken file or too many images get a notice in the chat
in place of a reply, and the session chats on without them; images are prepared off the event loop every session
shares. (A text model's notice: test_gradio_chat.py.)
"""

from __future__ import annotations

import threading
from pathlib import Path

import anyio
import numpy as np
import pytest
from gradio_client import Client, handle_file
from helpers import run_in_thread
from PIL import Image
from test_gradio_chat import CHROMIUM, CHROMIUM_ARGS, is_notice, served, wait_for

from nanostream import LLM, AsyncClient, SamplingParams
from nanostream.client.launch import EngineProcess
from nanostream.client.shared import SharedClient
from nanostream.frontends.gradio_chat import DEFAULT_SYSTEM_PROMPT, build_app
from nanostream.frontends.gradio_history import conversation, resent_images
from nanostream.testing import TINY_PRESETS, make_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::Warning:gradio.queueing")]

MAX_TOKENS = 10
SAMPLING = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)  # ignore_eos: every reply is whole
MODEL_OPTIONS = dict(device="cpu", kvcache_block_size=16, max_model_len=512)


def picture(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype(np.uint8))


def saved(image: Image.Image, path: Path) -> Path:
    image.save(path)
    return path


def message(text: str, *files: Path) -> dict:
    """The /chat endpoint's message: the multimodal box's text and files (uploaded by gradio_client)."""
    return {"text": text, "files": [handle_file(str(f)) for f in files]}


def chat_args(text: str, *files: Path) -> tuple:
    """The /chat endpoint's inputs: message, system prompt, temperature, top-p, max tokens."""
    return message(text, *files), DEFAULT_SYSTEM_PROMPT, 0.0, 1.0, MAX_TOKENS


def turn(text: str, *images: Image.Image) -> dict:
    """A user message as the app must send it: its images, then its text."""
    parts = [{"type": "image", "image": image} for image in images]
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


def reply(text: str) -> dict:
    return {"role": "assistant", "content": text}


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("qwen3_5_vl"), **TINY_PRESETS["qwen3_5_vl"])


@pytest.fixture(scope="module")
def offline(vl_dir):
    """``LLM.chat``'s greedy reply to a conversation (the system prompt put first): what the app must show."""
    with LLM(str(vl_dir), dtype="float32", **MODEL_OPTIONS) as llm:

        def chat(*messages: dict) -> str:
            system = {"role": "system", "content": DEFAULT_SYSTEM_PROMPT}
            (out,) = llm.chat([system, *messages], SAMPLING, use_tqdm=False)
            return out.outputs[0].text

        yield chat


@pytest.fixture(scope="module")
def engine(vl_dir):
    with EngineProcess(str(vl_dir), **MODEL_OPTIONS) as eng:
        yield eng


@pytest.fixture(scope="module")
def url(engine):
    with served(build_app(engine.address, sampling=SAMPLING)) as url:
        yield url


def prefix_cache_hits(address: str) -> int:
    async def main() -> int:
        async with AsyncClient(address) as client:
            return (await client.stats()).engine.prefix_cache_hits

    return run_in_thread(main)


def test_history_with_uploads_becomes_image_parts():
    history = [
        {"role": "user", "content": [{"type": "file", "file": {"path": "/up/a.png"}}, {"type": "text", "text": "A?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "An apple."}]},  # as the browser's chatbot sends
        {"role": "user", "content": [{"path": "/up/b.png"}, {"path": "/up/c.png"}, "B and C?"]},  # an API session's
        {"role": "assistant", "content": "Two pears."},
        {"role": "user", "content": [{"path": "/up/broken.png"}, "This?"]},
        {"role": "assistant", "content": "image 1 is corrupt", "metadata": {"title": "⚠️ No reply"}},  # refused
    ]
    image = [{"type": "image", "image": Path(f"/up/{n}.png")} for n in "abcd"]
    assert conversation("Be brief.", history, {"text": "And D?", "files": ["/up/d.png"]}) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [image[0], {"type": "text", "text": "A?"}]},
        {"role": "assistant", "content": "An apple."},
        {"role": "user", "content": [image[1], image[2], {"type": "text", "text": "B and C?"}]},
        {"role": "assistant", "content": "Two pears."},
        {"role": "user", "content": [image[3], {"type": "text", "text": "And D?"}]},
    ]
    # Only an image; only text (a string, as a text chat's); a multimodal box's FileData dict.
    assert conversation("", [], {"text": "", "files": ["/up/a.png"]}) == [{"role": "user", "content": [image[0]]}]
    assert conversation("", [], {"text": "Hi", "files": []}) == [{"role": "user", "content": "Hi"}]
    assert conversation("", [], {"text": "", "files": [{"path": "/up/a.png"}]})[0]["content"] == [image[0]]
    # The images an earlier turn sends again with a new message (the refused turn's are not among them).
    assert resent_images(conversation("", history, {"text": "And D?", "files": ["/up/d.png"]})) == 3
    assert resent_images(conversation("", [], {"text": "", "files": ["/up/a.png"]})) == 0


def test_a_chat_with_images_is_prepared_off_the_event_loop():
    class Recorder:  # an AsyncClient whose chat says which thread ran it
        address = "ipc:///nowhere"

        async def connect(self) -> None:
            pass

        def chat(self, messages: list, params: SamplingParams) -> threading.Thread:
            return threading.current_thread()

    async def main() -> list[threading.Thread]:
        shared = SharedClient(Recorder)
        sent = [[{"role": "user", "content": "Hi"}], [turn("Describe it.", picture(8, 8, 0))]]
        return [(await shared.chat(messages, SAMPLING))[1] for messages in sent]

    on_text, on_images = anyio.run(main)  # (the event loop in this, the main, thread)
    assert on_text is threading.main_thread()  # text: rendered on the loop, as before
    assert on_images is not threading.main_thread()  # images: decoded and resized in a worker thread


def test_reply_to_an_uploaded_image_is_llm_chats_and_later_turns_resend_it(engine, url, offline, tmp_path):
    cat, dog = picture(40, 56, 1), picture(48, 32, 2)
    want = offline(turn("Describe it.", cat))
    assert want != offline(turn("Describe it.", dog))  # else this test could not fail

    session = Client(url, verbose=False)
    assert session.predict(*chat_args("Describe it.", saved(cat, tmp_path / "cat.png")), api_name="/chat") == want

    hits = prefix_cache_hits(engine.address)
    second = session.predict(*chat_args("And its colours?"), api_name="/chat")  # the same session: no upload now
    want_second = offline(turn("Describe it.", cat), reply(want), turn("And its colours?"))
    assert want_second != offline(turn("Describe it."), reply(want), turn("And its colours?"))
    assert second == want_second
    assert prefix_cache_hits(engine.address) - hits >= 32  # the first turn's blocks, its image's among them

    two = Client(url, verbose=False).predict(  # two images in one message, in their order
        *chat_args("Compare them.", saved(cat, tmp_path / "a.png"), saved(dog, tmp_path / "b.jpg")), api_name="/chat"
    )
    assert two == offline(turn("Compare them.", cat, Image.open(tmp_path / "b.jpg").convert("RGB")))


def test_a_broken_file_and_too_many_images_are_notices_and_the_chat_goes_on(engine, url, offline, tmp_path):
    whole = saved(picture(40, 56, 1), tmp_path / "whole.png").read_bytes()
    broken = tmp_path / "broken.png"
    broken.write_bytes(whole[: len(whole) // 2])  # an upload cut short
    many = [saved(picture(16, 16, k), tmp_path / f"{k}.png") for k in range(17)]
    session = Client(url, verbose=False)

    (notice,) = session.predict(*chat_args("Describe it.", broken), api_name="/chat")
    assert is_notice(notice, r"^This request cannot run: image 1 .*(could not be read|corrupt)"), notice
    (notice,) = session.predict(*chat_args("Describe them.", *many), api_name="/chat")
    assert is_notice(notice, r"17 images.* 16"), notice
    assert "earlier" not in notice["content"]  # (the refused upload was not kept: nothing earlier is resent)

    cat = picture(40, 56, 1)  # the refused messages are not part of the conversation
    assert session.predict(*chat_args("Describe it.", saved(cat, tmp_path / "cat.png")), api_name="/chat") == offline(
        turn("Describe it.", cat)
    )


def test_too_many_images_with_earlier_ones_says_to_clear_the_chat(url, tmp_path):
    images = [saved(picture(16, 16, k), tmp_path / f"{k}.png") for k in range(17)]
    session = Client(url, verbose=False)
    assert isinstance(session.predict(*chat_args("Describe them.", *images[:10]), api_name="/chat"), str)
    (notice,) = session.predict(*chat_args("And these?", *images[10:]), api_name="/chat")  # 7 more: 17 in all
    assert is_notice(notice, r"17 images.* 16.*\(10 of them from earlier messages.*clear the chat"), notice


@pytest.mark.skipif(not CHROMIUM.exists(), reason=f"needs Chromium at {CHROMIUM} (apt-get install -y chromium)")
def test_browser_upload_gets_the_reply_to_the_image(url, offline, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    cat = picture(40, 56, 1)
    expected = offline(turn("Describe it.", cat))
    assert expected != offline(turn("Describe it."))  # else this test could not fail
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(url)
            page.locator("input[type=file]").first.set_input_files(str(saved(cat, tmp_path / "cat.png")))
            box = page.get_by_test_id("textbox").first
            box.fill("Describe it.")
            expect(page.get_by_test_id("submit-button")).to_be_enabled()  # the upload is done
            box.press("Enter")
            bot = page.get_by_test_id("bot")
            wait_for(lambda: " ".join(bot.last.inner_text().split()) == " ".join(expected.split()), 60, "the reply")
            expect(page.get_by_test_id("user").locator("img")).to_have_count(1)  # the image shows in the chat
            page.screenshot(path=tmp_path / "chat.png")
        finally:
            browser.close()
