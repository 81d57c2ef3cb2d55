"""What runs in a client process: ``AsyncClient`` and its streams, the output processor that turns
token deltas into text, and a launcher for an engine process of one's own (demos, tests).

    async_client.py   AsyncClient: the connection (hello, heartbeats, registration, the reader)
    stream.py         Stream: one request as an async iterator of StreamChunk
    detokenizer.py    incremental detokenization and stop strings
    launch.py         EngineProcess: `nanostream serve` as a child process
"""

from nanostream.client.async_client import ADDRESS_ENV, AUTH_TOKEN_ENV, AsyncClient
from nanostream.client.stream import Completion, Stream, StreamChunk

__all__ = ["ADDRESS_ENV", "AUTH_TOKEN_ENV", "AsyncClient", "Completion", "Stream", "StreamChunk"]
