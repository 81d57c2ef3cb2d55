"""Which keys a query sees: the rules every attention backend follows (layers/attention_backend.py), written once
for the torch backend's masks and the checks of a layer's window and chunk."""

from __future__ import annotations

import torch


def check_window(window: int | None, chunk: int | None = None) -> None:
    """Raise ``ValueError`` unless ``window`` and ``chunk`` are None or a positive number of tokens."""
    for name, value in (("window", window), ("chunk", chunk)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive number of tokens or None, got {value!r}")


def visible(
    k_pos: torch.Tensor, q_pos: torch.Tensor, window: int | None, chunk: int | None, last: torch.Tensor | None = None
) -> torch.Tensor:
    """The keys at ``k_pos`` that the queries at ``q_pos`` see (broadcast): causal (up to ``last`` where given:
    ``AttentionMetadata.q_last``), in the window, in the chunk."""
    mask = k_pos <= (q_pos if last is None else last)
    if window is not None:
        mask &= k_pos > q_pos - window
    if chunk is not None:
        mask &= k_pos >= q_pos - q_pos % chunk
    return mask
