"""The Qwen vision encoder against transformers' own, on tiny random Qwen3.5 and Qwen3-VL
checkpoints saved by transformers (every encoder tensor randomised, norms included) and images prepared by
transformers' image processor from the saved directory.

Encoder outputs (embeddings and Qwen3-VL's DeepStack features) are compared with ``torch.equal``: nanostream
takes the same float32 ops in the same order (Conv3d patch embedding, one SDPA per image)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    Qwen2_5_VLConfig,
    Qwen2VLImageProcessorPil,
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

from nanostream import ModelLoadError
from nanostream.models.vision import (
    QwenVisionEncoder,
    QwenVisionSpec,
    load_vision_weights,
)

IMAGE, VIDEO, START, END = 290, 291, 292, 293
VISION = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=48,
    num_position_embeddings=16,  # a 4 x 4 learned grid, resampled to every image
)
TEXT = dict(
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=24,
    vocab_size=300,
)
TOKENS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
SIZES = [(56, 56), (84, 140), (200, 120)]  # (height, width): square, wide, tall


def _qwen3_5():
    text = dict(
        TEXT,
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
    )
    return Qwen3_5ForConditionalGeneration(Qwen3_5Config(vision_config=VISION, text_config=text, **TOKENS))


def _qwen3_vl():
    vision = dict(VISION, deepstack_visual_indexes=[0, 2])
    return Qwen3VLForConditionalGeneration(Qwen3VLConfig(vision_config=vision, text_config=TEXT, **TOKENS))


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_vl"])
def checkpoint(request, tmp_path_factory):
    """(directory, transformers model) of a tiny checkpoint whose encoder tensors are all random."""
    torch.manual_seed(0)
    model = {"qwen3_5": _qwen3_5, "qwen3_vl": _qwen3_vl}[request.param]().eval()
    with torch.no_grad():
        for name, param in model.model.visual.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.3)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2).save_pretrained(path)
    return path, model


def _images(sizes, seed=0):
    rng = np.random.default_rng(seed)
    arrays = [(rng.random((h, w, 3)) * 255).astype(np.uint8) for h, w in sizes]
    return [Image.fromarray(a) if i % 2 else a for i, a in enumerate(arrays)]  # PIL images and arrays alike


def _encoder(path):
    encoder = QwenVisionEncoder(QwenVisionSpec.from_config(AutoConfig.from_pretrained(path).vision_config))
    load_vision_weights(encoder, path)
    return encoder.eval()


@pytest.mark.parametrize("sizes", [[s] for s in SIZES] + [SIZES[1:]], ids=["56x56", "84x140", "200x120", "two"])
def test_encoder_equals_transformers(checkpoint, sizes):
    path, model = checkpoint
    inputs = AutoImageProcessor.from_pretrained(path)(images=_images(sizes), return_tensors="pt")
    with torch.no_grad():
        want = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
        got = _encoder(path)(inputs["pixel_values"], inputs["image_grid_thw"])
    per_image = got.split()
    assert len(per_image) == len(want.pooler_output) == len(sizes)
    for i, (embeds, deepstack) in enumerate(per_image):
        assert torch.equal(embeds, want.pooler_output[i])
        want_deepstack = [level[i] for level in getattr(want, "deepstack_features", None) or []]
        levels = getattr(model.config.vision_config, "deepstack_visual_indexes", ())
        assert len(deepstack) == len(want_deepstack) == len(levels)
        for mine, theirs in zip(deepstack, want_deepstack):
            assert torch.equal(mine, theirs)


def test_batch_equals_one_at_a_time(checkpoint):
    path, _ = checkpoint
    encoder, processor = _encoder(path), AutoImageProcessor.from_pretrained(path)
    images = _images(SIZES, seed=1)
    with torch.no_grad():
        batch = encoder(**_encoder_inputs(processor, images)).split()
        alone = [encoder(**_encoder_inputs(processor, [image])).split()[0] for image in images]
    for (embeds, deepstack), (want, want_deepstack) in zip(batch, alone):
        torch.testing.assert_close(embeds, want, rtol=0, atol=1e-6)  # equal here; GEMM blocking may vary
        for mine, theirs in zip(deepstack, want_deepstack, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)


def _encoder_inputs(processor, images):
    inputs = processor(images=images, return_tensors="pt")
    return {"pixel_values": inputs["pixel_values"], "grid_thw": inputs["image_grid_thw"]}


def test_mismatched_inputs_and_checkpoints_are_refused(checkpoint, tmp_path):
    path, model = checkpoint
    encoder = _encoder(path)
    inputs = AutoImageProcessor.from_pretrained(path)(images=_images(SIZES[:1]), return_tensors="pt")
    with pytest.raises(ValueError, match="describes"):
        encoder(inputs["pixel_values"][:-4], inputs["image_grid_thw"])
    with pytest.raises(ModelLoadError, match="windowed attention"):
        QwenVisionSpec.from_config(Qwen2_5_VLConfig().vision_config)
    model.model.language_model.save_pretrained(tmp_path)  # a checkpoint with no vision tensors
    with pytest.raises(ModelLoadError, match="lacks"):
        load_vision_weights(encoder, tmp_path)
