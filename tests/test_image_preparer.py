"""The checkpoint's image processor on one image (issue 58): ``ImagePreparer`` against transformers' own processor
on a tiny Qwen3.5 checkpoint directory (config.json and preprocessor_config.json, saved by transformers), and the
placeholder expansion of a prompt."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from test_vision_encoder import IMAGE, SIZES, TEXT, TOKENS, VISION, _images
from transformers import (
    AutoImageProcessor,
    CLIPImageProcessorPil,
    LlavaConfig,
    Qwen2VLImageProcessorPil,
    Qwen3_5Config,
    Qwen3Config,
)

from nanostream import ModelLoadError
from nanostream.multimodal import ImageError, ImagePreparer, PreparedImage


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5_vl")
    Qwen3_5Config(vision_config=VISION, text_config=TEXT, **TOKENS).save_pretrained(path)
    Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2).save_pretrained(path)
    return path


def test_prepare_gives_the_processors_rows_of_each_image(checkpoint):
    preparer = ImagePreparer.from_pretrained(checkpoint)
    assert preparer.image_token_id == IMAGE and preparer.merge_size == 2
    images = [Image.fromarray(np.asarray(i)) for i in _images([*SIZES, (28, 300)], seed=3)]  # load_image's kind
    batch = AutoImageProcessor.from_pretrained(checkpoint)(images=images, return_tensors="np")
    start = 0
    for image, grid in zip(images, batch["image_grid_thw"]):
        prepared = preparer.prepare(image)
        t, h, w = (int(x) for x in grid)
        assert prepared.grid == (t, h, w) and prepared.num_tokens == t * h * w // 4
        assert prepared.pixels.dtype == np.float32 and prepared.pixels.shape == (t * h * w, 3 * 2 * 16 * 16)
        assert np.array_equal(prepared.pixels, batch["pixel_values"][start : start + t * h * w])  # bit for bit
        start += t * h * w
    assert start == len(batch["pixel_values"])


def test_checkpoints_without_images_or_of_other_families(checkpoint, tmp_path):
    Qwen3Config(**TEXT).save_pretrained(tmp_path / "text")
    assert ImagePreparer.from_pretrained(tmp_path / "text") is None
    Qwen3_5Config(vision_config=VISION, text_config=TEXT, **TOKENS).save_pretrained(tmp_path / "no-processor")
    assert ImagePreparer.from_pretrained(tmp_path / "no-processor") is None
    llava = LlavaConfig(architectures=["LlavaForConditionalGeneration"])
    llava.save_pretrained(tmp_path / "llava")
    CLIPImageProcessorPil().save_pretrained(tmp_path / "llava")
    with pytest.raises(ModelLoadError, match="images are not supported for LlavaForConditionalGeneration yet"):
        ImagePreparer.from_pretrained(tmp_path / "llava")
    Qwen2VLImageProcessorPil(patch_size=16, merge_size=4).save_pretrained(tmp_path / "no-processor")
    with pytest.raises(ModelLoadError, match="merges 4x4 patches, the vision config 2x2"):
        ImagePreparer.from_pretrained(tmp_path / "no-processor")


def _image(num_tokens):
    return PreparedImage(np.zeros((num_tokens * 4, 8), np.float32), (1, 2, 2 * num_tokens), num_tokens)


@pytest.fixture
def preparer():
    return ImagePreparer(None, image_token_id=IMAGE, merge_size=2)


def test_each_placeholder_becomes_its_images_tokens(preparer):
    two = [_image(3), _image(5)]
    ids = [1, 2, 292, IMAGE, 293, 7, 292, IMAGE, 293, 9]
    want = [1, 2, 292] + [IMAGE] * 3 + [293, 7, 292] + [IMAGE] * 5 + [293, 9]
    assert preparer.expand_placeholders(ids, two) == want
    assert preparer.expand_placeholders(want, two) == want  # expanded already: passed through
    assert preparer.expand_placeholders([5, IMAGE, IMAGE, 6], two) == [5] + [IMAGE] * 8 + [6]  # adjacent ones
    assert preparer.expand_placeholders([IMAGE], [_image(1)]) == [IMAGE]
    assert preparer.expand_placeholders([1, 2], []) == [1, 2]


def test_placeholders_unlike_the_images_are_refused(preparer):
    with pytest.raises(ImageError, match=f"holds 0 image placeholders for 1 images; put one image token .id {IMAGE}"):
        preparer.expand_placeholders([1, 2, 3], [_image(3)])
    with pytest.raises(ImageError, match="holds 2 image placeholders for 1 images"):
        preparer.expand_placeholders([IMAGE, 1, IMAGE], [_image(3)])
    with pytest.raises(ImageError, match="holds 1 image placeholders for 0 images"):
        preparer.expand_placeholders([1, IMAGE], [])
    with pytest.raises(ImageError, match=r"image 2's placeholder is 4 image tokens; it takes one .* or exactly 5"):
        preparer.expand_placeholders([IMAGE, 0] + [IMAGE] * 4, [_image(3), _image(5)])
