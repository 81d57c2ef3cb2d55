"""Embeddings that stand in for some of a step's tokens: a vision-language model's image embeddings (from its
vision encoder, models/vision/) at the image placeholder tokens of the prompt, written over those tokens'
embeddings before the first layer, as transformers' ``masked_scatter`` does::

    out = encoder(pixel_values, image_grid_thw)            # out.embeds: [M, hidden], the images' tokens in order
    index = (input_ids == image_token_id).nonzero()[:, 0]  # the M placeholders among the step's T tokens
    hidden = model(input_ids, positions, ctx, PlaceholderEmbeds(index, out.embeds))

A prefill chunk that holds part of an image carries that part's rows only, at its own token indices. Qwen3-VL's
DeepStack features (``deepstack``: one [M, hidden] per level) are added to the hidden states at the same tokens after
the first layers, level i after layer i (``add_level``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PlaceholderEmbeds:
    """``rows[i]`` replaces the embedding of the step's token ``index[i]``.

    ``index``: [M] long, indices into the step's T tokens, on the model's device; ``rows``: [M, hidden], cast to
    the embeddings' dtype where it differs."""

    index: torch.Tensor
    rows: torch.Tensor
    deepstack: tuple[torch.Tensor, ...] = ()

    def __post_init__(self) -> None:
        if self.index.dim() != 1 or self.rows.dim() != 2 or self.rows.shape[0] != self.index.shape[0]:
            raise ValueError(
                f"placeholder embeddings need index [M] and rows [M, hidden]; got index of shape "
                f"{tuple(self.index.shape)} and rows of shape {tuple(self.rows.shape)}"
            )

    def write_over(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ([T, hidden], the token embeddings) with the rows at their indices, out of place."""
        if self.rows.shape[1] != x.shape[1]:
            raise ValueError(
                f"placeholder rows of width {self.rows.shape[1]} cannot stand in for embeddings of width "
                f"{x.shape[1]}; pass the vision encoder's output of this model"
            )
        return x.index_copy(0, self.index, self.rows.to(x.dtype))

    def add_level(self, level: int, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The hidden states after a layer (``x`` + ``residual``, a decoder layer's fused pair) with DeepStack level
        ``level``'s rows added at the placeholders, as transformers adds them (a new tensor; the next layer takes it
        with no residual)."""
        hidden = x if residual is None else x + residual
        return hidden.index_add(0, self.index, self.deepstack[level].to(hidden.dtype))
