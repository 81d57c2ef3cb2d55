"""A browser chat on an engine: Gradio's ChatInterface over one shared ``AsyncClient``.

    nanostream frontend gradio --engine ipc:///run/nanostream.sock [--host HOST] [--port PORT]

or, from Python::

    app = build_app("ipc:///run/nanostream.sock", title="My model")
    app.launch()

Every browser session of the app shares one ``AsyncClient`` (so one engine connection serves them
all); replies stream token by token with the model's chat template applied to the whole
conversation, and the stop button aborts the request in the engine at once. Images attached to a
message go with it to a vision-language model, and again with every later turn (gradio_history.py);
a model that takes none answers with a notice in the chat. When the engine is not answering, a
banner above the chat says so (checked when the page loads and every few seconds) and so does the
chat in place of a reply; the next message reconnects.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import errno
import functools
import logging
import os
import socket
import sys
import threading
from collections.abc import AsyncIterator
from typing import Any

import anyio
import gradio as gr

from nanostream.client import ADDRESS_ENV, AsyncClient
from nanostream.client.shared import ClientFactory, SharedClient
from nanostream.client.stream import Stream
from nanostream.discovery import discover
from nanostream.errors import EngineDeadError, InvalidRequestError, NanostreamError
from nanostream.frontends import Frontend
from nanostream.frontends.engine_wait import EngineWait, add_engine_wait_argument
from nanostream.frontends.gradio_history import NOTICE_TITLE, conversation, resent_images
from nanostream.sampling_params import SamplingParams

log = logging.getLogger(__name__)

DEFAULT_TITLE = "nanostream chat"
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
DEFAULT_SAMPLING = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=512)
MAX_TOKENS_SLIDER = 4096  # the slider's top; a reply is also cut to what the model's context has room for
STATUS_EVERY = 5.0
"""Seconds between a page's checks of the engine (the banner comes or goes with the next one)."""
STATUS_WAIT = 3.0
"""Seconds a check waits for the engine's answer before the banner says it is not answering."""


def _not_answering(address: str, exc: BaseException) -> str:
    return (
        f"The nanostream engine at {address} is not answering ({exc}). Start it with "
        f"`nanostream serve MODEL --address {address}`, then send your message again: the chat reconnects."
    )


def engine_address(engine: str | None) -> str:
    """``engine``, else ``NANOSTREAM_ADDRESS``, else the one local engine (ValueError saying what to do if none)."""
    return engine or os.environ.get(ADDRESS_ENV) or discover()


def _engine_down(address: str, exc: BaseException | None) -> str:
    """One line: what is wrong with the engine at ``address``, and what to do if that is clear."""
    if exc is None or isinstance(exc, (EngineDeadError, asyncio.TimeoutError)):  # nobody there, or no answer
        return f"the engine at {address} is not answering: start it with `nanostream serve MODEL --address {address}`"
    return f"the engine at {address} cannot be used: {exc}"  # it refused this client: its message says why


def _resent_hint(messages: list[dict[str, Any]], exc: Exception) -> str:
    """For a refusal that counts images (too many, or none taken): the earlier messages' among them, if any."""
    n = resent_images(messages)
    if not n or "images" not in str(exc):  # ("holds 17 images", "at most 16 images", "takes no images")
        return ""
    return f" ({n} of them from earlier messages, which go with every message: clear the chat to leave them out)"


def _with_notice(text: str, notice: str) -> list:
    """The reply so far, then ``notice`` as a titled message (which ``conversation`` leaves out)."""
    message = gr.ChatMessage(content=notice, metadata={"title": NOTICE_TITLE})
    return [text, message] if text else [message]


