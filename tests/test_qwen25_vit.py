"""Qwen2.5-VL's windowed vision encoder against transformers' own, on a tiny random Qwen2.5-VL checkpoint saved by
transformers (every encoder tensor drawn, RMSNorm weights around 1) and images prepared by transformers' image
processor with 8-pixel patches, so that a few dozen pixels make several windows.

The windows are 3 x 3 merged tokens (48 pixels): the images' merged grids are smaller than one window, an exact
multiple of it, and neither, in both directions. Outputs are compared with ``torch.equal``: nanostream takes the
same float32 ops in the same order (Conv3d, the window permutation, one SDPA per window or frame)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
    Qwen3VLConfig,
)

from nanostream import ModelLoadError
from nanostream.models.vision import (
    QwenVisionEncoder,
    QwenVisionSpec,
    QwenWindowedEncoder,
    QwenWindowedSpec,
    load_vision_weights,
    vision_spec,
)
from nanostream.models.vision.qwen_vit_grid import window_grid
from nanostream.models.vision.tower import VisionTower

IMAGE = 290
VISION = dict(
    depth=4,
    hidden_size=32,
    intermediate_size=48,
    num_heads=2,
    patch_size=8,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=40,
    window_size=48,  # 3 merged tokens of 2 x 8 pixels a side
    fullatt_block_indexes=[1, 3],
)
TEXT = dict(
    hidden_size=40,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=300,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 4, 4]},
)
# (height, width) -> merged grid (rows, cols) with 16-pixel merged tokens
SIZES = {
    "2x2 inside one window": (32, 32),
    "4x4 one window and a rim": (64, 64),
    "6x6 exactly 2x2 windows": (96, 96),
    "3x7 wide": (48, 112),
    "10x5 tall": (160, 80),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory, transformers model) of a tiny Qwen2.5-VL checkpoint whose encoder tensors are all random."""
    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(vision_config=VISION, text_config=TEXT, image_token_id=IMAGE)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.model.visual.named_parameters():
            if "norm" in name or "ln_q" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.3)
    path = tmp_path_factory.mktemp("qwen2_5_vl")
    model.save_pretrained(path)
    processor = Qwen2VLImageProcessorPil(patch_size=8, temporal_patch_size=2, merge_size=2, min_pixels=256)
    processor.save_pretrained(path)
    return path, model


def _images(sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.random((h, w, 3)) * 255).astype(np.uint8) for h, w in sizes]


def _encoder(path):
    encoder = QwenWindowedEncoder(QwenWindowedSpec.from_config(AutoConfig.from_pretrained(path).vision_config))
    load_vision_weights(encoder, path)
    return encoder.eval()


CASES = {name: [size] for name, size in SIZES.items()}
CASES["two images"] = [SIZES["3x7 wide"], SIZES["4x4 one window and a rim"]]
CASES["three images"] = [SIZES["10x5 tall"], SIZES["2x2 inside one window"], SIZES["6x6 exactly 2x2 windows"]]


@pytest.mark.parametrize("sizes", CASES.values(), ids=CASES.keys())
def test_encoder_equals_transformers(checkpoint, sizes):
    path, model = checkpoint
    inputs = AutoImageProcessor.from_pretrained(path)(images=_images(sizes), return_tensors="pt")
    with torch.no_grad():
        want = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
        got = _encoder(path)(inputs["pixel_values"], inputs["image_grid_thw"])
    assert got.deepstack == ()
    per_image = got.split()
    assert len(per_image) == len(want) == len(sizes)
    for (embeds, deepstack), theirs in zip(per_image, want):
        assert embeds.shape == theirs.shape
        assert torch.equal(embeds, theirs)
        assert deepstack == ()


def test_frames_of_a_clip_equal_transformers(checkpoint):
    """Two-frame grids (a video's): each frame has its own windows and its own full-attention segment."""
    path, model = checkpoint
    grids = [(2, 6, 10), (1, 4, 4), (3, 4, 8)]
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 8 * 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model.model.visual(pixels, grid_thw=torch.tensor(grids)).pooler_output
        got = _encoder(path)(pixels, grids)
    assert torch.equal(got.embeds, want)
    assert got.tokens_per_image == (30, 4, 24)


def test_windows_follow_the_grid(checkpoint):
    """The window tables themselves: a 4 x 5 merged grid (8 x 10 patches) in windows of 3 merged tokens."""
    spec = QwenWindowedSpec.from_config(checkpoint[1].config.vision_config)
    grid = window_grid([(1, 8, 10)], spec)
    # windows of 3x3, 3x2, 1x3, 1x2 merged tokens, 4 patches each
    assert grid.windows == (36, 24, 12, 8)
    assert grid.frames == (80,)
    assert grid.order[:9].tolist() == [0, 1, 2, 5, 6, 7, 10, 11, 12]  # the first window, row by row
    assert sorted(grid.order.tolist()) == list(range(20))
    # a patch keeps its position through the permutation: merged token 5 is row 1, column 0 (patches 2-3, 0-1)
    assert grid.rows[12:16].tolist() == [2, 2, 3, 3] and grid.cols[12:16].tolist() == [0, 1, 0, 1]


