"""The Gradio chat app against a real engine process (tiny model, CPU), through its API and a browser.

What a user of the chat relies on: the streamed reply is the model's reply to the whole conversation
under its chat template and the chosen system prompt, sessions side by side share the engine and get
their own replies, the stop button frees the engine at once, and a dead engine gets a notice in the chat
in place of a reply while the session goes on, and replies again once the engine is back. Started with no
engine there, ``nanostream frontend gradio`` says so once on the console and in a banner on the page until
one answers; a port in use is one line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import anyio
import pytest
from gradio_client import Client, handle_file
from helpers import run_in_thread, wait_engine_idle

from nanostream import AsyncClient, SamplingParams
from nanostream.client import ADDRESS_ENV
from nanostream.client.launch import EngineProcess
from nanostream.frontends import load
from nanostream.frontends.gradio_chat import DEFAULT_SYSTEM_PROMPT, NOTICE_TITLE, GradioChat, build_app, conversation

# Gradio's queue calls pandas in ways pandas 3 deprecates: nothing this test or the app can change.
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::Warning:gradio.queueing")]

ENGINE_OPTIONS = dict(kvcache_block_size=16, device="cpu")
GREEDY = SamplingParams(temperature=0, max_tokens=24)  # the test apps' slider defaults
PIRATE = "You are a pirate. Answer like one."
LONG_TOKENS = 2000  # seconds of decoding on CPU unless aborted
ABORT_WITHIN = 1.5  # seconds from cancel to an idle engine
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chat_args(message: str, system: str = DEFAULT_SYSTEM_PROMPT, max_tokens: int = GREEDY.max_tokens) -> tuple:
    """The /chat endpoint's inputs: message (the multimodal box's text, no files), system prompt, temperature,
    top-p, max tokens."""
    return {"text": message, "files": []}, system, 0.0, 1.0, max_tokens


def conv(message: str, system: str = DEFAULT_SYSTEM_PROMPT, history: tuple[str, ...] = ()) -> list[dict[str, str]]:
    turns = [{"role": role, "content": text} for role, text in zip(["user", "assistant"] * len(history), history)]
    return [{"role": "system", "content": system}, *turns, {"role": "user", "content": message}]


def greedy_replies(address: str, conversations: list[list[dict]], max_tokens: int = GREEDY.max_tokens) -> list[str]:
    """``AsyncClient.chat``'s greedy reply to each conversation: what the app must show."""

    async def main() -> list[str]:
        async with AsyncClient(address) as client:

            async def one(messages: list[dict]) -> str:
                return "".join([c.text async for c in client.chat(messages, temperature=0, max_tokens=max_tokens)])

            return list(await asyncio.gather(*map(one, conversations)))

    return run_in_thread(main)


def running_requests(address: str) -> int:
    async def main() -> int:
        async with AsyncClient(address) as client:
            return (await client.stats()).running

    return run_in_thread(main)


def wait_for(condition, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {within} s")
        time.sleep(0.02)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def served(app):
    """The app's local URL while it is served (in Gradio's own thread and event loop)."""
    _, url, _ = app.launch(server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True)
    try:
        yield url
    finally:
        app.close(verbose=False)


@pytest.fixture(scope="module")
def engine(qwen3_dir):
    with EngineProcess(str(qwen3_dir), **ENGINE_OPTIONS) as eng:
        # One client connects before any test: transformers' lazy imports are not thread-safe, and a
        # test's AsyncClient and the app's, loading their tokenizers at once, can fail the first import.
        greedy_replies(eng.address, [])
        yield eng


@pytest.fixture(scope="module")
def url(engine):
    with served(build_app(engine.address, sampling=GREEDY)) as url:
        yield url


def test_conversation_from_gradio_history():
    notice = {"role": "assistant", "content": "engine down", "metadata": {"title": NOTICE_TITLE}}
    history = [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},  # as the browser's chatbot sends it
        {"role": "assistant", "content": "Hello!"},  # as an API session's state holds it
        {"role": "user", "content": "Are you there?"},
        notice,  # no reply: the user was asked to send it again
        {"role": "user", "content": [{"type": "file", "file": {"path": "/tmp/x.png"}}]},
        {"role": "assistant", "content": "Half a rep"},
        notice,  # the engine died mid-reply: the partial reply stays
    ]
    assert conversation("Be brief.", history, "Again?") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": [{"type": "image", "image": Path("/tmp/x.png")}]},  # (test_gradio_images.py)
        {"role": "assistant", "content": "Half a rep"},
        {"role": "user", "content": "Again?"},
    ]
    assert conversation("  ", [], "Hi") == [{"role": "user", "content": "Hi"}]  # no system prompt
    assert conversation("", [], {"text": "Hi", "files": []}) == [{"role": "user", "content": "Hi"}]  # the box's


