"""The errors nanostream raises.

    NanostreamError
     ├── InvalidRequestError (also a ValueError)   a request the engine can never run; rejected at admission
     └── ModelLoadError                            a model directory that cannot be loaded

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
