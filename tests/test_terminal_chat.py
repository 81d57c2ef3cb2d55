"""``nanostream chat`` as a user at a terminal meets it: typed into a pseudo-terminal, against a real
engine (tiny model, CPU). The Up key recalls the line before, in the session and in the next one; a
\"\"\" block is one message; Ctrl-C stops a reply in the engine and, at the prompt, leaves quietly."""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import subprocess
import sys
import time

import pexpect
import pytest
from anyio.from_thread import start_blocking_portal
from helpers import wait_engine_idle

from nanostream import AsyncClient, SamplingParams
from nanostream.client.launch import EngineProcess
from nanostream.frontends.terminal_chat import CHAT_DEFAULTS, NOT_FOR_CHAT, TerminalChat, read_message
from nanostream.options import sampling_params

slow = pytest.mark.slow  # engine or chat processes: not in the fast lane

ENGINE_OPTIONS = dict(kvcache_block_size=16, device="cpu")
MAX_TOKENS = 12
UP, ENTER, CTRL_C, CTRL_D = "\x1b[A", "\r", "\x03", "\x04"


def test_every_sampling_field_is_an_option_with_the_chat_defaults():
    parser = argparse.ArgumentParser()
    TerminalChat.add_arguments(parser)
    shown = " ".join(parser.format_help().split())
    for field in dataclasses.fields(SamplingParams):  # a new field gets an option, or a reason to have none
        assert (f"--{field.name.replace('_', '-')} " in shown) != (field.name in NOT_FOR_CHAT), field.name
    assert "--max-tokens INT Most tokens to generate" in shown and "(default: 256)" in shown
    assert sampling_params(parser.parse_args([])) == SamplingParams(**CHAT_DEFAULTS)
    given = ["--temperature", "0", "--top-k", "5", "--stop", "\n\n", "--stop", "END", "--stop-token-ids", "7", "9"]
    assert sampling_params(parser.parse_args([*given, "--seed", "3", "--no-skip-special-tokens"])) == SamplingParams(
        temperature=0,
        top_p=CHAT_DEFAULTS["top_p"],
        max_tokens=CHAT_DEFAULTS["max_tokens"],
        top_k=5,
        stop=("\n\n", "END"),
        stop_token_ids=(7, 9),
        seed=3,
        skip_special_tokens=False,
    )


def test_a_block_between_triple_quotes_is_one_message():
    def reader(*lines: str):
        typed = iter(lines)

        def read(prompt: str) -> str:
            try:
                return next(typed)
            except StopIteration:  # as input() at Ctrl-D
                raise EOFError from None

        return read

    assert read_message(reader("just one line")) == "just one line"
    assert read_message(reader('"""', "first", "", "  second", '"""')) == "first\n\n  second"
    assert read_message(reader('"""first', 'second"""')) == "first\nsecond"
    assert read_message(reader('  """on one line"""  ')) == "on one line"
    with pytest.raises(EOFError):  # Ctrl-D inside a block leaves, as at the prompt
        read_message(reader('"""', "unfinished"))


@pytest.fixture(scope="module")
def engine(qwen3_dir):
    with EngineProcess(str(qwen3_dir), **ENGINE_OPTIONS) as engine:
        yield engine


@pytest.fixture(scope="module")
def greedy_reply(engine):
    """``greedy_reply(*turns)``: the reply the chat must show to the conversation (user, assistant, ..., user)."""

    async def reply(client: AsyncClient, turns: tuple[str, ...], max_tokens: int) -> str:
        messages = [{"role": ("user", "assistant")[i % 2], "content": text} for i, text in enumerate(turns)]
        return "".join([c.text async for c in client.chat(messages, temperature=0, max_tokens=max_tokens)])

    with start_blocking_portal() as portal, portal.wrap_async_context_manager(AsyncClient(engine.address)) as client:
        yield lambda *turns, max_tokens=MAX_TOKENS: portal.call(reply, client, turns, max_tokens)


