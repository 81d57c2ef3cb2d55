"""One ``AsyncClient`` shared by every task of a program that serves many sessions (a Gradio app),
connected on first use and replaced once it has died.

    shared = SharedClient(lambda: AsyncClient(address, timeout=2))
    client, stream = await shared.chat(messages, params)   # in any session's task
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import anyio.to_thread

from nanostream.client.async_client import AsyncClient
from nanostream.client.stream import Stream
from nanostream.errors import ClientClosedError, EngineDeadError
from nanostream.multimodal.chat import IMAGE_PART_TYPES
from nanostream.sampling_params import SamplingParams

ClientFactory = Callable[[], AsyncClient]
"""Returns a new, unconnected AsyncClient: ``lambda: AsyncClient(address, timeout=2)``."""


class SharedClient:
    """The one ``AsyncClient`` of a process, shared by every session, replaced once it has died.

    An AsyncClient's sockets belong to the event loop that connected it: it is connected on the loop
    that uses it (checked at each use: a relaunched Gradio app runs on a new loop), in a task of its own,
    which a session cancelled meanwhile (a stop button) does not cancel.
    """

    def __init__(self, factory: ClientFactory) -> None:
        self._factory = factory
        self._connecting: asyncio.Task[AsyncClient] | None = None  # its result: the connected client
        self.address = factory().address  # a client that never connects: this checks the address now

    async def get(self, stale: AsyncClient | None = None) -> AsyncClient:
        """The connected client, connecting a new one if there is none, it failed, or it is ``stale``."""
        task = self._connecting
        if task is None or task.get_loop() is not asyncio.get_running_loop() or _failed(task, stale):
            if stale is not None:
                await stale.close()
            self._connecting = task = asyncio.create_task(self._connect())
        # shield: a session cancelled while it waits must not cancel the connection other sessions share
        return await asyncio.shield(task)

    async def chat(self, messages: list[dict[str, Any]], params: SamplingParams) -> tuple[AsyncClient, Stream]:
        """``AsyncClient.chat`` on the shared client (and that client), reconnecting once if the engine went
        away meanwhile. Messages with images are prepared in a worker thread: decoding and resizing an image
        takes milliseconds to seconds, which the event loop every session shares must not wait for."""
        client = await self.get()
        try:
            return client, await _chat(client, messages, params)
        except (EngineDeadError, ClientClosedError):
            client = await self.get(stale=client)
            return client, await _chat(client, messages, params)

    async def _connect(self) -> AsyncClient:
        client = self._factory()
        self.address = client.address
        await client.connect()
        return client


async def _chat(client: AsyncClient, messages: list[dict[str, Any]], params: SamplingParams) -> Stream:
    if any(_has_image(m.get("content")) for m in messages if isinstance(m, dict)):
        return await anyio.to_thread.run_sync(client.chat, messages, params)  # (a Stream starts when first read)
    return client.chat(messages, params)


def _has_image(content: Any) -> bool:
    return isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES for p in content)


def _failed(task: asyncio.Task, stale: AsyncClient | None) -> bool:
    return task.done() and (task.cancelled() or task.exception() is not None or task.result() is stale)