def build_app(
    engine: str | ClientFactory | None = None,
    *,
    title: str = DEFAULT_TITLE,
    system_prompt: str = DEFAULT_SYSTEM_PROMPT,
    sampling: SamplingParams = DEFAULT_SAMPLING,
) -> gr.Blocks:
    """A Gradio chat app on the engine at ``engine`` (an address, or a factory of unconnected clients).

    ``engine=None`` reads ``NANOSTREAM_ADDRESS``, else takes the one local engine (``nanostream serve``
    records its address where local clients look). The system prompt box and the temperature, top-p and
    max-tokens sliders start at ``system_prompt`` and ``sampling``'s values; ``sampling``'s other
    fields (top_k, stop, penalties, ...) apply to every reply. Example::

        build_app("ipc:///run/nanostream.sock", sampling=SamplingParams(temperature=0, max_tokens=256)).launch()
    """
    if engine is None or isinstance(engine, str):
        engine = functools.partial(AsyncClient, engine_address(engine))
    shared = SharedClient(engine)

    async def respond(
        message: dict[str, Any],
        history: list[dict[str, Any]],
        system: str,
        temperature: float,
        top_p: float,
        max_tokens: float,
    ) -> AsyncIterator[str | list]:
        messages = conversation(system, history, message)
        text = ""
        try:
            params = dataclasses.replace(sampling, temperature=temperature, top_p=top_p, max_tokens=int(max_tokens))
            client, stream = await shared.chat(messages, params)
            prompt_len = len(stream.prompt_token_ids)
            room = client.max_model_len - prompt_len
            if room < 1:
                raise InvalidRequestError(
                    f"the conversation ({prompt_len} tokens) fills the model's context ({client.max_model_len} "
                    "tokens): clear it to go on"
                )
            if params.max_tokens > room:  # not started yet: replacing it sends nothing to the engine
                params = dataclasses.replace(params, max_tokens=room)  # (its images are not prepared again)
                stream = Stream(client.connection, stream.prompt_token_ids, params, images=stream.images)
            # Leaving this block early (the stop button: Gradio cancels the task running this generator,
            # or closes the generator) aborts the request in the engine.
            async with stream:
                async for chunk in stream:
                    if chunk.text:  # not for tokens that add no text yet (a partial character, a special token)
                        text += chunk.text
                        yield text
            if not text:
                yield text  # an empty reply still ends the turn
        # Errors go into the chat, not into gr.Error: after a gr.Error, ChatInterface leaves the
        # textbox disabled, and the user could not send again once the engine is back.
        except EngineDeadError as exc:
            log.warning("%s", exc)
            yield _with_notice(text, _not_answering(shared.address, exc))
        # InvalidRequestError from the engine; an ImageError (a broken file, too many images, a text-only model);
        # sampling values from an API call.
        except ValueError as exc:
            yield _with_notice(text, f"This request cannot run: {exc}{_resent_hint(messages, exc)}")
        except NanostreamError as exc:  # busy, timed out or failed in the engine: the next message may run
            yield _with_notice(text, f"The engine did not finish this reply: {exc}")

    async def engine_status() -> gr.Markdown:
        """The banner: hidden while the engine answers, saying what to do while it does not. (It
        connects the shared client too, so that a page's first message does not wait for that.)"""
        try:
            client = await asyncio.wait_for(shared.get(), STATUS_WAIT)  # (a connection under way goes on)
            await asyncio.wait_for(client.stats(), STATUS_WAIT)
        except (NanostreamError, asyncio.TimeoutError) as exc:
            text = _engine_down(shared.address, exc)
            return gr.Markdown(f"⚠️ **{text[0].upper()}{text[1:]}**; this notice goes once it answers", visible=True)
        return gr.Markdown("", visible=False)

    with gr.Blocks(title=title, fill_height=True, analytics_enabled=False) as app:
        banner = gr.Markdown(visible=False, elem_id="engine-status")
        settings = [  # render=False: ChatInterface places them (else they would show here, above the chat)
            gr.Textbox(system_prompt, label="System prompt", lines=2, render=False),
            gr.Slider(0.0, 2.0, value=sampling.temperature, step=0.05, label="Temperature (0: greedy)", render=False),
            gr.Slider(0.05, 1.0, value=sampling.top_p, step=0.05, label="Top-p", render=False),
            gr.Slider(
                1,
                max(MAX_TOKENS_SLIDER, sampling.max_tokens or 0),
                value=sampling.max_tokens or 512,
                step=1,
                label="Max tokens",
                render=False,
            ),
        ]
        gr.ChatInterface(
            respond,
            multimodal=True,
            textbox=message_box(),
            title=title,
            additional_inputs=settings,
            additional_inputs_accordion=gr.Accordion("Settings", open=False, render=False),
            concurrency_limit=None,  # every session streams at once: the engine batches them
            flagging_mode="never",
            analytics_enabled=False,  # Gradio would report usage to its servers (and check for updates)
            api_name="chat",
        )
        check = dict(fn=engine_status, outputs=banner, queue=False, show_progress="hidden")
        app.load(**check, api_name="engine_status", api_visibility="undocumented")
        gr.Timer(STATUS_EVERY).tick(**check, api_visibility="private")
    return app


