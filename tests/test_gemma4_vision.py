"""Gemma 4's images: the vision tower and embedder (``Gemma4VisionEncoder``) against transformers'
``get_image_features`` in float32, and ``Gemma4ImagePreparer`` against transformers' ``Gemma4Processor``, on the
tiny ``gemma4_vl`` checkpoint (4-pixel patches pooled 2 x 2, at most 70 tokens an image)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from test_siglip import MESSAGES
from transformers import (
    AutoImageProcessor,
    AutoTokenizer,
    Gemma4AudioFeatureExtractor,
    Gemma4ForConditionalGeneration,
    Gemma4Processor,
)

from nanostream.models.model_config import read_model_config
from nanostream.models.vision.gemma4_vit_spec import Gemma4VisionSpec
from nanostream.models.vision.tower import vision_tower
from nanostream.multimodal import ImageError, ImagePreparer
from nanostream.testing.tiny_model import TINY_PRESETS, make_tiny_model

SIZES = ((30, 70), (50, 50))  # (height, width) pixels: 10 x 24 and 16 x 16 patches, 60 and 64 tokens


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("gemma4_vl"), **TINY_PRESETS["gemma4_vl"])


class ImageOnlyProcessor(Gemma4Processor):
    """transformers' Gemma4Processor without a video processor (Gemma 4's needs torchvision, which the tests lack;
    images never reach it)."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


def _images(seed: int) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in SIZES]


def test_the_tower_is_gemma4s(checkpoint):
    tower = vision_tower(read_model_config(checkpoint))
    assert isinstance(tower.spec, Gemma4VisionSpec) and tower.merge == 2
    assert tower.both_ways is None  # the preset's text config: its images attend causally
    assert tower.image_token_id == AutoTokenizer.from_pretrained(checkpoint).image_token_id
    assert tower.spec.patch_pixels == 3 * 4 * 4 and tower.spec.num_tokens((1, 10, 24)) == 60


def test_images_attend_both_ways_on_sliding_layers_where_the_config_says_vision(tmp_path):
    preset = dict(TINY_PRESETS["gemma4_vl"], use_bidirectional_attention="vision", weights=False)
    tower = vision_tower(read_model_config(make_tiny_model(tmp_path, **preset)))
    assert tower.both_ways == "sliding"


@pytest.mark.parametrize("count", [1, 2])
def test_encoder_equals_transformers(checkpoint, count):
    model = Gemma4ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    encoder = vision_tower(read_model_config(checkpoint)).build(
        checkpoint, dtype=torch.float32, device="cpu", load_format="auto"
    )
    preparer = ImagePreparer.from_pretrained(checkpoint)
    images = _images(seed=count)[:count]
    want_in = AutoImageProcessor.from_pretrained(checkpoint, backend="pil")(images=images, return_tensors="pt")
    prepared = [preparer.prepare(image) for image in images]
    with torch.no_grad():
        want = model.model.get_image_features(want_in["pixel_values"], want_in["image_position_ids"]).pooler_output
        pixels = torch.cat([torch.from_numpy(p.pixels) for p in prepared])
        out = encoder(pixels, [p.grid for p in prepared])
    rows = [r for r, deepstack in out.split() if not deepstack]
    assert [r.shape[0] for r in rows] == [60, 64][:count] == [p.num_tokens for p in prepared]
    for got, expected in zip(rows, want, strict=True):
        assert expected.abs().mean() > 0.1
        # transformers pads every image to the processor's most patches (280), this batch to its largest image's:
        # sums of other lengths, equal to float32's rounding (to the bit where padded alike)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_grids_the_tower_cannot_take_are_refused(checkpoint):
    tower = vision_tower(read_model_config(checkpoint))
    assert tower.spec.grid_error((1, 10, 24)) is None
    for grid in [(1, 10, 23), (2, 10, 24), (1, 0, 4), (1, 258, 2)]:
        assert "multiples of 2 (the pooling kernel) and at most 256" in tower.spec.grid_error(grid)
    encoder = tower.build(checkpoint, dtype=torch.float32, device="cpu", load_format="dummy")
    with pytest.raises(ValueError, match=r"the patch grid \(1, 3, 4\) does not fit"):
        encoder(torch.zeros(12, 48), [(1, 3, 4)])
    with pytest.raises(ValueError, match=r"take \[16, 48\]"):
        encoder(torch.zeros(12, 48), [(1, 4, 4)])


