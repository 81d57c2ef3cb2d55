"""What runs in a client process: ``AsyncClient`` and its streams, the output processor that turns
token deltas into text, and a launcher for an engine process of one's own (demos, tests).

    async_client.py   AsyncClient: stream(), chat(), generate(), stats(); it has a Connection
    connection.py     the connection: hello, registration, requests in, deltas to mailboxes, close from any task
    liveness.py       heartbeats both ways, losing the engine and registering again
    dealer.py         the ZeroMQ DEALER socket on the event loop
    mailbox.py        where the reader leaves a stream's deltas
    stream.py         Stream: one request as an async iterator of StreamChunk
    samples.py        SampleGroup: a request's n samples (per prompt), their processors, followers and merge
    prompts.py        what a prompt may be (one check, one error, for LLM and AsyncClient)
    shared.py         SharedClient: one AsyncClient for every session of a server (the Gradio chat)
    output_processor.py  deltas into text: detokenizing, stop strings, finish reason, usage
    detokenizer.py    incremental detokenization and stop strings
    launch.py         EngineProcess: `nanostream serve` as a child process
"""

from nanostream.client.async_client import ADDRESS_ENV, AUTH_TOKEN_ENV, AsyncClient
from nanostream.client.stream import Completion, Stream, StreamChunk

__all__ = ["ADDRESS_ENV", "AUTH_TOKEN_ENV", "AsyncClient", "Completion", "Stream", "StreamChunk"]
