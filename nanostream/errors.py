"""The errors nanostream raises.

    NanostreamError
     ├── InvalidRequestError (also a ValueError)   a request the engine can never run; rejected at admission
     ├── ModelLoadError                            a model directory that cannot be loaded
     ├── EngineDeadError                           the engine process died, hung or cannot be reached
     ├── ProtocolError                             a message that is malformed, of another version, or refused
     └── ClientClosedError                         an AsyncClient used outside its ``async with`` / after close()

A request the engine rejects reaches the stream as ``InvalidRequestError``; a stream that waits
longer than its timeout raises the built-in ``TimeoutError``.

Bad constructor arguments raise the built-in ``TypeError`` (unknown key) or ``ValueError`` (bad value).
Every message says what to change.
"""

from __future__ import annotations


class NanostreamError(Exception):
    """Base class of every error nanostream raises on purpose."""


class InvalidRequestError(NanostreamError, ValueError):
    """The request can never run as given (empty prompt, too long, ids outside the vocabulary, ...).

    The engine rejects it when it is added and keeps serving every other request.
    """


class ModelLoadError(NanostreamError):
    """The model directory is missing, incomplete or of an unsupported architecture."""


class EngineDeadError(NanostreamError):
    """The engine process is gone or stopped answering; every open stream of the client raises this."""


class ProtocolError(NanostreamError):
    """A message could not be understood or was refused (version, auth token, size, shape)."""


class ClientClosedError(NanostreamError):
    """The client is not connected: use it inside ``async with AsyncClient(...)``."""
