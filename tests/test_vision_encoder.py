"""The Qwen vision encoder and M-RoPE positions against transformers' own, on tiny random Qwen3.5 and Qwen3-VL
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
    mrope_decode_positions,
    mrope_positions,
    mrope_positions_range,
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


# M-RoPE: prompts as the processor expands them, <start> <image>*n <end> amid text


def _prompt(grids, texts, seed=0):
    """Token ids of texts[0] <image 0> texts[1] <image 1> ... texts[-1], texts[i] random text tokens long."""
    rng = np.random.default_rng(seed)
    ids = []
    for i, n in enumerate(texts):
        ids += rng.integers(0, 280, n).tolist()
        if i < len(grids):
            t, h, w = grids[i]
            ids += [START] + [IMAGE] * (t * h * w // 4) + [END]
    return ids


def _transformers_rope(model, ids, grids):
    input_ids = torch.tensor([ids])
    types = (input_ids == IMAGE).int()
    grid_thw = torch.tensor(grids) if grids else None
    positions, delta = model.model.get_rope_index(input_ids, mm_token_type_ids=types, image_grid_thw=grid_thw)
    return positions[:, 0], int(delta)


PROMPTS = {
    "text only": ([], [9]),
    "one image": ([(1, 6, 8)], [5, 7]),
    "image first and last": ([(1, 12, 8)], [0, 0]),
    "two images": ([(1, 4, 4), (1, 6, 12)], [3, 4, 6]),
    "two back to back, tall": ([(1, 16, 4), (1, 4, 4)], [2, 0, 1]),
}


@pytest.mark.parametrize("name", PROMPTS)
def test_mrope_positions_equal_get_rope_index(checkpoint, name):
    _, model = checkpoint
    grids, texts = PROMPTS[name]
    ids = _prompt(grids, texts)
    positions, delta = mrope_positions(ids, grids, image_token_id=IMAGE, spatial_merge_size=2)
    want_positions, want_delta = _transformers_rope(model, ids, grids)
    assert torch.equal(positions, want_positions)
    assert delta == want_delta
    assert (delta < 0) == bool(grids)  # an image's tokens take fewer positions than tokens


@pytest.mark.parametrize("chunk", [1, 5, 16])
@pytest.mark.parametrize("name", PROMPTS)
def test_mrope_chunks_and_decode_match_the_whole(checkpoint, name, chunk):
    """Prefill in chunks and 6 decoded tokens after it: the positions transformers gives the whole sequence
    (prompt and generated tokens), and those of its decode path (cache length + delta)."""
    _, model = checkpoint
    grids, texts = PROMPTS[name]
    prompt = _prompt(grids, texts)
    full = [*prompt, 7, 8, 9, 10, 11, 12]
    want, _ = _transformers_rope(model, full, grids)
    positions, delta = mrope_positions(prompt, grids, image_token_id=IMAGE, spatial_merge_size=2)
    chunks = [mrope_positions_range(positions, delta, s, min(s + chunk, len(full))) for s in range(0, len(full), chunk)]
    assert torch.equal(torch.cat(chunks, dim=1), want)
    decode = mrope_decode_positions(torch.arange(len(prompt), len(full)), torch.full((6,), delta))
    assert torch.equal(decode, want[:, len(prompt) :])
    # transformers' own decode path: the first generated token at cache length + the delta of the prompt
    _, prompt_delta = _transformers_rope(model, prompt, grids)
    model.model.rope_deltas = torch.tensor([[prompt_delta]])
    cache = type("Cache", (), {"get_seq_length": lambda self: len(prompt)})()
    try:
        step = model.model.compute_3d_position_ids(None, torch.zeros(1, 1, 48), cache=cache)
    finally:
        model.model.rope_deltas = None
    assert torch.equal(step[:, 0], decode[:, :1])


def test_mrope_refuses_placeholders_that_do_not_match_grids():
    ids = _prompt([(1, 4, 4)], [2, 2])
    with pytest.raises(ValueError, match="more image placeholder"):
        mrope_positions(ids, [], image_token_id=IMAGE, spatial_merge_size=2)
    with pytest.raises(ValueError, match="image grids were given"):
        mrope_positions(ids, [(1, 4, 4), (1, 4, 4)], image_token_id=IMAGE, spatial_merge_size=2)
    with pytest.raises(ValueError, match="consecutive placeholder"):
        mrope_positions(ids, [(1, 6, 4)], image_token_id=IMAGE, spatial_merge_size=2)
