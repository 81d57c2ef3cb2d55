"""A vision-language model's images in a step: the encoder's rows at the image tokens the step computes, and the
M-RoPE positions of its rows.

The images a step's chunks reach that the cache lacks are encoded together (in batches of at most ``max_patches``
patches), on the runner's device; each image's rows are kept by its key (a hash of its grid and pixels, so an
image sent again, in a later turn or by another client, is encoded once) until ``budget_rows`` rows are held,
least recently used out. A chunk may cut an image anywhere (it takes the rows of the tokens it computes), except
where the model's image tokens attend to each other both ways (Gemma 3's): the scheduler then keeps each image's
tokens in one step, and ``with_query_limits`` lets each see to its image's end.

Positions: a text token's three M-RoPE axes are equal, so a step whose rows all have equal axes (decode rows, text)
keeps one position a row (the decode CUDA graphs' shape) at its index + the sequence's delta; a step with image
rows gets [3, T].
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from itertools import accumulate
from pathlib import Path

import torch

from nanostream.config import EngineConfig
from nanostream.distributed.group import SINGLE, TensorParallel
from nanostream.engine.images import SeqImage
from nanostream.engine.runner.step_inputs import Chunk, StepInputs, Uploads, to_device
from nanostream.models import PlaceholderEmbeds
from nanostream.models.vision import mrope_positions_range
from nanostream.models.vision.tower import VisionTower


class ImageRows:
    """The encoder of one runner and its cache of image rows (see the module docstring)."""

    def __init__(
        self, encoder: torch.nn.Module, *, budget_rows: int, max_patches: int, whole: str | None = None
    ) -> None:
        self.encoder, self.whole = encoder, whole  # which layers see each image whole (VisionTower.both_ways)
        self.budget_rows, self.max_patches = budget_rows, max_patches
        # image key -> its rows [tokens, hidden] and DeepStack features (one such a level; Qwen3-VL's)
        self.cache: OrderedDict[bytes, tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = OrderedDict()
        self.rows_held = 0
        self.images_encoded = 0

    @classmethod
    def of(cls, tower: VisionTower, path: Path, config: EngineConfig, dtype: torch.dtype, device: torch.device):
        """The tower's encoder on ``device``; its cache holds a step's worth of rows (max_num_batched_tokens)."""
        encoder = tower.build(path, dtype=dtype, device=device, load_format=config.load_format)
        budget = config.max_num_batched_tokens
        return cls(encoder, budget_rows=budget, max_patches=4 * budget, whole=tower.both_ways)

    @torch.inference_mode()
    def encode_largest(self, device: torch.device) -> None:
        """Encode one image of the most patches a step encodes at once (``max_patches``) and drop its rows: start-up's
        measurement of the memory left for the KV pool then counts the encoder's peak."""
        spec = self.encoder.spec
        side = math.isqrt(self.max_patches) // spec.spatial_merge_size * spec.spatial_merge_size
        grids = [(1, side, side)]
        fixed = getattr(spec, "grid", None)  # a tower of one image size (SigLIP's): as many as a call takes
        if fixed is not None:
            grids = [fixed] * max(1, self.max_patches // math.prod(fixed))
        dtype = next(self.encoder.parameters()).dtype
        rows = sum(math.prod(g) for g in grids)
        self.encoder(torch.zeros(rows, spec.patch_pixels, dtype=dtype, device=device), grids)

    def step_inputs(
        self, chunks: list[Chunk], inputs: StepInputs, uploads: Uploads | None = None, tp: TensorParallel = SINGLE
    ) -> StepInputs:
        """``inputs`` (``pack_step``'s) with the images' rows and M-RoPE positions, where some chunk's sequence has
        images; else unchanged. With tensor parallelism the rows go to every rank (``received_inputs``)."""
        if all(c.seq.images is None for c in chunks):
            return inputs
        device = inputs.input_ids.device
        positions = step_positions(chunks, [chunk_rope(c) for c in chunks], device, uploads)
        embeds = self._embeds(chunks, device, uploads)
        if embeds is not None and tp.size > 1:  # the workers, which hold no encoder, take them from here
            for rows in (embeds.rows, *embeds.deepstack):
                tp.broadcast(rows.contiguous())
        if self.whole is not None:
            inputs = with_query_limits(chunks, [chunk_image_rows(c) for c in chunks], inputs, uploads, self.whole)
        return inputs._replace(positions=positions if positions is not None else inputs.positions, embeds=embeds)

    def _embeds(self, chunks: list[Chunk], device: torch.device, uploads: Uploads | None) -> PlaceholderEmbeds | None:
        wanted: list[tuple[SeqImage, int, int]] = []  # (image, its first row wanted, its end)
        index: list[int] = []  # the step's rows they replace
        row = 0
        for chunk in chunks:
            for image, lo, hi in chunk_images(chunk):
                wanted.append((image, lo, hi))
                index += range(row + image.offset + lo - chunk.start, row + image.offset + hi - chunk.start)
            row += chunk.num_new_tokens
        if not wanted:
            return None
        missing = {image.key: image for image, _, _ in wanted if image.key not in self.cache}
        if missing:
            self._encode(list(missing.values()), device)
        parts = [self.cache[image.key] for image, _, _ in wanted]
        rows = torch.cat([rows[lo:hi] for (rows, _), (_, lo, hi) in zip(parts, wanted)])
        levels = len(parts[0][1])
        deepstack = tuple(
            torch.cat([features[level][lo:hi] for (_, features), (_, lo, hi) in zip(parts, wanted)])
            for level in range(levels)
        )
        used = {image.key for image, _, _ in wanted}
        for key in used:
            self.cache.move_to_end(key)
        self._evict(keep=used)
        return PlaceholderEmbeds(to_device(index, torch.int64, device, uploads), rows, deepstack)

    @torch.inference_mode()
    def _encode(self, images: list[SeqImage], device: torch.device) -> None:
        dtype = next(self.encoder.parameters()).dtype
        batch: list[SeqImage] = []
        for k, image in enumerate(images):
            batch.append(image)
            patches = sum(i.grid[0] * i.grid[1] * i.grid[2] for i in batch)
            ahead = images[k + 1].grid if k + 1 < len(images) else None
            if ahead is None or patches + ahead[0] * ahead[1] * ahead[2] > self.max_patches:
                pixels = torch.cat([i.rows() for i in batch]).to(device=device, dtype=dtype, non_blocking=True)
                out = self.encoder(pixels, [i.grid for i in batch])
                for i, (rows, deepstack) in zip(batch, out.split(), strict=True):
                    self.cache[i.key] = rows, deepstack
                    self.rows_held += rows.shape[0] * (1 + len(deepstack))
                self.images_encoded += len(batch)
                batch = []

    def _evict(self, keep: set[bytes]) -> None:
        for key in list(self.cache):
            if self.rows_held <= self.budget_rows:
                break
            if key not in keep:
                rows, deepstack = self.cache.pop(key)
                self.rows_held -= rows.shape[0] * (1 + len(deepstack))


def chunk_images(chunk: Chunk) -> list[tuple[SeqImage, int, int]]:
    """The images a chunk computes tokens of: (image, its first row computed, the end of them), rows counted from
    the image's first token."""
    images, start, end = chunk.seq.images, chunk.start, chunk.start + chunk.num_new_tokens
    overlaps = ((i, max(start, i.offset), min(end, i.end)) for i in (images.images if images is not None else ()))
    return [(image, lo - image.offset, hi - image.offset) for image, lo, hi in overlaps if lo < hi]


def chunk_image_rows(chunk: Chunk) -> list[int]:
    """The rows of a chunk (from 0) that are image tokens: what a worker writes the broadcast rows over."""
    return [image.offset - chunk.start + r for image, lo, hi in chunk_images(chunk) for r in range(lo, hi)]


def chunk_rope(chunk: Chunk) -> list[int]:
    """A chunk's M-RoPE positions, flat: one a token where its three axes agree (text, decode rows: index + delta),
    else [3, n] row by row; empty where its sequence has none (its positions are its token indices)."""
    images, start, n = chunk.seq.images, chunk.start, chunk.num_new_tokens
    if images is None or images.positions is None:
        return []
    if n == 1 and start >= images.positions.shape[1]:  # a decode row: past the prompt
        return [start + images.delta]
    part = mrope_positions_range(images.positions, images.delta, start, start + n)
    equal = torch.equal(part[0], part[1]) and torch.equal(part[0], part[2])
    return part[0].tolist() if equal else part.flatten().tolist()


def step_positions(
    chunks: list[Chunk], ropes: list[list[int]], device: torch.device, uploads: Uploads | None
) -> torch.Tensor | None:
    """The step's positions from each chunk's ``chunk_rope``: [T], or [3, T] where an image row's axes differ; None
    where no chunk has M-RoPE positions (``pack_step``'s stand)."""
    if not any(ropes):
        return None
    flat: list[int] = []  # a row's position where its three axes are equal (its first axis', else)
    spread: list[tuple[int, torch.Tensor]] = []  # (first row, [3, n]) of the chunks whose axes differ
    for chunk, rope in zip(chunks, ropes, strict=True):
        start, n = chunk.start, chunk.num_new_tokens
        if len(rope) == 3 * n:  # (chunk_rope's [3, n], its axes apart)
            spread.append((len(flat), torch.tensor(rope).view(3, n)))
            rope = rope[:n]
        flat += rope or range(start, start + n)
    positions = to_device(flat, torch.int64, device, uploads)
    if not spread:
        return positions
    positions = positions.expand(3, -1).clone()
    for row, part in spread:
        positions[:, row : row + part.shape[1]] = part.to(device)
    return positions


def received_inputs(
    chunks: list,
    inputs: StepInputs,
    tp: TensorParallel,
    width: tuple[int, torch.dtype, int, str | None],
    uploads: Uploads | None,
) -> StepInputs:
    """A worker's ``step_inputs``: rank 0's positions and image rows from the step's message (each chunk's ``rope``
    and ``image_rows``) and its broadcast. ``width``: (hidden size, dtype, DeepStack levels that follow the rows,
    ``VisionTower.both_ways``)."""
    hidden, dtype, levels, whole = width
    device = inputs.input_ids.device
    positions = step_positions(chunks, [c.rope for c in chunks], device, uploads)
    starts = accumulate([0] + [c.num_new_tokens for c in chunks])
    index = [row + r for row, c in zip(starts, chunks) for r in c.image_rows]
    embeds = None
    if index:
        shape = (len(index), hidden)
        rows = [tp.broadcast(torch.empty(shape, dtype=dtype, device=device)) for _ in range(1 + levels)]
        embeds = PlaceholderEmbeds(to_device(index, torch.int64, device, uploads), rows[0], tuple(rows[1:]))
    if whole is not None:
        inputs = with_query_limits(chunks, [c.image_rows for c in chunks], inputs, uploads, whole)
    return inputs._replace(positions=positions if positions is not None else inputs.positions, embeds=embeds)


def with_query_limits(
    chunks: list, image_rows: list[list[int]], inputs: StepInputs, uploads: Uploads | None, both_ways: str
) -> StepInputs:
    """``inputs`` whose attention lets each image token see its whole image (``AttentionMetadata.q_last``) in the
    layers ``both_ways`` says (``VisionTower.both_ways``), from each chunk's image rows: a run of consecutive ones is
    an image (or its rest, after a prefix hit), which the chunk holds to its end (``PromptImages.chunk_end``); every
    other row sees up to itself. Unchanged without images."""
    if not any(image_rows):
        return inputs
    last: list[int] = []
    for chunk, rows in zip(chunks, image_rows, strict=True):
        ends = list(range(chunk.start, chunk.start + chunk.num_new_tokens))
        for i in reversed(range(len(rows) - 1)):  # from the end: each run's rows take its last row's position
            if rows[i + 1] == rows[i] + 1:
                ends[rows[i]] = ends[rows[i + 1]]
        last += ends
    q_last = to_device(last, torch.int32, inputs.input_ids.device, uploads)
    limits = dict(q_last=q_last, q_last_windowed=both_ways == "sliding")
    meta = inputs.meta
    groups = tuple(dataclasses.replace(g, **limits) for g in meta.kv_groups)
    return inputs._replace(meta=dataclasses.replace(meta, kv_groups=groups, **limits))
