"""Terminal chat: ``nanostream chat [--engine ADDR] [--system TEXT] [sampling options]``.

Replies stream token by token; the conversation so far goes with each message. See ``USAGE`` (also
the command's ``--help``) for the keys and commands.

The event loop (the client's connection, the streams) runs in a thread of its own, so that the main
thread can sit in ``input()``: there GNU readline edits the line and Ctrl-C arrives, both of which
need the main thread.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.abc
from anyio.from_thread import BlockingPortal, start_blocking_portal

from nanostream.client import AsyncClient
from nanostream.errors import ConnectionLostError, EngineDeadError, InvalidRequestError, NanostreamError
from nanostream.frontends import Frontend
from nanostream.frontends.engine_wait import EngineWait, add_engine_wait_argument
from nanostream.options import add_sampling_args, field_docs, sampling_params
from nanostream.sampling_params import SamplingParams

PROMPT, MORE = "> ", "... "
BLOCK = '"""'
HISTORY_LINES = 1000

USAGE = f"""\
Type a message and press Enter. A message of several lines starts with {BLOCK} and ends with a line
that ends with {BLOCK}. Up and Down recall earlier lines, also those of earlier sessions (kept in
$XDG_STATE_HOME/nanostream/chat_history, by default ~/.local/state/nanostream/chat_history).

/reset forgets the conversation. Ctrl-C while a reply streams stops it (the engine drops the request
at once). /exit or Ctrl-D at the prompt leaves with exit code 0, Ctrl-C with 130."""

CHAT_DEFAULTS = {"temperature": 0.7, "top_p": 0.95, "max_tokens": 256}
"""Where the chat's sampling defaults differ from SamplingParams's (its 16 tokens are short for a reply)."""
NOT_FOR_CHAT = ("n", "logprobs", "prompt_logprobs")
"""SamplingParams fields the chat takes no option for: it shows one reply, without log-probabilities."""


def add_chat_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """The sampling options of ``nanostream generate`` (one per SamplingParams field, described by its
    docstring), with the chat's own defaults for those in ``CHAT_DEFAULTS``."""
    docs = field_docs(SamplingParams)
    group = parser.add_argument_group("sampling options (the chat's defaults)")
    for name, value in CHAT_DEFAULTS.items():
        kind = type(value)
        group.add_argument(
            "--" + name.replace("_", "-"),
            dest="sampling_" + name,  # where add_sampling_args puts the others: sampling_params reads them all
            type=kind,
            default=value,
            metavar=kind.__name__.upper(),
            help=f"{docs[name]} (default: {value})",
        )
    add_sampling_args(parser, skip=(*CHAT_DEFAULTS, *NOT_FOR_CHAT))


def read_message(read: Callable[[str], str] = input) -> str:
    """One message: a line, or the lines of a ``\"\"\"`` block without its markers. EOFError and
    KeyboardInterrupt from ``read`` pass through."""
    line = read(PROMPT)
    if not line.lstrip().startswith(BLOCK):
        return line
    text = line.lstrip()[len(BLOCK) :]
    lines = []
    while not text.rstrip().endswith(BLOCK):
        lines.append(text)
        text = read(MORE)
    lines.append(text.rstrip()[: -len(BLOCK)])
    if lines[0] == "":  # the block opened on a line of its own
        lines.pop(0)
    if lines and lines[-1] == "":  # and closed on one
        lines.pop()
    return "\n".join(lines)


def history_path() -> Path:
    """Where the chat keeps the lines typed (the XDG base directory spec's state directory)."""
    state = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(state) / "nanostream" / "chat_history"


@contextlib.contextmanager
def line_editing(path: Path):
    """Line editing and history for ``input()`` while inside: the lines of earlier sessions are read
    from ``path`` and this session's are added to it at the end. A file that cannot be read or written
    is no error: the chat goes on without it."""
    try:
        import readline
    except ImportError:  # a Python built without it: input() still reads lines
        yield
        return
    readline.set_history_length(HISTORY_LINES)
    with contextlib.suppress(OSError):
        readline.read_history_file(path)
    before = readline.get_current_history_length()
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.exists():  # appended, so that chats at once keep each other's lines
                readline.append_history_file(readline.get_current_history_length() - before, path)
            else:
                readline.write_history_file(path)


