"""An image as the engine takes it: the checkpoint's own transformers image processor, run on one image.

``ImagePreparer.from_pretrained(model_dir)`` reads the checkpoint's image processor (``preprocessor_config.json``,
or the ``image_processor`` entry of ``processor_config.json`` as transformers 5 saves it) with
``AutoImageProcessor`` (its PIL backend; nothing here resizes or normalises by itself)::

    preparer = ImagePreparer.from_pretrained("/models/Qwen3.5-9B")     # None for a text-only checkpoint
    images = [preparer.prepare(load_image(s, policy)) for s in sources]
    prompt = preparer.expand_placeholders(template_ids, images)        # one image token -> num_tokens

The Qwen family (Qwen2.5-VL, Qwen3-VL, Qwen3.5/3.6: the ``Qwen2VLImageProcessor`` family, whose ``pixel_values``
rows are the patches of all images one after another and ``image_grid_thw`` their grids), and Gemma 3
(``GemmaImagePreparer``, multimodal/gemma_images.py: one image size, its placeholder widened as Gemma3Processor does)
and Gemma 4 (``Gemma4ImagePreparer``, multimodal/gemma4_images.py: sizes kept in aspect, widened as Gemma4Processor).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from nanostream.errors import ModelLoadError
from nanostream.multimodal.policy import ImageError

PROCESSOR_FILE = "preprocessor_config.json"
PROCESSOR_FILES = (PROCESSOR_FILE, "processor_config.json")
"""Where a checkpoint keeps its image processor: the first file alone, or an ``image_processor`` entry of the
second (transformers 5's ``ProcessorMixin.save_pretrained`` writes only that one); AutoImageProcessor reads both."""


def processor_files(path: Path) -> dict[str, bytes]:
    """The files a client needs to prepare this checkpoint's images itself: its config and image processor."""
    return {n: (path / n).read_bytes() for n in ("config.json", *PROCESSOR_FILES) if (path / n).is_file()}


def has_image_processor(path: str | os.PathLike) -> bool:
    """Whether the checkpoint directory holds an image processor in either of ``PROCESSOR_FILES``."""
    path = Path(path)
    if (path / PROCESSOR_FILE).is_file():
        return True
    try:
        return "image_processor" in json.loads((path / PROCESSOR_FILES[1]).read_text())
    except (OSError, ValueError, TypeError):
        return False


@dataclass(frozen=True, eq=False)
class PreparedImage:
    """One image, processed: what the engine's vision encoder takes, and the room it fills in the prompt."""

    pixels: np.ndarray
    """[N, D] float32: the processor's ``pixel_values`` rows of this image (N = t * h * w patches)."""
    grid: tuple[int, int, int]
    """(t, h, w): the processor's ``image_grid_thw`` row, in patches."""
    num_tokens: int
    """Placeholder tokens the image takes in the prompt: t * h * w // merge_size**2. (The engine hashes the rows
    itself, for its encoder and prefix caches: engine/images.py.)"""


class ImagePreparer:
    """A checkpoint's image processor and image token, for the Qwen family's placeholder scheme."""

    def __init__(self, processor: Any, *, image_token_id: int, merge_size: int) -> None:
        self.processor = processor
        self.image_token_id = image_token_id
        self.merge_size = merge_size

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> ImagePreparer | None:
        """The checkpoint's preparer, or None when it takes no images (no vision config or no image processor
        in ``PROCESSOR_FILES``). A vision checkpoint of another family raises ``ModelLoadError``:
        a caller that serves its text anyway catches it and keeps the message for requests with images."""
        from transformers import AutoConfig, AutoImageProcessor  # transformers is slow to import

        path = Path(model_dir)
        config = AutoConfig.from_pretrained(path)
        vision = getattr(config, "vision_config", None)
        if vision is None or not has_image_processor(path):
            return None
        architecture = (getattr(config, "architectures", None) or [type(config).__name__])[0]
        processor = AutoImageProcessor.from_pretrained(path, backend="pil")  # torchvision is optional
        kind = type(processor).__name__
        if kind.startswith("Gemma3ImageProcessor"):
            return _gemma_preparer(path, config, processor)
        if kind.startswith("Gemma4ImageProcessor"):
            return _gemma4_preparer(path, config, processor)
        image_token_id = getattr(config, "image_token_id", None)
        if not kind.startswith("Qwen2VLImageProcessor") or image_token_id is None:
            raise ModelLoadError(
                f"images are not supported for {architecture} yet (its image processor is {kind}); nanostream "
                "takes images for the Qwen family (Qwen2.5-VL, Qwen3-VL, Qwen3.5), Gemma 3 and Gemma 4; send this "
                "model text only"
            )
        merge_size = getattr(vision, "spatial_merge_size", None)
        if merge_size != processor.merge_size:
            raise ModelLoadError(
                f"{path}: {PROCESSOR_FILE} merges {processor.merge_size}x{processor.merge_size} patches, the "
                f"vision config {merge_size}x{merge_size}; is the checkpoint's {PROCESSOR_FILE} its own?"
            )
        return cls(processor, image_token_id=int(image_token_id), merge_size=int(merge_size))

    def prepare(self, image: Image.Image) -> PreparedImage:
        """One RGB image (``load_image``'s) through the processor, alone: the same rows it gives this image
        in a batch of several."""
        out = self.processor(images=[image], return_tensors="np")
        pixels = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)  # [N, D]
        (t, h, w), n = (int(x) for x in out["image_grid_thw"][0]), pixels.shape[0]
        assert out["image_grid_thw"].shape == (1, 3) and t * h * w == n, (out["image_grid_thw"], pixels.shape)
        return PreparedImage(pixels, (t, h, w), n // self.merge_size**2)

    def expand_placeholders(self, token_ids: list[int], images: list[PreparedImage]) -> list[int]:
        """``place``'s token ids alone."""
        return self.place(token_ids, images)[0]

    def place(self, token_ids: list[int], images: list[PreparedImage]) -> tuple[list[int], list[int]]:
        """(``token_ids`` with the k-th image's placeholder widened to ``images[k].num_tokens`` image tokens,
        the index where each image's tokens start).

        The chat template writes one image token per image. A run of image tokens that is already as long
        as its image's ``num_tokens`` is kept as it is (ids expanded before, by nanostream or transformers'
        processor), so expanding twice changes nothing. Any other run, or a number of placeholders unlike the
        number of images, is an ``ImageError``. Adjacent single placeholders (``<image><image>``, a raw
        prompt's) count as one image each when the prompt holds exactly as many image tokens as images. The
        second item: where each image's tokens start in the first."""
        token = self.image_token_id
        runs = _runs(token_ids, token)  # [(start, length)] of image tokens
        if sum(length for _, length in runs) == len(images):
            runs = [(start + i, 1) for start, length in runs for i in range(length)]
        if len(runs) != len(images):
            raise ImageError(
                f"the prompt holds {len(runs)} image placeholders for {len(images)} images; put one image token "
                f"(id {token}, the chat template's image part) where each image goes, or send messages with "
                "image parts for the chat template to place"
            )
        out: list[int] = []
        offsets: list[int] = []
        end = 0
        for k, ((start, length), image) in enumerate(zip(runs, images)):
            if length not in (1, image.num_tokens):
                raise ImageError(
                    f"image {k + 1}'s placeholder is {length} image tokens; it takes one (to be expanded) or "
                    f"exactly {image.num_tokens} (its grid {image.grid} merged {self.merge_size}x{self.merge_size})"
                )
            out += token_ids[end:start]
            offsets.append(len(out))
            out += [token] * image.num_tokens
            end = start + length
        return out + token_ids[end:], offsets


def _gemma_preparer(path: Path, config: Any, processor: Any) -> ImagePreparer:
    """Gemma 3's preparer: its tokenizer (to tokenise the new lines around each image with the text beside them),
    its image tokens and its tower's patch size."""
    from transformers import AutoTokenizer

    from nanostream.multimodal.gemma_images import GemmaImagePreparer

    def token(name: str) -> int:  # Gemma 3 configs name them image_token_index or image_token_id (an alias)
        value = getattr(config, f"{name}_token_index", None)
        return int(getattr(config, f"{name}_token_id", None) if value is None else value)

    size = processor.size
    vision = config.vision_config
    if (size["height"], size["width"]) != (vision.image_size, vision.image_size):
        raise ModelLoadError(
            f"{path}: {PROCESSOR_FILE} resizes images to {size['height']}x{size['width']} pixels, the vision config "
            f"takes {vision.image_size}x{vision.image_size}; is the checkpoint's {PROCESSOR_FILE} its own?"
        )
    return GemmaImagePreparer(
        processor,
        AutoTokenizer.from_pretrained(path),
        token_ids=(token("boi"), token("image"), token("eoi")),
        num_tokens=int(config.mm_tokens_per_image),
        patch_size=int(vision.patch_size),
    )


def _gemma4_preparer(path: Path, config: Any, processor: Any) -> ImagePreparer:
    """Gemma 4's preparer: its image tokens (begin, image, end) and the pooling its tower and processor share."""
    from nanostream.multimodal.gemma4_images import Gemma4ImagePreparer

    vision = config.vision_config
    if (processor.patch_size, processor.pooling_kernel_size) != (vision.patch_size, vision.pooling_kernel_size):
        raise ModelLoadError(
            f"{path}: {PROCESSOR_FILE} cuts {processor.patch_size}-pixel patches pooled "
            f"{processor.pooling_kernel_size}x{processor.pooling_kernel_size}, the vision config "
            f"{vision.patch_size}-pixel ones pooled {vision.pooling_kernel_size}x{vision.pooling_kernel_size}; is the "
            f"checkpoint's {PROCESSOR_FILE} its own?"
        )
    ids = (config.boi_token_id, config.image_token_id, config.eoi_token_id)
    return Gemma4ImagePreparer(
        processor, token_ids=tuple(int(i) for i in ids), pooling_kernel_size=int(vision.pooling_kernel_size)
    )


def _runs(token_ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of ``token`` in ``token_ids``."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(token_ids):
        if t != token:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs
