"""Gemma 3's images: the SigLIP tower and projector (``SiglipEncoder``) against transformers'
``get_image_features`` in float32, and ``GemmaImagePreparer`` against transformers' ``Gemma3Processor``, on the
tiny ``gemma3_vl`` checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer, Gemma3ForConditionalGeneration, Gemma3Processor

from nanostream.models.model_config import read_model_config
from nanostream.models.vision.qwen_vit_spec import QwenVisionSpec
from nanostream.models.vision.siglip import SiglipSpec
from nanostream.models.vision.tower import vision_tower
from nanostream.multimodal import ImageError, ImagePreparer
from nanostream.testing.tiny_model import TINY_PRESETS, make_tiny_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("gemma3_vl"), **TINY_PRESETS["gemma3_vl"])


def _images(seed: int) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((30, 70), (90, 40))]


def _patch_rows(pixel_values: torch.Tensor, p: int) -> torch.Tensor:
    b, c, h, w = pixel_values.shape  # -> [b * h/p * w/p, c*p*p], row-major patches of (channel, row, column)
    return pixel_values.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(-1, c * p * p)


def test_the_tower_is_gemma3s(checkpoint):
    tower = vision_tower(read_model_config(checkpoint))
    assert isinstance(tower.spec, SiglipSpec) and tower.both_ways == "all" and tower.merge == 2
    assert tower.image_token_id == AutoTokenizer.from_pretrained(checkpoint).image_token_id
    assert tower.spec.grid == (1, 4, 4) and tower.spec.patch_pixels == 3 * 14 * 14


@pytest.mark.parametrize("count", [1, 2])
def test_encoder_equals_transformers(checkpoint, count):
    model = Gemma3ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tower = vision_tower(read_model_config(checkpoint))
    encoder = tower.build(checkpoint, dtype=torch.float32, device="cpu", load_format="auto")
    pixels = torch.randn(count, 3, 56, 56, generator=torch.Generator().manual_seed(count))
    with torch.no_grad():
        want = model.model.get_image_features(pixels).pooler_output  # [count, 4, text hidden]
        out = encoder(_patch_rows(pixels, 14), [(1, 4, 4)] * count)
    rows = [r for r, deepstack in out.split() if not deepstack]
    assert len(rows) == count and want.abs().mean() > 0.1
    for k in range(count):
        torch.testing.assert_close(rows[k], want[k], rtol=1e-6, atol=1e-6)
    if count == 1:
        assert torch.equal(rows[0], want[0])  # bit for bit


def test_grids_other_than_the_towers_are_refused(checkpoint):
    tower = vision_tower(read_model_config(checkpoint))
    assert tower.spec.grid_error((1, 4, 4)) is None
    assert "takes images of 56x56 pixels" in tower.spec.grid_error((1, 4, 8))
    encoder = tower.build(checkpoint, dtype=torch.float32, device="cpu", load_format="dummy")
    with pytest.raises(ValueError, match=r"the patch grid \(1, 8, 8\) is not \(1, 4, 4\)"):
        encoder(torch.zeros(64, 588), [(1, 8, 8)])
    qwen = QwenVisionSpec(
        depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=8, patch_size=4,
        temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16,
    )  # fmt: skip
    assert qwen.grid_error((1, 4, 6)) is None
    assert "positive multiples of 2" in qwen.grid_error((1, 4, 5))
    assert "positive multiples of 2" in qwen.grid_error((0, 4, 4))


MESSAGES = {  # a user message's parts: one image, two among text, two adjacent (test_gemma4_vision.py's too)
    "one": [{"type": "image"}, {"type": "text", "text": "The river."}],
    "two": [{"type": "text", "text": "The mill\n"}, {"type": "image"}, {"type": "text", "text": "and"},
            {"type": "image"}],
    "adjacent": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Seven boats."}],
}  # fmt: skip


@pytest.mark.parametrize("content", ["one", "two", "adjacent"])
def test_preparer_equals_gemma3_processor(checkpoint, content):
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    processor = Gemma3Processor(
        AutoImageProcessor.from_pretrained(checkpoint, backend="pil"), tokenizer, image_seq_length=4
    )
    parts = MESSAGES[content]
    text = tokenizer.apply_chat_template([{"role": "user", "content": parts}], tokenize=False)
    images = _images(seed=len(content))[: sum(p["type"] == "image" for p in parts)]
    want = processor(text=text, images=images, return_tensors="pt")
    preparer = ImagePreparer.from_pretrained(checkpoint)
    prepared = [preparer.prepare(image) for image in images]
    ids, offsets = preparer.place(tokenizer(text)["input_ids"], prepared)
    assert ids == want["input_ids"][0].tolist()
    assert preparer.place(ids, prepared) == (ids, offsets)  # expanded already: kept
    for offset in offsets:
        assert ids[offset - 1] == preparer.boi_token_id and ids[offset : offset + 4] == [preparer.image_token_id] * 4
    for image, rows in zip(prepared, _patch_rows(want["pixel_values"], 14).split(16)):
        assert image.grid == (1, 4, 4) and image.num_tokens == 4
        assert np.array_equal(image.pixels, rows.numpy())


def test_placeholders_unlike_the_images_are_refused(checkpoint):
    preparer = ImagePreparer.from_pretrained(checkpoint)
    image = preparer.prepare(_images(0)[0])
    boi, token = preparer.boi_token_id, preparer.image_token_id
    with pytest.raises(ImageError, match="holds 0 image placeholders for 1 images"):
        preparer.place([1, 2], [image])
    with pytest.raises(ImageError, match="image tokens .* outside"):
        preparer.place([boi, 1, token], [image])