class TerminalChat(Frontend):
    description = "chat in the terminal, replies streamed token by token"

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        parser.formatter_class = argparse.RawDescriptionHelpFormatter
        parser.epilog = USAGE
        parser.add_argument("--system", metavar="TEXT", help="system prompt (default: none)")
        add_engine_wait_argument(parser)
        add_chat_sampling_arguments(parser)

    def run(self, args: argparse.Namespace) -> int:
        sampling = sampling_params(args)  # before connecting: a bad value is the first thing said
        wait = EngineWait(args.engine, args.engine_wait, "nanostream chat")
        try:
            address = anyio.run(wait.find)
            if not anyio.run(wait.until_reachable, address):  # said now, rather than after the client's timeout
                raise EngineDeadError(wait.no_engine(address))
        except KeyboardInterrupt:  # while waiting
            print(file=sys.stderr)
            return 130
        client = AsyncClient(address)
        interactive = sys.stdin.isatty() and sys.stdout.isatty()
        try:
            with (
                line_editing(history_path()) if interactive else contextlib.nullcontext(),
                start_blocking_portal() as portal,
                portal.wrap_async_context_manager(client),
            ):
                print(f"nanostream chat with {client.model} at {client.address}", flush=True)
                print(f"({BLOCK} starts and ends a message of several lines; /reset, /exit)", flush=True)
                return self._chat(portal, client, args.system, sampling)
        except KeyboardInterrupt:  # while connecting
            print(file=sys.stderr)
            return 130

    def _chat(self, portal: BlockingPortal, client: AsyncClient, system: str | None, sampling: SamplingParams) -> int:
        conversation = [{"role": "system", "content": system}] if system else []
        while True:
            try:
                message = read_message()
            except EOFError:  # Ctrl-D
                print(flush=True)
                return 0
            except KeyboardInterrupt:  # Ctrl-C, as a shell counts it
                print(flush=True)
                return 130
            if message.strip() == "/exit":
                return 0
            if message.strip() == "/reset":
                del conversation[1 if system else 0 :]
                print("(conversation forgotten)", flush=True)
                continue
            if not message.strip():
                continue
            conversation.append({"role": "user", "content": message})
            try:
                reply = self._reply(portal, client, conversation, sampling)
            except EngineDeadError as exc:  # for good: a lost connection comes back on its own (see _stream_reply)
                print(f"\n[the engine is not answering: {exc}]", file=sys.stderr, flush=True)
                return 1
            if reply is None:  # stopped or refused: the message gets no answer
                conversation.pop()
            else:
                conversation.append({"role": "assistant", "content": reply})

    def _reply(
        self, portal: BlockingPortal, client: AsyncClient, messages: list[dict[str, str]], sampling: SamplingParams
    ) -> str | None:
        """Stream one reply, in the loop's thread; Ctrl-C meanwhile stops it. Returns the reply, or
        None if it has none."""
        done, scope = portal.start_task(_stream_reply, client, messages, sampling)
        while True:
            try:
                return done.result()
            except KeyboardInterrupt:  # leaving the stream aborts the request in the engine
                portal.call(scope.cancel)


async def _stream_reply(
    client: AsyncClient,
    messages: list[dict[str, str]],
    sampling: SamplingParams,
    *,
    task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED,
) -> str | None:
    parts: list[str] = []
    with anyio.CancelScope() as scope:
        task_status.started(scope)
        try:
            async with client.chat(messages, sampling) as stream:
                async for chunk in stream:
                    parts.append(chunk.text)
                    print(chunk.text, end="", flush=True)
        except InvalidRequestError as exc:
            print(f"\n[refused: {exc}]", flush=True)
            return None
        except ConnectionLostError as exc:  # the client registers again: the next message may run
            print(f"\n[the connection to the engine was lost: {exc}]", file=sys.stderr, flush=True)
            return None
        except EngineDeadError:
            raise
        except NanostreamError as exc:  # busy, timed out, or failed in the engine
            print(f"\n[not finished: {exc}]", flush=True)
            return None
    if scope.cancelled_caught:
        print(" [stopped]", flush=True)
        return None
    print(flush=True)
    return "".join(parts)
