"""A request's images inside the engine: checked against the model's vision tower, hashed, and placed in the prompt.

A client sends each image as the model's image processor prepared it (``protocol.ImageInput``: where its
placeholder tokens start, its patch grid, its pixel rows). The engine trusts none of it: ``check_images`` refuses
what does not fit the prompt or the tower with a message that says what to change, and hashes each image's rows
itself (a client's hash could name another client's image). The runner encodes them (engine/runner/image_rows.py);
the block manager's hashes cover them (``PromptImages.block_words``), so two prompts with the same tokens and
other images never share a block.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch
import xxhash

from nanostream.config import EngineConfig
from nanostream.errors import InvalidRequestError
from nanostream.models.vision import mrope_positions
from nanostream.models.vision.tower import VisionTower
from nanostream.protocol import ImageInput

_FLOAT = 4  # bytes of a float32 pixel value


@dataclasses.dataclass(frozen=True, eq=False)
class SeqImage:
    """One image of a sequence's prompt: its ``num_tokens`` placeholders from ``offset`` on, its patch ``grid``,
    its pixel rows (float32 bytes) and ``key``, the 128-bit hash of grid and rows (the encoder cache's key)."""

    offset: int
    num_tokens: int
    grid: tuple[int, int, int]
    pixels: bytes
    key: bytes

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens

    def rows(self) -> torch.Tensor:
        """The pixel rows as a float32 tensor [t*h*w, values per patch] (a view of the bytes, read only)."""
        t, h, w = self.grid
        return torch.frombuffer(bytearray(self.pixels), dtype=torch.float32).view(t * h * w, -1)


@dataclasses.dataclass(frozen=True, eq=False)
class PromptImages:
    """A prompt's images, in order, and its M-RoPE positions ([3, prompt length], None for a model without them)
    and rope delta (where the tokens after the prompt sit: index + delta on every axis)."""

    images: tuple[SeqImage, ...]
    positions: torch.Tensor | None
    delta: int
    whole: bool = False
    """Each image's tokens attend to each other both ways (Gemma 3's): a step computes an image's tokens together
    (``chunk_end``), each seeing up to the image's last token (``AttentionMetadata.q_last``)."""

    def chunk_end(self, start: int, end: int) -> int:
        """Where a chunk of tokens [start, end) ends instead: before an image it would cut, where images are
        ``whole`` (``start`` itself, nothing this step, when the image began before it); else ``end``."""
        if self.whole:
            for image in self.images:
                if image.offset < end < image.end:
                    return max(start, image.offset)
        return end

    def block_words(self, start: int, end: int) -> list[int]:
        """What a prefix-cache block of tokens [start, end) hashes beside its token ids: for each image it overlaps,
        the image's key (two 64-bit words) and where it starts relative to the block."""
        words: list[int] = []
        for image in self.images:
            if image.offset < end and image.end > start:
                words += [int.from_bytes(image.key[:8], "little", signed=True)]
                words += [int.from_bytes(image.key[8:], "little", signed=True), image.offset - start]
        return words


def check_images(
    prompt: list[int], images: Sequence[ImageInput], tower: VisionTower | None, config: EngineConfig, *, mrope: bool
) -> PromptImages | None:
    """The prompt's images as the engine keeps them, or None when it has none. ``InvalidRequestError`` where an
    image does not fit: the model takes none, too many (``config.limit_images_per_prompt``), a grid the tower cannot
    take, pixel rows of another size or not finite, placeholders that are not where the images say (or left over).
    ``mrope``: the model's positions are M-RoPE's (computed here, once per prompt)."""
    if not images:
        if tower is not None and tower.image_token_id in prompt:
            raise InvalidRequestError(
                f"the prompt holds image placeholder tokens (id {tower.image_token_id}) but no images; send the "
                "images with it (a chat message's image parts), or leave the placeholders out"
            )
        return None
    if tower is None:
        raise InvalidRequestError(
            "this model takes no images (it runs text only, or nanostream runs its language model only); send the "
            "message as text"
        )
    if len(images) > config.limit_images_per_prompt:
        raise InvalidRequestError(
            f"a request may hold at most {config.limit_images_per_prompt} images (the engine's "
            f"limit_images_per_prompt); this one has {len(images)}: send fewer"
        )
    if tower.bidirectional and config.batch_invariant:
        raise InvalidRequestError(
            "the batch-invariant mode attends causally only, and this model's image tokens attend to each other "
            "both ways: send text only, or start the engine without batch_invariant"
        )
    kept: list[SeqImage] = []
    end = 0
    for k, image in enumerate(images):
        seq_image = _check_image(k, image, tower)
        if tower.bidirectional and seq_image.num_tokens > config.max_num_batched_tokens:
            raise InvalidRequestError(
                f"image {k} takes {seq_image.num_tokens} tokens, which this model computes in one step, and the "
                f"engine's steps take at most {config.max_num_batched_tokens} (max_num_batched_tokens): start it "
                f"with max_num_batched_tokens >= {seq_image.num_tokens}"
            )
        if seq_image.offset < end or seq_image.end > len(prompt):
            raise InvalidRequestError(
                f"image {k}'s {seq_image.num_tokens} placeholder tokens from index {seq_image.offset} overlap the "
                f"image before it or run past the prompt's {len(prompt)} tokens; images go in prompt order"
            )
        if any(t != tower.image_token_id for t in prompt[seq_image.offset : seq_image.end]):
            raise InvalidRequestError(
                f"image {k} needs {seq_image.num_tokens} image placeholder tokens (id {tower.image_token_id}) from "
                f"index {seq_image.offset} of the prompt; expand each image's placeholder to its grid's tokens"
            )
        kept.append(seq_image)
        end = seq_image.end
    if prompt.count(tower.image_token_id) != sum(i.num_tokens for i in kept):
        raise InvalidRequestError(
            f"the prompt holds image placeholder tokens (id {tower.image_token_id}) outside its {len(kept)} images; "
            "send one image per placeholder run"
        )
    if not mrope:
        return PromptImages(tuple(kept), None, 0, tower.bidirectional)
    positions, delta = mrope_positions(prompt, [i.grid for i in kept], tower.image_token_id, tower.merge)
    return PromptImages(tuple(kept), positions, delta, tower.bidirectional)


def _check_image(k: int, image: ImageInput, tower: VisionTower) -> SeqImage:
    t, h, w = image.grid
    merge = tower.merge
    wrong = tower.spec.grid_error(image.grid)
    if wrong is not None:
        raise InvalidRequestError(f"image {k}: {wrong}")
    values = tower.spec.patch_pixels
    if len(image.pixels) != t * h * w * values * _FLOAT:
        raise InvalidRequestError(
            f"image {k} has {len(image.pixels)} bytes of pixel rows; its grid {tuple(image.grid)} needs "
            f"{t * h * w} rows of {values} float32 values ({t * h * w * values * _FLOAT} bytes)"
        )
    if not np.isfinite(np.frombuffer(image.pixels, dtype="<f4")).all():
        raise InvalidRequestError(f"image {k}'s pixel rows hold NaN or infinite values; send the processor's output")
    if not image.offset >= 0:
        raise InvalidRequestError(f"image {k}'s offset {image.offset} is negative; it indexes the prompt's tokens")
    hasher = xxhash.xxh3_128(np.array(image.grid, dtype="<i8").tobytes())
    hasher.update(image.pixels)
    return SeqImage(image.offset, t * h * w // merge**2, (t, h, w), image.pixels, hasher.digest())