def test_the_encoder_runs_in_bfloat16_close_to_float32(checkpoint):
    path, _ = checkpoint
    encoder = _encoder(path)
    inputs = AutoImageProcessor.from_pretrained(path)(images=_images([SIZES["3x7 wide"]]), return_tensors="pt")
    with torch.no_grad():
        want = encoder(inputs["pixel_values"], inputs["image_grid_thw"]).embeds
        got = encoder.to(torch.bfloat16)(inputs["pixel_values"], inputs["image_grid_thw"]).embeds
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.1 * want.abs().max().item())


def test_weights_load_under_either_prefix_and_every_tensor_is_checked(checkpoint, tmp_path):
    path, _ = checkpoint
    tensors = {k: v for k, v in load_file(path / "model.safetensors").items() if k.startswith("visual.")}
    reference = _encoder(path)

    def saved(renamed):
        for f in tmp_path.glob("*.safetensors"):
            f.unlink()
        save_file(renamed, tmp_path / "model.safetensors")
        return tmp_path

    encoder = QwenWindowedEncoder(reference.spec)
    load_vision_weights(encoder, saved({"model." + k: v for k, v in tensors.items()}))
    for (name, mine), (_, theirs) in zip(encoder.named_parameters(), reference.named_parameters(), strict=True):
        assert torch.equal(mine, theirs), name

    without = dict(tensors)
    del without["visual.merger.ln_q.weight"]
    with pytest.raises(ModelLoadError, match=r"lacks 1 vision encoder tensors \(first: merger.ln_q.weight\)"):
        load_vision_weights(QwenWindowedEncoder(reference.spec), saved(without))

    misshapen = dict(tensors, **{"visual.blocks.2.mlp.gate_proj.weight": torch.zeros(40, 32)})
    with pytest.raises(ModelLoadError, match=r"visual.blocks.2.mlp.gate_proj.weight has shape \(40, 32\)"):
        load_vision_weights(QwenWindowedEncoder(reference.spec), saved(misshapen))

    extra = dict(tensors, **{"visual.patch_embed.proj.bias": torch.zeros(32)})  # Qwen2.5-VL's conv has none
    with pytest.raises(ModelLoadError, match="visual.patch_embed.proj.bias has no place"):
        load_vision_weights(QwenWindowedEncoder(reference.spec), saved(extra))


def test_the_tower_builds_the_encoder_its_config_describes(checkpoint):
    path, model = checkpoint
    windowed = VisionTower(vision_spec(model.config.vision_config), IMAGE)
    encoder = windowed.build(path, dtype=torch.float32, device="cpu", load_format="auto")
    assert type(encoder) is QwenWindowedEncoder and not encoder.training
    assert torch.equal(encoder.blocks[3].norm2.weight, model.model.visual.blocks[3].norm2.weight)
    vision = {k: v for k, v in VISION.items() if k not in ("window_size", "fullatt_block_indexes")}
    qwen3 = Qwen3VLConfig(vision_config=dict(vision, num_position_embeddings=16, deepstack_visual_indexes=[1]))
    qwen3 = qwen3.vision_config
    dummy = VisionTower(vision_spec(qwen3), IMAGE).build(path, dtype=torch.float32, device="cpu", load_format="dummy")
    assert type(dummy) is QwenVisionEncoder


def test_config_reading(checkpoint):
    vision = checkpoint[1].config.vision_config
    spec = vision_spec(vision)
    assert spec == QwenWindowedSpec.from_config(vision.to_dict())
    assert (spec.window, spec.fullatt_block_indexes, spec.head_dim, spec.in_channels) == (3, (1, 3), 16, 3)
    # a Qwen2-VL-era config.json names the channels in_chans and has no rope_parameters
    old = {k: v for k, v in vision.to_dict().items() if k not in ("in_channels", "rope_parameters")}
    assert QwenWindowedSpec.from_config(dict(old, in_chans=1)) == dataclasses.replace(spec, in_channels=1)
    with pytest.raises(ModelLoadError, match="windowed attention"):
        QwenVisionSpec.from_config(vision)
    with pytest.raises(ModelLoadError, match="not a windowed"):
        QwenWindowedSpec.from_config({k: v for k, v in old.items() if k != "window_size"})
    with pytest.raises(ModelLoadError, match="hidden_act 'gelu'"):
        QwenWindowedSpec.from_config(dict(old, hidden_act="gelu"))
    with pytest.raises(ModelLoadError, match="smaller than one merged token"):
        QwenWindowedSpec.from_config(dict(old, window_size=8))
    with pytest.raises(ModelLoadError, match=r"fullatt_block_indexes \[4\]"):
        QwenWindowedSpec.from_config(dict(old, fullatt_block_indexes=[1, 4]))


def test_mismatched_inputs_are_refused(checkpoint):
    path, _ = checkpoint
    encoder = _encoder(path)
    inputs = AutoImageProcessor.from_pretrained(path)(images=_images([SIZES["3x7 wide"]]), return_tensors="pt")
    with pytest.raises(ValueError, match="describes"):
        encoder(inputs["pixel_values"][:-4], inputs["image_grid_thw"])
    with pytest.raises(ValueError, match="takes \\[patches, 384\\]"):
        encoder(inputs["pixel_values"][:, :-1], inputs["image_grid_thw"])
    with pytest.raises(ValueError, match="multiples of the spatial merge"):
        encoder(inputs["pixel_values"], [(1, 7, 12)])