def test_registered_frontend_and_its_options(monkeypatch):
    assert load("gradio") is GradioChat
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine")
    GradioChat.add_arguments(parser)
    args = parser.parse_args(["--port", "8123", "--host", "0.0.0.0"])
    assert (args.port, args.host, args.engine, args.engine_wait) == (8123, "0.0.0.0", None, 60)
    monkeypatch.delenv(ADDRESS_ENV, raising=False)
    args.engine_wait = 0  # no waiting for an engine to be announced
    with pytest.raises(ValueError, match=ADDRESS_ENV):  # no address anywhere: says what to set, serves nothing
        GradioChat().run(args)


def test_reply_is_the_greedy_chat_reply_with_system_prompt_and_history(engine, url):
    first = Client(url, verbose=False)
    job = first.submit(*chat_args("Hello there!"), api_name="/chat")
    reply = job.result(timeout=30)
    streamed = job.outputs()
    second_reply = first.predict(*chat_args("And then?"), api_name="/chat")  # same session: the history counts
    pirate_reply = Client(url, verbose=False).predict(*chat_args("Hello there!", PIRATE), api_name="/chat")

    ref, ref_pirate = greedy_replies(engine.address, [conv("Hello there!"), conv("Hello there!", PIRATE)])
    ref_second, ref_forgetful = greedy_replies(
        engine.address, [conv("And then?", history=("Hello there!", ref)), conv("And then?")]
    )
    assert ref and ref != ref_pirate and ref_second != ref_forgetful  # else this test could not fail
    assert reply == ref
    assert all(ref.startswith(part) for part in streamed)  # the growing reply (in several parts: see the next tests)
    assert pirate_reply == ref_pirate
    assert second_reply == ref_second


def test_an_image_to_a_text_model_is_a_notice_and_left_out_of_the_conversation(engine, url, tmp_path):
    from PIL import Image

    Image.new("RGB", (16, 16), "red").save(tmp_path / "red.png")
    client = Client(url, verbose=False)
    upload = {"text": "What colour is it?", "files": [handle_file(str(tmp_path / "red.png"))]}
    (notice,) = client.predict(upload, *chat_args("")[1:], api_name="/chat")
    assert is_notice(notice, "^This request cannot run: this model takes no images.*send the message as text")
    reply = client.predict(*chat_args("Hello there!"), api_name="/chat")  # the session goes on, without it
    assert reply == greedy_replies(engine.address, [conv("Hello there!")])[0]


def test_two_sessions_at_once_each_get_their_own_reply(engine, url):
    messages, max_tokens = ["Once upon a time", "Tell a long story."], 400  # over a second each
    sessions = [Client(url, verbose=False) for _ in messages]
    jobs = [s.submit(*chat_args(m, max_tokens=max_tokens), api_name="/chat") for s, m in zip(sessions, messages)]

    async def most_running() -> int:  # how many requests the engine ran at once while the jobs ran
        async with AsyncClient(engine.address) as client:
            most = 0
            while not all(job.done() for job in jobs):
                most = max(most, (await client.stats()).running)
                await anyio.sleep(0.02)
            return most

    most = run_in_thread(most_running)
    replies = [job.result(timeout=30) for job in jobs]
    assert replies == greedy_replies(engine.address, [conv(m) for m in messages], max_tokens)
    assert replies[0] != replies[1]
    assert most == 2