@pytest.mark.parametrize("content", ["one", "two", "adjacent"])
def test_preparer_equals_gemma4_processor(checkpoint, content):
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    image_processor = AutoImageProcessor.from_pretrained(checkpoint, backend="pil")
    processor = ImageOnlyProcessor(
        Gemma4AudioFeatureExtractor(), image_processor, AutoTokenizer.from_pretrained(checkpoint), None
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
    for offset, image in zip(offsets, prepared, strict=True):
        assert ids[offset - 1] == preparer.boi_token_id and ids[offset + image.num_tokens] == preparer.eoi_token_id
        assert ids[offset : offset + image.num_tokens] == [preparer.image_token_id] * image.num_tokens
    positions = want["image_position_ids"]
    for k, image in enumerate(prepared):
        valid = (positions[k] != -1).all(-1)
        assert image.grid == (1, *(int(v) + 1 for v in positions[k][valid].max(0).values.flip(0)))
        assert image.num_tokens == int(valid.sum()) // 4
        assert np.array_equal(image.pixels, want["pixel_values"][k][valid].numpy())


def test_an_image_processor_saved_the_transformers_5_way_is_read(checkpoint, tmp_path):
    # A checkpoint saved by transformers 5's Gemma4Processor keeps its image processor as processor_config.json's
    # "image_processor" entry and has no preprocessor_config.json: its images are prepared as before, by the
    # engine's LLM and by a client from the files the engine's welcome carries.
    import json
    import shutil

    from nanostream.client.tokenizer_cache import load_image_preparer, load_tokenizer
    from nanostream.engine.process.welcome_files import files_digest, tokenizer_files

    path = shutil.copytree(checkpoint, tmp_path / "saved")
    nested = {"image_processor": json.loads((path / "preprocessor_config.json").read_text()), "image_seq_length": 70}
    (path / "processor_config.json").write_text(json.dumps(nested))
    (path / "preprocessor_config.json").unlink()
    image = _images(seed=3)[0]
    want = ImagePreparer.from_pretrained(checkpoint).prepare(image)
    files, _ = tokenizer_files(path, path)
    digest = files_digest(files)
    load_tokenizer(digest, files)
    for preparer in (ImagePreparer.from_pretrained(path), load_image_preparer(digest)[0]):
        got = preparer.prepare(image)
        assert got.grid == want.grid and np.array_equal(got.pixels, want.pixels)
    (path / "processor_config.json").write_text(json.dumps({"image_seq_length": 70}))  # a processor without images
    assert ImagePreparer.from_pretrained(path) is None


def test_placeholders_unlike_the_images_are_refused(checkpoint):
    preparer = ImagePreparer.from_pretrained(checkpoint)
    image = preparer.prepare(_images(0)[0])
    boi, token, eoi = preparer.boi_token_id, preparer.image_token_id, preparer.eoi_token_id
    with pytest.raises(ImageError, match="holds 0 image placeholders for 1 images"):
        preparer.place([1, 2], [image])
    with pytest.raises(ImageError, match="holds 2 image placeholders for 1 images"):
        preparer.place([token, 1, token], [image])
    with pytest.raises(ImageError, match="expanded to 3 image tokens; its grid \\(1, 10, 24\\) takes 60"):
        preparer.place([boi, token, token, token, eoi], [image])


@pytest.mark.parametrize("both_ways", ["vision", None])
def test_chat_with_images_equals_transformers_processor_and_model(tmp_path, both_ways):
    # A user's message with two images through LLM.chat: transformers' Gemma4Processor's ids, and its model's greedy
    # tokens and log-probabilities on them (image tokens seeing each other both ways on the windowed layers where
    # the config says "vision", each image token's per-layer input the pad token's); without the both-ways mask, or
    # attending causally where the config asks for it, the log-probabilities part.
    from nanostream import LLM, SamplingParams

    path = make_tiny_model(tmp_path, **dict(TINY_PRESETS["gemma4_vl"], use_bidirectional_attention=both_ways))
    tokenizer = AutoTokenizer.from_pretrained(path)
    processor = ImageOnlyProcessor(
        Gemma4AudioFeatureExtractor(), AutoImageProcessor.from_pretrained(path, backend="pil"), tokenizer, None
    )
    images = _images(seed=5)
    parts = [
        {"type": "text", "text": "The mill"},
        {"type": "image"},
        {"type": "text", "text": "and"},
        {"type": "image"},
    ]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True
    )
    inputs = processor(text=text, images=images, return_tensors="pt")
    hf = Gemma4ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    seq, want_lp = inputs["input_ids"][0].tolist(), []
    with torch.inference_mode():
        for _ in range(6):
            ids = torch.tensor([seq])
            types = (ids == hf.config.image_token_id).long()
            pixels = dict(pixel_values=inputs["pixel_values"], image_position_ids=inputs["image_position_ids"])
            logits = hf(input_ids=ids, mm_token_type_ids=types, **pixels).logits[0, -1]
            seq.append(int(logits.argmax()))
            want_lp.append(float(logits.log_softmax(-1)[seq[-1]]))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    content = [{"type": "text", "text": "The mill"}, {"type": "image", "image": images[0]},
               {"type": "text", "text": "and"}, {"type": "image", "image": images[1]}]  # fmt: skip
    runs = []
    for causal in (False, True):
        with LLM(str(path), device="cpu", dtype="float32", max_model_len=512) as llm:
            assert llm.engine.vision is not None
            if causal:
                llm.engine.runner.images.whole = None
            (out,) = llm.chat([{"role": "user", "content": content}], params, use_tqdm=False)
        runs.append((out.token_ids, [lp[t] for t, lp in zip(out.token_ids, out.outputs[0].logprobs)]))
        assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert runs[0][0] == seq[-6:] and np.allclose(runs[0][1], want_lp, atol=1e-4, rtol=0)
    causal_equal = runs[1][0] == seq[-6:] and np.allclose(runs[1][1], want_lp, atol=1e-4, rtol=0)
    assert causal_equal == (both_ways is None)