def message_box() -> gr.MultimodalTextbox:
    """The message box: text, and images to attach (its clip button). A model that takes no images gets
    the same box, since the page is built before the engine answers and another engine may answer after a
    reconnection: an image sent to it gets a notice that the model takes none (as Open WebUI refuses one for
    a model without vision), and that message is left out of the conversation."""
    return gr.MultimodalTextbox(
        placeholder="Type a message, or attach images",
        file_types=["image"],
        file_count="multiple",
        sources=["upload"],
        submit_btn=True,
        stop_btn=True,
        autofocus=True,
        scale=7,
    )


class GradioChat(Frontend):
    """``nanostream frontend gradio``: the browser chat, served until Ctrl-C."""

    description = "browser chat (Gradio): streaming replies, system prompt, sampling sliders, stop button"

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        parser.epilog = (
            "While the engine is not answering, a banner on the page says so (checked when a page loads and every "
            f"{STATUS_EVERY:g} s); the chat connects when the engine answers. At start the console says once what it "
            "waits for, and the command exits if no engine answers within --engine-wait."
        )
        parser.add_argument("--host", help="interface to serve on (default: $GRADIO_SERVER_NAME or 127.0.0.1)")
        parser.add_argument(
            "--port",
            type=int,
            help="port to serve on, which must be free (default: $GRADIO_SERVER_PORT or the first free one from 7860)",
        )
        parser.add_argument("--title", default=DEFAULT_TITLE, help="page title (default: %(default)s)")
        add_engine_wait_argument(parser)

    def run(self, args: argparse.Namespace) -> int:
        host = args.host or os.environ.get("GRADIO_SERVER_NAME") or "127.0.0.1"
        if args.port is not None:
            check_port(host, args.port)
        wait = EngineWait(args.engine, args.engine_wait, "nanostream frontend gradio")
        try:
            address = anyio.run(wait.find)
        except KeyboardInterrupt:
            return 130
        app = build_app(address, title=args.title)
        # Gradio's own start-up requests (httpx, at INFO): nothing a user of this command needs to read.
        for name in ("httpx", "gradio"):
            logging.getLogger(name).setLevel(logging.WARNING)
        try:  # quiet: no hint about share=True, which this command does not offer
            app.launch(server_name=host, server_port=args.port, share=False, prevent_thread_lock=True, quiet=True)
        except OSError:  # taken between the check and Gradio's bind, or no free port in Gradio's range
            raise ValueError(_port_taken(args.port)) from None
        print(f"nanostream gradio chat at {app.local_url} on the engine at {address} (Ctrl-C stops it)", flush=True)
        try:
            if not anyio.run(wait.until_reachable, address):  # meanwhile each page's banner says what to start
                print(f"nanostream frontend gradio: {wait.no_engine(address)}", file=sys.stderr, flush=True)
                return 1
            threading.Event().wait()  # until Ctrl-C
        except KeyboardInterrupt:
            return 130  # as a shell counts Ctrl-C
        finally:
            # Not Gradio's own Ctrl-C handling (launch without prevent_thread_lock): it leaves the
            # sessions' heartbeat streams open, and the server waits 5 s for them before giving up.
            app.close(verbose=False)


def check_port(host: str, port: int) -> None:
    """ValueError saying what to change if this process cannot listen on ``host``:``port``."""
    name = host.strip("[]")  # an IPv6 address as a URL writes it
    try:
        family = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror:
        raise ValueError(f"--host {host} is not a name or address of this machine: pass another --host") from None
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds: TIME_WAIT is no obstacle
        try:
            sock.bind((name, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ValueError(_port_taken(port)) from None
            raise ValueError(
                f"cannot serve on {host} port {port} ({exc.strerror}): pass another --host or --port"
            ) from None


def _port_taken(port: int | None) -> str:
    return f"port {port} is in use: pass --port" if port is not None else "found no free port: pass --port"