def test_cancelling_the_reply_aborts_it_in_the_engine(engine, url):
    client = Client(url, verbose=False)
    job = client.submit(*chat_args("Tell a long story.", max_tokens=LONG_TOKENS), api_name="/chat")
    wait_for(lambda: len(job.outputs()) >= 3, 30, "the reply streams")
    assert running_requests(engine.address) == 1
    parts = job.outputs()
    start = time.monotonic()
    job.cancel()  # what the stop button does: POST /cancel for this session's running event
    wait_engine_idle(engine.address, ABORT_WITHIN)
    assert time.monotonic() - start < ABORT_WITHIN + 1
    assert all(b.startswith(a) and len(b) > len(a) for a, b in itertools.pairwise(parts)), parts  # streamed
    # The shared AsyncClient is unharmed: a new session gets its reply.
    assert (
        Client(url, verbose=False).predict(*chat_args("Hello there!"), api_name="/chat")
        == greedy_replies(engine.address, [conv("Hello there!")])[0]
    )


def is_notice(reply, pattern: str) -> bool:
    """``reply`` (one message of the /chat response) is the app's notice, and its text matches ``pattern``."""
    return (
        isinstance(reply, dict)
        and reply["metadata"]["title"] == NOTICE_TITLE
        and bool(re.search(pattern, reply["content"]))
    )


def test_engine_down_shows_a_notice_and_the_app_reconnects(qwen3_dir):
    address = f"ipc://{tempfile.mkdtemp(prefix='ns-')}/engine.sock"  # short: ipc paths are limited to ~100 bytes
    app = build_app(lambda: AsyncClient(address, timeout=2), sampling=GREEDY)
    with served(app) as url:
        client = Client(url, verbose=False)
        start = time.monotonic()
        (notice,) = client.predict(*chat_args("Hello there!"), api_name="/chat")
        assert time.monotonic() - start < 10
        assert is_notice(notice, f"engine at {re.escape(address)} is not answering.*`nanostream serve")

        with EngineProcess(str(qwen3_dir), address=address, heartbeat_interval=0.25, **ENGINE_OPTIONS) as eng:
            # The same session chats on, and the unanswered message is not part of the conversation.
            reply = client.predict(*chat_args("Hello there!"), api_name="/chat")
            assert reply == greedy_replies(eng.address, [conv("Hello there!")])[0]
            job = client.submit(*chat_args("Tell a long story.", max_tokens=LONG_TOKENS), api_name="/chat")
            wait_for(lambda: len(job.outputs()) >= 3, 30, "the reply streams")
            eng.stop()  # the engine shuts down under the stream
        partial, notice = job.result(timeout=10)
        assert isinstance(partial, str) and partial
        assert is_notice(notice, "is not answering.*(shut down|shutting down)")


