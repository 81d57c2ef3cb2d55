"""An engine's pooled hidden state made into the vector a user gets: cut to ``dimensions`` where the model
was trained for it (Matryoshka), normalised where the model says so (``PoolingConfig``); for
``AsyncClient.embed`` and, through it, ``/v1/embeddings``."""

from __future__ import annotations

import numpy as np

from nanostream.errors import InvalidRequestError
from nanostream.protocol import PoolingConfig
from nanostream.sampling_params import SamplingParams

EMBED_PARAMS = SamplingParams(max_tokens=1, temperature=0, embed=True)  # a request for its prompt's embedding


def embedding_pooling(pooling: PoolingConfig | None, dimensions: int | None) -> PoolingConfig:
    """The engine's pooling, checked before any work: ``InvalidRequestError`` for a generation engine (None)
    or ``dimensions`` the model does not allow."""
    if pooling is None:
        raise InvalidRequestError(
            "this engine serves a generation model: start it as an embedding server (--runner pooling)"
        )
    check_dimensions(pooling, dimensions, 2**31)  # (its length is checked with the vector)
    return pooling


def check_dimensions(pooling: PoolingConfig, dimensions: int | None, size: int) -> None:
    """``InvalidRequestError`` unless ``dimensions`` (None: all) is a length this model's vectors may be cut to."""
    if dimensions is None:
        return
    allowed = pooling.matryoshka
    if allowed is None or allowed is False:
        raise InvalidRequestError(
            "dimensions is not supported by this model: it was not trained to be cut (Matryoshka: config.json's "
            "is_matryoshka or matryoshka_dimensions); leave dimensions out"
        )
    if isinstance(allowed, list) and dimensions not in allowed:
        raise InvalidRequestError(f"dimensions must be one of {allowed} for this model, got {dimensions}")
    if not 1 <= dimensions <= size:
        raise InvalidRequestError(f"dimensions must be in [1, {size}] for this model, got {dimensions}")


def finish_vector(raw: bytes, pooling: PoolingConfig, dimensions: int | None) -> np.ndarray:
    """The user's vector from the engine's pooled state (float32 bytes)."""
    vector = np.frombuffer(raw, dtype="<f4")
    check_dimensions(pooling, dimensions, vector.size)
    vector = vector[:dimensions] if dimensions is not None else vector
    if pooling.normalize:
        vector = vector / max(float(np.linalg.norm(vector.astype(np.float64))), 1e-12)
    return vector.astype(np.float32)
