"""The engine process: the busy loop that serves clients over ZeroMQ.

Owns: ``EngineServer`` (server.py: the loop around ``LLMEngine``), the socket side (transport.py: a
ROUTER read and written by the loop), the engine's address (address.py: a fresh one, which may be
bound, the probe that says clients can reach it), the open requests (request_book.py: whose each is,
limits, merging, deadlines).

May import: the engine core (``nanostream.engine.llm_engine``), protocol, config, errors, distributed/.
Nothing below the engine core (runner/, tp/) directly: the process drives ``LLMEngine`` only.
"""