def chat(address: str, state_home, *options: str) -> pexpect.spawn:
    """``nanostream chat`` on a pseudo-terminal, at its first prompt; everything it shows goes to ``.shown``."""
    child = pexpect.spawn(
        sys.executable,
        ["-m", "nanostream", "chat", "--engine", address, "--temperature", "0", *options],
        env={**os.environ, "XDG_STATE_HOME": str(state_home), "TERM": "xterm", "INPUTRC": os.devnull},
        encoding="utf-8",
        codec_errors="replace",
        dimensions=(24, 400),  # wide: readline never wraps a line
        timeout=60,
    )
    child.shown = io.StringIO()
    child.logfile_read = child.shown
    child.expect_exact("\r\n> ")
    return child


def say(child: pexpect.spawn, keys: str, until: str = "\r\n> ") -> str:
    """Type ``keys``; what the terminal shows from there to the next prompt (``until``)."""
    child.send(keys)
    child.expect_exact(until)
    return child.before.replace("\r\n", "\n")


def leave(child: pexpect.spawn, key: str) -> int:
    child.send(key)
    child.expect(pexpect.EOF)
    child.close()
    assert "Traceback" not in child.shown.getvalue()
    return child.exitstatus


@slow
def test_up_recalls_the_line_before_in_this_session_and_the_next(engine, greedy_reply, tmp_path):
    first = greedy_reply("Hello there")
    again = greedy_reply("Hello there", first, "Hello there")
    assert first != again  # else the second reply could not show that the history went with it

    child = chat(engine.address, tmp_path, "--max-tokens", str(MAX_TOKENS))
    assert say(child, "Hello there" + ENTER) == "Hello there\n" + first
    # Up draws the line before after the prompt; Enter sends it, in the same conversation.
    assert say(child, UP + ENTER) == "Hello there\n" + again
    assert leave(child, CTRL_D) == 0
    assert (tmp_path / "nanostream" / "chat_history").read_text().splitlines() == ["Hello there"]

    child = chat(engine.address, tmp_path, "--max-tokens", str(MAX_TOKENS))
    assert say(child, UP + ENTER) == "Hello there\n" + first  # a new session: a new conversation
    assert leave(child, CTRL_C) == 130


@slow
def test_a_block_of_lines_is_sent_as_one_message(engine, greedy_reply, tmp_path):
    child = chat(engine.address, tmp_path, "--max-tokens", str(MAX_TOKENS))
    assert say(child, '"""' + ENTER, until="\r\n... ") == '"""'
    assert say(child, "Hello" + ENTER, until="\r\n... ") == "Hello"
    assert say(child, 'there"""' + ENTER) == 'there"""\n' + greedy_reply("Hello\nthere")
    assert leave(child, CTRL_D) == 0


@slow
def test_ctrl_c_stops_the_reply_in_the_engine_then_leaves_at_the_prompt(engine, tmp_path):
    state_home = tmp_path / "a-file"  # no history can be written under it: the chat goes on without
    state_home.write_text("")
    child = chat(engine.address, state_home, "--max-tokens", "2000", "--ignore-eos")  # seconds of decoding
    child.send("Tell a long story" + ENTER)
    child.expect_exact("Tell a long story\r\n")
    child.expect(r"\S{5}")  # the reply streams
    start = time.monotonic()
    child.send(CTRL_C)
    child.expect_exact(" [stopped]\r\n> ", timeout=5)
    wait_engine_idle(engine.address, within=2)  # the request was aborted, not left to run
    assert time.monotonic() - start < 5
    assert leave(child, CTRL_C) == 130


@slow
def test_a_bad_sampling_value_is_one_line_before_connecting(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "nanostream", "chat", "--engine", f"ipc://{tmp_path}/nobody.sock", "--top-p", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    (line,) = out.stderr.strip().splitlines()  # said at once: no engine was waited for
    assert out.returncode == 2 and "top_p must be in (0, 1], got 0.0" in line
