"""Gemma 4's images as the engine takes them: transformers' ``Gemma4ImageProcessor`` (each image resized, keeping
its aspect, to at most ``max_soft_tokens`` tokens) and its placeholder widened as ``Gemma4Processor`` widens it.

The chat template writes one ``<|image|>`` where an image goes; the processor replaces it with
``<|image>`` + n x ``<|image|>`` + ``<image|>`` (n: the image's soft tokens), all added tokens, so the text beside
them tokenises as before and the widening is one of ids. An image's rows are the processor's ``pixel_values`` rows
without its padding: h*w patches, row-major, each (row, column, channel); its grid (1, h, w) in patches::

    preparer = ImagePreparer.from_pretrained("/models/gemma-4-e4b-it")   # a Gemma4ImagePreparer
    ids, offsets = preparer.place(template_ids, [preparer.prepare(image)])
"""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image

from nanostream.multimodal.policy import ImageError
from nanostream.multimodal.processor import ImagePreparer, PreparedImage, _runs


class Gemma4ImagePreparer(ImagePreparer):
    """Gemma 4's image processor and placeholder scheme: ``token_ids`` are (begin, image, end) of an image."""

    def __init__(self, processor: Any, *, token_ids: tuple[int, int, int], pooling_kernel_size: int) -> None:
        boi, image, eoi = token_ids
        super().__init__(processor, image_token_id=image, merge_size=pooling_kernel_size)
        self.boi_token_id, self.eoi_token_id = boi, eoi

    def prepare(self, image: Image.Image) -> PreparedImage:
        """One RGB image through the processor, alone: its h*w patch rows (the padding dropped), grid (1, h, w)."""
        out = self.processor(images=[image], return_tensors="np")
        positions = np.asarray(out["image_position_ids"][0])  # [max patches, 2]: (column, row), padding (-1, -1)
        valid = (positions != -1).all(-1)
        rows = np.ascontiguousarray(np.asarray(out["pixel_values"][0], dtype=np.float32)[valid])
        w, h = (int(v) + 1 for v in positions[valid].max(0))
        num_tokens = int(out["num_soft_tokens_per_image"][0])
        assert h * w == rows.shape[0] and num_tokens == h * w // self.merge_size**2, (h, w, rows.shape, num_tokens)
        return PreparedImage(rows, (1, h, w), num_tokens)

    def place(self, token_ids: list[int], images: list[PreparedImage]) -> tuple[list[int], list[int]]:
        """(``token_ids`` with the k-th lone image token widened to ``<|image>`` + the k-th image's tokens +
        ``<image|>``, as Gemma4Processor does, the index of each image's first image token). An image expanded
        already (``<|image>`` n x image token ``<image|>``) is kept. ``ImageError`` for a number of images unlike
        the placeholders', or an expanded image whose length is not its image's."""
        boi, token, eoi = self.boi_token_id, self.image_token_id, self.eoi_token_id
        slots: list[tuple[int, int, bool]] = []  # (start, length, expanded already), a lone placeholder's length 1
        for start, length in _runs(token_ids, token):
            end = start + length
            wrapped = start > 0 and token_ids[start - 1] == boi and end < len(token_ids) and token_ids[end] == eoi
            slots += [(start, length, True)] if wrapped else [(start + i, 1, False) for i in range(length)]
        if len(slots) != len(images):
            raise ImageError(
                f"the prompt holds {len(slots)} image placeholders for {len(images)} images; put one image token "
                f"(id {token}, the chat template's image part) where each image goes"
            )
        out: list[int] = []
        offsets: list[int] = []
        end = 0
        for k, ((start, length, wrapped), image) in enumerate(zip(slots, images)):
            if wrapped and length != image.num_tokens:
                raise ImageError(
                    f"image {k + 1} is expanded to {length} image tokens; its grid {image.grid} takes "
                    f"{image.num_tokens}: send one image token where it goes"
                )
            out += token_ids[end:start]
            if not wrapped:
                out.append(boi)
            offsets.append(len(out))
            out += [token] * image.num_tokens + ([] if wrapped else [eoi])
            end = start + length
        return out + token_ids[end:], offsets
