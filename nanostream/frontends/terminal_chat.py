"""Terminal chat: ``nanostream chat [--engine ADDR]`` streams replies token by token, with the history.

Type a message and press Enter. ``/reset`` forgets the conversation, ``/exit`` (or Ctrl-D) leaves.
Ctrl-C while a reply streams stops it (the engine drops the request at once); Ctrl-C at the prompt
leaves.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import anyio

from nanostream.errors import ConnectionLostError, EngineDeadError, InvalidRequestError, NanostreamError
from nanostream.frontends import Frontend


class TerminalChat(Frontend):
    description = "chat in the terminal, replies streamed token by token"

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--system", help="system prompt")
        parser.add_argument("--max-tokens", type=int, default=256, help="most tokens per reply (default: 256)")
        parser.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (default: 0.7)")
        parser.add_argument("--top-p", type=float, default=0.95, help="(default: 0.95)")

    def run(self, args: argparse.Namespace) -> int:
        try:
            return anyio.run(self._chat, args)
        except KeyboardInterrupt:
            print()
            return 0

    async def _chat(self, args: argparse.Namespace) -> int:
        from nanostream.client import AsyncClient

        sampling = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)
        system = [{"role": "system", "content": args.system}] if args.system else []
        history: list[dict[str, str]] = []
        async with AsyncClient(args.engine) as client:
            print(f"nanostream chat with {client.model} at {client.address} (/reset, /exit)", flush=True)
            while True:
                line = await anyio.to_thread.run_sync(_read_line)
                if line is None or line.strip() == "/exit":
                    return 0
                if line.strip() == "/reset":
                    history.clear()
                    print("(conversation forgotten)", flush=True)
                    continue
                if not line.strip():
                    continue
                history.append({"role": "user", "content": line})
                reply = await self._reply(client, system + history, sampling)
                if reply is None:  # interrupted or refused: the message gets no answer
                    history.pop()
                else:
                    history.append({"role": "assistant", "content": reply})

    async def _reply(self, client, messages: list[dict[str, str]], sampling: dict) -> str | None:
        parts: list[str] = []
        loop = asyncio.get_running_loop()
        try:
            with anyio.CancelScope() as scope:
                loop.add_signal_handler(signal.SIGINT, scope.cancel)  # Ctrl-C stops this reply only
                async with client.chat(messages, **sampling) as stream:
                    async for chunk in stream:
                        parts.append(chunk.text)
                        print(chunk.text, end="", flush=True)
        except InvalidRequestError as exc:
            print(f"\n[refused: {exc}]", flush=True)
            return None
        except ConnectionLostError as exc:  # the client registers again: the next message may run
            print(f"\n[the connection to the engine was lost: {exc}]", file=sys.stderr, flush=True)
            return None
        except EngineDeadError as exc:
            print(f"\n[the engine is not answering: {exc}]", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        except NanostreamError as exc:  # busy, timed out, or failed in the engine
            print(f"\n[not finished: {exc}]", flush=True)
            return None
        finally:
            loop.remove_signal_handler(signal.SIGINT)  # back to Ctrl-C = leave
        if scope.cancelled_caught:  # leaving the stream aborted the request in the engine
            print(" [stopped]", flush=True)
            return None
        print(flush=True)
        return "".join(parts)


def _read_line() -> str | None:
    try:
        return input("> ")
    except EOFError:
        return None
