"""Gemma 3's images as the engine takes them: one fixed-size image a picture, and its placeholder widened as
transformers' ``Gemma3Processor`` widens it.

The chat template writes ``<start_of_image>`` where an image goes; the processor replaces it with the text
``"\\n\\n<start_of_image>" + mm_tokens_per_image x "<image_soft_token>" + "<end_of_image>\\n\\n"`` before
tokenising, so the new line pieces merge with the text around them (``"user\\n" + "\\n\\n"`` can be one token).
Here the prompt is token ids already: the text runs next to each placeholder are decoded, joined with the new
lines, and tokenised again, which gives the processor's ids (added tokens split a text, so each run between two of
them is tokenised alone)::

    preparer = ImagePreparer.from_pretrained("/models/gemma-3-4b-it")   # a GemmaImagePreparer
    ids, offsets = preparer.place(template_ids, [preparer.prepare(image)])
"""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image

from nanostream.multimodal.policy import ImageError
from nanostream.multimodal.processor import ImagePreparer, PreparedImage

NEW_LINES = "\n\n"  # around each image, as Gemma3Processor writes it


class GemmaImagePreparer(ImagePreparer):
    """Gemma 3's ``Gemma3ImageProcessor`` (pan-and-scan off: one image a picture) and its placeholder scheme."""

    def __init__(
        self, processor: Any, tokenizer: Any, *, token_ids: tuple[int, int, int], num_tokens: int, patch_size: int
    ) -> None:
        boi, image, eoi = token_ids
        super().__init__(processor, image_token_id=image, merge_size=1)
        self.tokenizer, self.boi_token_id, self.eoi_token_id = tokenizer, boi, eoi
        self.num_tokens, self.patch_size = num_tokens, patch_size
        self.added = set(tokenizer.added_tokens_decoder)  # the ids that split a text when it is tokenised

    def prepare(self, image: Image.Image) -> PreparedImage:
        """One RGB image resized and normalised by the processor, as patch rows: [side², 3*p*p], row-major over
        the patch grid, each patch (channel, row, column) as the patch embedding's Conv2d weight flattens."""
        out = self.processor(images=[image], return_tensors="np", do_pan_and_scan=False)
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)  # [1, C, H, W]
        _, c, h, w = pixels.shape
        p = self.patch_size
        rows = pixels[0].reshape(c, h // p, p, w // p, p).transpose(1, 3, 0, 2, 4).reshape(-1, c * p * p)
        return PreparedImage(np.ascontiguousarray(rows), (1, h // p, w // p), self.num_tokens)

    def place(self, token_ids: list[int], images: list[PreparedImage]) -> tuple[list[int], list[int]]:
        """(``token_ids`` with the k-th ``<start_of_image>`` widened to the k-th image's tokens as Gemma3Processor
        does, the index of each image's first image token). A placeholder expanded already (``<start_of_image>``,
        ``num_tokens`` image tokens, ``<end_of_image>``) is kept. ``ImageError`` for a number of placeholders
        unlike the number of images, or image tokens outside an image."""
        boi, token, n = self.boi_token_id, self.image_token_id, self.num_tokens
        starts = [i for i, t in enumerate(token_ids) if t == boi]
        if len(starts) != len(images):
            raise ImageError(
                f"the prompt holds {len(starts)} image placeholders for {len(images)} images; put one "
                f"<start_of_image> token (id {boi}, the chat template's image part) where each image goes"
            )
        expanded = {i for i in starts if token_ids[i + 1 : i + n + 2] == [token] * n + [self.eoi_token_id]}
        inside = sum(n for _ in expanded)
        if token_ids.count(token) != inside:
            raise ImageError(
                f"the prompt holds image tokens (id {token}) outside <start_of_image> {n} x image token "
                "<end_of_image>; put one <start_of_image> token where each image goes"
            )
        pieces: list[list[int] | str] = []  # ids as they are, or text to tokenise with the ids beside it
        end = 0
        for i in starts:
            if i in expanded:
                continue
            pieces += [token_ids[end:i], NEW_LINES, [boi] + [token] * n + [self.eoi_token_id], NEW_LINES]
            end = i + 1
        ids = self._join([*pieces, token_ids[end:]])
        return ids, [i + 1 for i, t in enumerate(ids) if t == boi]

    def _join(self, pieces: list[list[int] | str]) -> list[int]:
        """The pieces' ids, where each text run (between two added tokens) that a new-line piece falls in is
        tokenised again whole; every other run keeps its ids."""
        items: list[int | list[int] | str] = []  # an added token's id, a text run's ids, or new lines
        for piece in pieces:
            if isinstance(piece, str):
                items.append(piece)
                continue
            for t in piece:
                if t in self.added:
                    items.append(t)
                elif items and isinstance(items[-1], list):
                    items[-1].append(t)
                else:
                    items.append([t])
        out: list[int] = []
        run: list[list[int] | str] = []
        for item in [*items, -1]:  # -1: the end, which closes the last run
            if not isinstance(item, int):
                run.append(item)
                continue
            if len(run) == 1 and isinstance(run[0], list):
                out += run[0]
            elif run:
                text = "".join(self._text(r) if isinstance(r, list) else r for r in run)
                out += self.tokenizer.encode(text, add_special_tokens=False)
            out += [item] if item >= 0 else []
            run = []
        return out

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