@pytest.mark.skipif(not CHROMIUM.exists(), reason=f"needs Chromium at {CHROMIUM} (apt-get install -y chromium)")
def test_browser_chat_streams_the_reply_and_stops(engine, url, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    expected = greedy_replies(engine.address, [conv("Hello there!")])[0]
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            fetched: list[str] = []
            page.on("request", lambda request: fetched.append(request.url))
            page.goto(url)
            page.get_by_role("button", name=re.compile(r"^Settings\W*$")).click()  # the accordion, not the footer's
            box = page.get_by_test_id("textbox").first  # the message box (the system prompt's is the other)
            box.fill("Hello there!")
            box.press("Enter")
            bot = page.get_by_test_id("bot")
            wait_for(lambda: " ".join(bot.last.inner_text().split()) == " ".join(expected.split()), 30, "the reply")
            shot = tmp_path / "chat.png"
            page.screenshot(path=shot)
            expect(box).to_be_enabled()  # the turn is over

            # A long reply, then the stop button.
            page.get_by_label("range slider for Max tokens").fill(str(LONG_TOKENS))
            expect(page.get_by_label("number input for Max tokens")).to_have_value(str(LONG_TOKENS))
            box.fill("Tell a long story.")
            box.press("Enter")
            wait_for(lambda: bot.count() == 2 and len(bot.last.inner_text()) > 20, 30, "the long reply streams")
            assert running_requests(engine.address) == 1, f"not running: {bot.last.inner_text()!r}"
            page.locator("button.stop-button").click()
            wait_engine_idle(engine.address, ABORT_WITHIN)
            expect(page.get_by_test_id("submit-button")).to_be_visible()
        finally:
            browser.close()

    assert shot.read_bytes().startswith(b"\x89PNG") and shot.stat().st_size > 10_000
    offsite = [u for u in fetched if not u.startswith((url, "data:", "blob:"))]
    assert not offsite, f"the page fetched from elsewhere: {offsite}"


def frontend_command(address: str, port: int) -> list[str]:
    return [sys.executable, "-m", "nanostream", "frontend", "gradio", "--engine", address, "--port", str(port)]


def test_a_port_in_use_is_one_line_and_exit_code_2(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            frontend_command(f"ipc://{tmp_path}/engine.sock", port), capture_output=True, text=True, timeout=120
        )
    assert out.returncode == 2
    (line,) = (out.stdout + out.stderr).strip().splitlines()
    assert line.endswith(f"port {port} is in use: pass --port")


def test_started_with_no_engine_it_says_so_once_then_chats_when_one_answers(qwen3_dir):
    address = f"ipc://{tempfile.mkdtemp(prefix='ns-')}/engine.sock"
    port = free_port()
    proc = subprocess.Popen(
        frontend_command(address, port),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(line.rstrip("\n") for line in proc.stdout), daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{port}/"
    try:
        wait_for(lambda: any("waiting" in line for line in lines) or proc.poll() is not None, 60, "a notice")
        assert lines[:2] == [
            f"nanostream gradio chat at {url} on the engine at {address} (Ctrl-C stops it)",
            f"nanostream frontend gradio: waiting up to 60 s for the engine at {address}",
        ]
        client = Client(url, verbose=False)
        banner = client.predict(api_name="/engine_status")  # what the page shows when it loads, and every 5 s
        assert banner["visible"] and f"The engine at {address} is not answering" in banner["value"]

        with EngineProcess(str(qwen3_dir), address=address, **ENGINE_OPTIONS) as eng:
            wait_for(lambda: not client.predict(api_name="/engine_status")["visible"], 30, "the banner goes")
            reply = client.predict(*chat_args("Hello there!"), api_name="/chat")
            assert reply == greedy_replies(eng.address, [conv("Hello there!")])[0]
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(30)
        reader.join(5)
    assert code == 130  # Ctrl-C, as a shell counts it
    shown = "\n".join(lines)
    assert sum("waiting" in line for line in lines) == 1, shown  # said once, not per page or check
    assert "share=True" not in shown and "httpx" not in shown and "Traceback" not in shown, shown


def test_with_no_engine_within_engine_wait_it_exits_with_one_line(tmp_path):
    address = f"ipc://{tmp_path}/engine.sock"
    out = subprocess.run(
        [*frontend_command(address, free_port()), "--engine-wait", "1"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 1
    assert (out.stdout + out.stderr).strip().splitlines()[-1] == (
        f"nanostream frontend gradio: no engine answers at {address} within 1 s (--engine-wait): "
        "start one with `nanostream serve`, or pass its --engine ADDR"
    )


@pytest.mark.skipif(not CHROMIUM.exists(), reason=f"needs Chromium at {CHROMIUM} (apt-get install -y chromium)")
def test_browser_banner_shows_while_no_engine_answers_and_goes_when_one_does(qwen3_dir):
    from playwright.sync_api import expect, sync_playwright

    address = f"ipc://{tempfile.mkdtemp(prefix='ns-')}/engine.sock"
    with served(build_app(lambda: AsyncClient(address, timeout=2), sampling=GREEDY)) as url, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(url)
            banner = page.locator("#engine-status")
            expect(banner).to_contain_text(f"The engine at {address} is not answering", timeout=15_000)
            expect(banner).to_contain_text(f"nanostream serve MODEL --address {address}")
            with EngineProcess(str(qwen3_dir), address=address, **ENGINE_OPTIONS):
                expect(banner).to_be_hidden(timeout=30_000)  # the page's next check, with no reload
        finally:
            browser.close()
