"""The errors nanostream raises.

    NanostreamError
     ├── InvalidRequestError (also a ValueError)   a request the engine can never run; rejected at admission
     ├── EngineBusyError                           the engine's queues are full: retry later (HTTP 429)
     ├── RequestTimeoutError (also a TimeoutError)  the request's own ``timeout`` passed; the engine aborted it
     ├── RequestFailedError                        the engine failed this one request (an internal error)
     ├── ModelLoadError                            a model directory that cannot be loaded
     ├── EngineDeadError                           the engine process died, hung or cannot be reached
     │    └── ConnectionLostError                  this client's connection to the engine was lost or dropped
     ├── ProtocolError                             a message that is malformed, of another version, or refused
     └── ClientClosedError                         an AsyncClient used outside its ``async with`` / after close()

A request-level error (the first four) ends that request's stream; the engine and every other
stream go on. ``EngineDeadError`` ends every open stream of the client. After a
``ConnectionLostError`` the client registers with the engine again on its own: new requests run.

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


class EngineBusyError(NanostreamError):
    """The engine (or this client's share of it) holds as many queued requests or prompt tokens as
    its limits allow (``--max-num-queued-reqs`` and friends). Nothing was queued; retry later."""


class RequestTimeoutError(NanostreamError, TimeoutError):
    """The request's own ``timeout`` passed before it finished; the engine aborted it."""


class RequestFailedError(NanostreamError):
    """The engine failed this request while running it (an internal error, logged by the engine);
    it serves every other request on."""


class ModelLoadError(NanostreamError):
    """The model directory is missing, incomplete or of an unsupported architecture."""


class EngineDeadError(NanostreamError):
    """The engine process is gone or stopped answering; every open stream of the client raises this."""


class ConnectionLostError(EngineDeadError):
    """The connection to the engine broke, or the engine dropped this client (silent longer than its
    ``client_timeout``): the open streams end with this error, and the client registers again."""


class ProtocolError(NanostreamError):
    """A message could not be understood or was refused (version, auth token, size, shape)."""


class ClientClosedError(NanostreamError):
    """The client is not connected: use it inside ``async with AsyncClient(...)``."""


# What an engine's error code on a request's terminal output becomes in the client.
REQUEST_ERRORS: dict[str, type[NanostreamError]] = {
    "invalid": InvalidRequestError,
    "busy": EngineBusyError,
    "timeout": RequestTimeoutError,
    "internal": RequestFailedError,
    "shutdown": EngineDeadError,
    "lost": ConnectionLostError,
}
