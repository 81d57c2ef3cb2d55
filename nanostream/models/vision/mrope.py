"""Multimodal rotary positions (M-RoPE) of Qwen3-VL and Qwen3.5/3.6: three position ids per token (temporal,
height, width) where a text-only model has one.

A text token's three ids are equal and count up by one. An image's tokens (its ``t * h/m * w/m`` placeholders,
m the spatial merge size) all start from the position p the image begins at: temporal p + frame, height
p + row, width p + column of the merged grid. The text after it resumes at p + max(h/m, w/m), so a prompt with
images has fewer positions than tokens, and every later token (a later chunk's text, a decoded token) at index i
sits at i + ``delta`` on all three axes, ``delta`` (<= 0) fixed by the prompt::

    positions, delta = mrope_positions(prompt_ids, [(1, 28, 28)], image_token_id=248056, spatial_merge_size=2)
    chunk = mrope_positions_range(positions, delta, start=512, end=1024)  # [3, 512], prompt or beyond
    decode = mrope_decode_positions(torch.tensor([n - 1]), torch.tensor([delta]))  # [3, 1]

The engine computes ``positions`` once per prompt and slices it per chunk; positions do not depend on what
the images show, only on their grids, so a prefix cache may share them wherever it shares token ids and images.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nanostream.models.vision.qwen_vit_grid import Grid, check_grids


def image_positions(start: int, grid: Grid, merge: int) -> torch.Tensor:
    """Positions of one image's placeholder tokens, in the order the encoder emits its embeddings (frame, merged
    row, merged column): [3, t * h/m * w/m], each axis offset by ``start``."""
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    frames = torch.arange(t).view(t, 1, 1).expand(t, h, w)
    rows = torch.arange(h).view(1, h, 1).expand(t, h, w)
    cols = torch.arange(w).view(1, 1, w).expand(t, h, w)
    return torch.stack([frames, rows, cols]).reshape(3, -1) + start


def mrope_positions(
    token_ids: Sequence[int] | torch.Tensor,
    image_grids: Sequence[Grid] | torch.Tensor,
    image_token_id: int,
    spatial_merge_size: int,
) -> tuple[torch.Tensor, int]:
    """The [3, T] long position ids of a prompt's T tokens and its rope delta (max position + 1 - T), as
    transformers' ``get_rope_index`` gives them for one unpadded sequence of images. ``image_grids``: one
    (t, h, w) per image in prompt order (the processor's ``image_grid_thw``); each image is the next
    t*h*w/merge² ``image_token_id`` tokens. ValueError when placeholders and grids do not match."""
    ids = token_ids.tolist() if torch.is_tensor(token_ids) else list(token_ids)
    grids = check_grids(image_grids.tolist() if torch.is_tensor(image_grids) else image_grids, spatial_merge_size)
    merge = spatial_merge_size
    parts: list[torch.Tensor] = []
    pos = 0  # the position the next token starts at
    i = 0  # the index of the next token
    for k, grid in enumerate(grids):
        image_at = ids.index(image_token_id, i) if image_token_id in ids[i:] else len(ids)
        if image_at == len(ids):
            raise ValueError(
                f"{len(grids)} image grids were given but the prompt has placeholders (id {image_token_id}) for "
                f"{k}; pass one grid per image the prompt holds"
            )
        parts.append(torch.arange(pos, pos + image_at - i).expand(3, -1))  # the text before it
        pos += image_at - i
        n = grid[0] * grid[1] * grid[2] // merge**2
        if ids[image_at : image_at + n] != [image_token_id] * n:
            raise ValueError(
                f"image {k} with grid {grid} needs {n} consecutive placeholder tokens at index {image_at}; "
                "pass the token ids the processor expanded for these images"
            )
        parts.append(image_positions(pos, grid, merge))
        pos += max(grid[1], grid[2]) // merge
        i = image_at + n
    if image_token_id in ids[i:]:
        raise ValueError(
            f"the prompt has more image placeholder tokens (id {image_token_id}) than the {len(grids)} image "
            "grids given; pass image_grid_thw for every image, from the same processor call as the token ids"
        )
    parts.append(torch.arange(pos, pos + len(ids) - i).expand(3, -1))  # the text after the last image
    positions = torch.cat(parts, dim=1)
    if not ids:
        return positions, 0
    return positions, int(positions.max()) + 1 - len(ids)


def mrope_positions_range(prompt_positions: torch.Tensor, delta: int, start: int, end: int) -> torch.Tensor:
    """Positions [3, end - start] of tokens start..end-1 of a sequence whose prompt has ``prompt_positions``
    ([3, T], from ``mrope_positions``): a prefill chunk, or a recomputed run that goes past the prompt into the
    generated tokens (each at its index + ``delta``)."""
    if not 0 <= start <= end:
        raise ValueError(f"token range [{start}, {end}) must have 0 <= start <= end")
    prompt_len = prompt_positions.shape[1]
    inside = prompt_positions[:, start:end]
    beyond = torch.arange(max(start, prompt_len), max(end, prompt_len), device=prompt_positions.device) + delta
    return torch.cat([inside, beyond.expand(3, -1)], dim=1)


def mrope_decode_positions(indices: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
    """Positions [3, B] of B tokens past their prompts: token index (its 1-D position) + its sequence's delta,
    the same on all three axes. ``indices`` and ``deltas``: [B] long, on the device the positions are wanted."""
    return (indices + deltas).expand(3, -1)
