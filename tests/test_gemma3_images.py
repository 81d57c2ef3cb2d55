"""Gemma 3's images through the engine (issue 58): a tiny random Gemma3ForConditionalGeneration (SigLIP tower,
projector, every norm drawn), images prepared by nanostream's preparer (equal to transformers' Gemma3Processor:
tests/test_siglip.py), greedy float32 tokens identical to transformers' model given the same ids, pixels and
token types; an image's tokens attend to each other both ways, so steps never cut one, which holds across chunked
prefill, preemption and prefix hits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from test_image_engine import _image, _run

from nanostream import InvalidRequestError, SamplingParams
from nanostream.config import EngineConfig
from nanostream.engine.llm_engine import LLMEngine
from nanostream.multimodal.processor import ImagePreparer
from nanostream.protocol import ImageInput
from nanostream.testing import TINY_PRESETS, make_tiny_model

ENGINE = dict(device="cpu", dtype="float32", kvcache_block_size=4)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("gemma3_vl"), **TINY_PRESETS["gemma3_vl"])
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf, ImagePreparer.from_pretrained(path)


def _request(gemma, parts, seed=0):
    """(prompt ids, [ImageInput], [prepared images]) of text runs (ints: that many random tokens) and images."""
    preparer = gemma[2]
    rng = np.random.default_rng(seed)
    ids, prepared = [], []
    for part in parts:
        if isinstance(part, int):
            ids += rng.integers(0, 400, part).tolist()
        else:
            ids.append(preparer.boi_token_id)
            prepared.append(preparer.prepare(part))
    ids, offsets = preparer.place(ids, prepared)
    images = [ImageInput(o, p.grid, p.pixels.astype("<f4").tobytes()) for o, p in zip(offsets, prepared)]
    return ids, images, prepared


@torch.inference_mode()
def _hf_greedy(gemma, ids, prepared, n, logprobs=None):
    """transformers' greedy tokens, the whole sequence through its model at each step, its image tokens typed 1;
    each one's log-probability appended to ``logprobs`` where given."""
    hf, preparer = gemma[1], gemma[2]
    size, p = hf.config.vision_config.image_size, hf.config.vision_config.patch_size
    pixels = None
    if prepared:  # the patch rows back into [N, 3, H, W] images
        side = size // p
        rows = torch.stack([torch.from_numpy(i.pixels) for i in prepared]).view(-1, side, side, 3, p, p)
        pixels = rows.permute(0, 3, 1, 4, 2, 5).reshape(-1, 3, size, size)
    seq = list(ids)
    for _ in range(n):
        input_ids = torch.tensor([seq])
        types = (input_ids == preparer.image_token_id).long()
        out = hf(input_ids=input_ids, pixel_values=pixels, token_type_ids=types)
        seq.append(int(out.logits[0, -1].argmax()))
        if logprobs is not None:
            logprobs.append(float(out.logits[0, -1].log_softmax(-1)[seq[-1]]))
    return seq[len(ids) :]


def _engine(gemma, **options):
    return LLMEngine(EngineConfig(str(gemma[0]), **{**ENGINE, **options}))


REQUESTS = {
    "one image": [5, _image(40, 56, 1), 7],
    "image first": [_image(48, 32, 2), 3],
    "two images": [3, _image(64, 16, 3), 4, _image(24, 72, 4), 6],
    "text only": [23],
}


def test_greedy_tokens_with_images_equal_transformers_whole_and_in_chunks(gemma):
    requests = [_request(gemma, parts, seed=i) for i, parts in enumerate(REQUESTS.values())]
    whole, _ = _run(_engine(gemma), [(ids, images) for ids, images, _ in requests], 10)
    for name, (ids, _, prepared), tokens in zip(REQUESTS, requests, whole, strict=True):
        assert tokens == _hf_greedy(gemma, ids, prepared, 10), name
    # Steps of 9 tokens (a step that ended inside an image would give other tokens), two sequences at a time in 48
    # blocks of 4 (three KV groups: sliding and full layers): chunks, preemption, and never an image cut.
    engine = _engine(gemma, max_num_batched_tokens=9, max_num_seqs=2, num_kvcache_blocks=40)
    chunked, _ = _run(engine, [(ids, images) for ids, images, _ in requests], 10)
    assert chunked == whole
    assert engine.stats().steps["mixed"] + engine.stats().steps["prefill"] > len(requests)
    assert engine.scheduler.num_preemptions > 0


def test_the_engine_without_the_both_ways_mask_parts_from_transformers(gemma):
    # The tiny model's greedy tokens barely depend on the mask, its log-probabilities do: the engine's equal
    # transformers' with the mask, and part from them attending to image tokens causally.
    ids, images, prepared = _request(gemma, [5, _image(40, 56, 1), 7, _image(48, 32, 2), 2], seed=3)
    expected: list[float] = []
    tokens = _hf_greedy(gemma, ids, prepared, 6, expected)
    for whole in (True, False):
        engine, got = _engine(gemma), []
        if not whole:
            engine.runner.images.whole = None  # no q_last: the image tokens attend causally
        assert _run(engine, [(ids, images)], 6, got)[0][0] == tokens
        close = np.allclose(got, expected, atol=1e-4, rtol=0)
        assert close == whole, (whole, got, expected)