@pytest.mark.slow
def test_two_ranks_take_gemma4s_images_as_one_does(tmp_path):
    # The worker reads which layers see images whole from its Setup ("sliding": Gemma 4's windowed ones): tokens and
    # log-probabilities equal to one rank's (which equal transformers', above), through chunks, a preemption, a hit.
    from helpers import outputs_at_one_and_two_ranks

    from nanostream import SamplingParams

    path = make_tiny_model(tmp_path, **dict(TINY_PRESETS["gemma4_vl"], use_bidirectional_attention="vision"))
    preparer = ImagePreparer.from_pretrained(path)
    first, second = _images(seed=7)
    prompts = []
    for parts in ([6, first, 9], [6, first, 9, second, 4], [3, second, 7, first, 5]):
        ids = []
        for part in parts:
            ids += list(range(20, 20 + part)) if isinstance(part, int) else [preparer.image_token_id]
        images = [p for p in parts if not isinstance(p, int)]
        prompts.append({"prompt": ids, "multi_modal_data": {"image": images}})
    options = dict(device="cpu", dtype="float32", kvcache_block_size=8, max_model_len=512, max_num_batched_tokens=80,
                   max_num_seqs=3, num_kvcache_blocks=24)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0)
    one, two = outputs_at_one_and_two_ranks(path, prompts, params, **options)
    assert [o.token_ids for o in one] == [o.token_ids for o in two]
    for a, b in zip(one, two, strict=True):
        lp_one = [lp[t] for t, lp in zip(a.token_ids, a.outputs[0].logprobs)]
        lp_two = [lp[t] for t, lp in zip(b.token_ids, b.outputs[0].logprobs)]
        assert np.allclose(lp_one, lp_two, atol=1e-4, rtol=0)  # two ranks sum in another order: ~1e-5 apart
