"""What runs in a client process: ``AsyncClient`` and its streams, the output processor that turns
token deltas into text, and a launcher for an engine process of one's own (demos, tests).

    async_client.py   AsyncClient: stream(), chat(), generate(), stats()
    connection.py     its connection: hello, registration, heartbeats, the reader, reconnecting
    stream.py         Stream: one request as an async iterator of StreamChunk
    output_processor.py  deltas into text: detokenizing, stop strings, finish reason, usage
    detokenizer.py    incremental detokenization and stop strings
    launch.py         EngineProcess: `nanostream serve` as a child process
"""

from nanostream.client.async_client import ADDRESS_ENV, AUTH_TOKEN_ENV, AsyncClient
from nanostream.client.stream import Completion, Stream, StreamChunk

__all__ = ["ADDRESS_ENV", "AUTH_TOKEN_ENV", "AsyncClient", "Completion", "Stream", "StreamChunk"]