def test_a_repeated_image_hits_the_prefix_cache_with_a_cold_runs_tokens(gemma):
    first = _request(gemma, [9, _image(40, 56, 5), 20], seed=7)
    engine = _engine(gemma)
    _run(engine, [first[:2]], 4)
    again, cached = _run(engine, [first[:2]], 8)
    assert cached[0] >= 16 and engine.runner.images.images_encoded == 1
    assert again[0] == _hf_greedy(gemma, first[0], first[2], 8)
    other = _request(gemma, [9, _image(40, 56, 6), 20], seed=7)  # the same ids, another image
    assert other[0] == first[0]
    tokens, cached = _run(engine, [other[:2]], 8)
    assert cached[0] <= 12 and tokens[0] == _hf_greedy(gemma, other[0], other[2], 8)


def test_images_gemma_cannot_take_are_refused(gemma):
    ids, images, _ = _request(gemma, [3, _image(40, 56, 1), 2])
    engine = _engine(gemma, max_num_batched_tokens=3, max_num_seqs=2)  # an image's 4 tokens fit one step
    with pytest.raises(InvalidRequestError, match="max_num_batched_tokens >= 4"):
        engine.add_request("big", ids, SamplingParams(max_tokens=2), images)
    bad = [ImageInput(images[0].offset, (1, 8, 2), images[0].pixels)]
    with pytest.raises(InvalidRequestError, match=r"the patch grid \(1, 8, 2\) is not \(1, 4, 4\)"):
        _engine(gemma).add_request("grid", ids, SamplingParams(max_tokens=2), bad)


def test_llm_chat_with_an_image_equals_transformers_processor_and_model(gemma):
    # A user's message with a data-URL image through LLM.chat: the tokens transformers' model gives the ids,
    # pixels and token types of transformers' own Gemma3Processor for the same message.
    import base64
    import io

    from transformers import AutoImageProcessor, AutoTokenizer, Gemma3Processor

    from nanostream import LLM

    path, hf, _ = gemma
    image = _image(40, 56, 9)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    tokenizer = AutoTokenizer.from_pretrained(path)
    processor = Gemma3Processor(AutoImageProcessor.from_pretrained(path, backend="pil"), tokenizer, image_seq_length=4)
    parts = [{"type": "text", "text": "What is in it?"}, {"type": "image"}]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True
    )
    inputs = processor(text=text, images=[image], return_tensors="pt")
    seq = inputs["input_ids"][0].tolist()
    with torch.inference_mode():
        for _ in range(8):
            ids = torch.tensor([seq])
            types = (ids == hf.config.image_token_id).long()
            seq.append(
                int(hf(input_ids=ids, pixel_values=inputs["pixel_values"], token_type_ids=types).logits[0, -1].argmax())
            )
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(str(path), **ENGINE) as llm:
        content = [{"type": "text", "text": "What is in it?"}, {"type": "image_url", "image_url": {"url": url}}]
        (chat,) = llm.chat([{"role": "user", "content": content}], params, use_tqdm=False)
    assert chat.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert chat.token_ids == seq[-8:]


@pytest.mark.slow
def test_two_ranks_let_an_images_tokens_see_each_other_as_one_rank_does(gemma):
    # The worker takes each step's image rows by broadcast and their both-ways mask from its own reading of them
    # (Setup.images_whole): equal tokens and log-probabilities to one rank's (which equal transformers', above),
    # through chunks that stop before images, a preemption and a prefix hit.
    from helpers import outputs_at_one_and_two_ranks

    first, second = _image(40, 56, 11), _image(48, 32, 12)
    prompts = []
    for parts in ([6, first, 9], [6, first, 9, second, 4], [3, second, 7, first, 5]):
        ids, *_ = _request(gemma, parts, seed=3)
        prompts.append({"prompt": ids, "multi_modal_data": {"image": [p for p in parts if not isinstance(p, int)]}})
    options = dict(ENGINE, max_num_batched_tokens=12, max_num_seqs=3, num_kvcache_blocks=40)
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=0)
    one, two = outputs_at_one_and_two_ranks(gemma[0], prompts, params, **options)
    assert [o.token_ids for o in one] == [o.token_ids for o in two]
    for a, b in zip(one, two):
        lp_one = [lp[t] for t, lp in zip(a.token_ids, a.outputs[0].logprobs)]
        lp_two = [lp[t] for t, lp in zip(b.token_ids, b.outputs[0].logprobs)]
        assert np.allclose(lp_one, lp_two, atol=1e-4, rtol=0)  # two ranks sum in another order: ~1e-5 apart


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "flash_attn"])
def test_on_a_gpu_gemma3_images_give_the_cpu_engines_tokens_and_logprobs(backend, gemma):
    # The compiled prefill kernel with each image row's last key (flash_attn hands those steps to it), the encoder
    # on the device, the decode CUDA graphs after; float32, so the tokens and log-probabilities are the CPU's.
    requests = [_request(gemma, parts, seed=i) for i, parts in enumerate(REQUESTS.values())]
    inputs = [(ids, images) for ids, images, _ in requests]
    cpu_lp, gpu_lp = [], []
    cpu, _ = _run(_engine(gemma), inputs, 10, cpu_lp)
    try:
        engine = _engine(gemma, device="cuda", attention_backend=backend, max_num_seqs=8, gpu_memory_utilization=0.3)
    except ValueError as exc:  # flash_attn not installed or not for this GPU
        pytest.skip(str(exc))
    gpu, _ = _run(engine, inputs, 10, gpu_lp)
    assert gpu == cpu
    assert np.allclose(gpu_lp, cpu_lp, atol=1e-3, rtol=0)
