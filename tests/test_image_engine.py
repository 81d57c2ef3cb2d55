"""Images through the engine (issue 58): tiny random Qwen3.5, Qwen3-VL and Qwen2.5-VL checkpoints (every tensor
drawn), images prepared by transformers' own image processor, greedy float32 tokens identical to transformers' model on
the same inputs; chunks that cut an image, two images in a prompt, the encoder cache and prefix hits over images
(the same text with another image hits nothing of it), and the engine's refusals of images that do not fit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

from nanostream import InvalidRequestError, SamplingParams
from nanostream.config import EngineConfig
from nanostream.engine.llm_engine import LLMEngine
from nanostream.protocol import ImageInput
from nanostream.testing import TINY_PRESETS, make_tiny_model

ENGINE = dict(device="cpu", dtype="float32", kvcache_block_size=8, state_snapshot_interval=16)


@pytest.fixture(scope="module", params=["qwen3_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen25_vl"])
def vl(request, tmp_path_factory):
    """(directory, transformers model, image processor, placeholder ids) of a tiny vision-language model: Qwen3.5's
    (hybrid layers), Qwen3-VL's (a Qwen3 decoder, DeepStack features added to its first two layers' output; its MoE),
    Qwen2.5-VL's (a Qwen2 decoder, M-RoPE in three runs, a windowed encoder)."""
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), **TINY_PRESETS[request.param])
    config = AutoConfig.from_pretrained(path)
    ids = dict(image=config.image_token_id, start=config.vision_start_token_id, end=config.vision_end_token_id)
    hf = getattr(transformers, config.architectures[0]).from_pretrained(path, dtype=torch.float32).eval()
    return path, hf, AutoImageProcessor.from_pretrained(path), ids


def _image(h, w, seed):
    return Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype(np.uint8))


def _request(vl, parts, seed=0):
    """(prompt ids, [ImageInput], pixel_values, grids) of text runs (ints: that many random tokens) and images."""
    _, _, processor, tok = vl
    rng = np.random.default_rng(seed)
    ids, images, pixels, grids = [], [], [], []
    for part in parts:
        if isinstance(part, int):
            ids += rng.integers(0, 500, part).tolist()
            continue
        out = processor(images=[part], return_tensors="pt")
        grid = tuple(int(v) for v in out["image_grid_thw"][0])
        n = grid[0] * grid[1] * grid[2] // 4
        ids.append(tok["start"])
        images.append(ImageInput(len(ids), grid, out["pixel_values"].numpy().astype("<f4").tobytes()))
        ids += [tok["image"]] * n + [tok["end"]]
        pixels.append(out["pixel_values"])
        grids.append(grid)
    return ids, images, (torch.cat(pixels) if pixels else None), grids


@torch.inference_mode()
def _hf_greedy(vl, ids, pixels, grids, n):
    """transformers' greedy tokens: the whole sequence through its model at every step (no cache to go wrong)."""
    hf, image = vl[1], vl[3]["image"]
    seq = list(ids)
    for _ in range(n):
        input_ids = torch.tensor([seq])
        extra = {}
        if pixels is not None:
            extra = dict(pixel_values=pixels, image_grid_thw=torch.tensor(grids),
                         mm_token_type_ids=(input_ids == image).int())  # fmt: skip
        seq.append(int(hf(input_ids=input_ids, **extra).logits[0, -1].argmax()))
    return seq[len(ids) :]


def _engine(vl, **options):
    return LLMEngine(EngineConfig(str(vl[0]), **{**ENGINE, **options}))


def _run(engine, requests, n, logprobs=None):
    """Each (prompt ids, images) request's greedy tokens and cached prompt tokens, run together; each token's
    log-probability appended to ``logprobs`` where given."""
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)
    for i, (ids, images) in enumerate(requests):
        engine.add_request(f"r{i}", ids, params, images)
    tokens, cached = {}, {}
    while engine.has_unfinished():
        for delta in engine.step().deltas:
            tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
            if logprobs is not None:
                logprobs += [lp[t] for t, lp in zip(delta.token_ids, delta.logprobs, strict=True)]
            if delta.usage is not None:
                cached[delta.request_id] = delta.usage.cached_tokens
    keys = [f"r{i}" for i in range(len(requests))]
    return [tokens[k] for k in keys], [cached.get(k, 0) for k in keys]


REQUESTS = {
    "one image": [5, _image(40, 56, 1), 7],
    "image first and last": [_image(48, 32, 2)],
    "two images, tall and wide": [3, _image(64, 16, 3), 4, _image(24, 72, 4), 6],
    "text only": [23],
}


def test_greedy_tokens_with_images_equal_transformers(vl):
    requests = [_request(vl, parts, seed=i) for i, parts in enumerate(REQUESTS.values())]
    got, _ = _run(_engine(vl), [(ids, images) for ids, images, _, _ in requests], 12)
    for name, (ids, _, pixels, grids), tokens in zip(REQUESTS, requests, got, strict=True):
        assert tokens == _hf_greedy(vl, ids, pixels, grids, 12), name


def test_chunks_that_cut_images_and_preemption_give_the_same_tokens(vl):
    requests = [_request(vl, parts, seed=i) for i, parts in enumerate(REQUESTS.values())]
    whole, _ = _run(_engine(vl), [(ids, images) for ids, images, _, _ in requests], 12)
    engine = _engine(vl, max_num_batched_tokens=13, max_num_seqs=2, num_kvcache_blocks=12)
    chunked, _ = _run(engine, [(ids, images) for ids, images, _, _ in requests], 12)
    assert chunked == whole
    assert engine.stats().steps["mixed"] + engine.stats().steps["prefill"] > len(requests)


def test_a_repeated_image_is_encoded_once_and_hits_the_prefix_cache_another_image_does_not(vl):
    first = _request(vl, [9, _image(40, 56, 5), 20], seed=7)
    engine = _engine(vl)
    _run(engine, [first[:2]], 4)
    assert engine.runner.images.images_encoded == 1
    again, cached = _run(engine, [first[:2]], 8)  # the same prompt: its blocks up to the last snapshot
    assert engine.runner.images.images_encoded == 1 and cached[0] >= 16
    assert again[0] == _hf_greedy(vl, first[0], first[2], first[3], 8)
    other = _request(vl, [9, _image(40, 56, 6), 20], seed=7)  # the same token ids, another image
    assert other[0] == first[0]
    tokens, cached = _run(engine, [other[:2]], 8)
    assert cached[0] <= 8  # the one block before the image
    assert tokens[0] == _hf_greedy(vl, other[0], other[2], other[3], 8)
    assert engine.runner.images.images_encoded == 2


def _refusal(engine, ids, images):
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("bad", ids, SamplingParams(max_tokens=2), images)
    return str(info.value)


def test_images_that_do_not_fit_are_refused_and_the_engine_serves_on(vl):
    engine = _engine(vl, limit_images_per_prompt=2)
    ids, (image,), _, _ = _request(vl, [4, _image(40, 56, 8), 3])
    t, h, w = image.grid
    nan = np.frombuffer(image.pixels, dtype="<f4").copy()
    nan[5] = np.nan
    cases = {
        "no placeholders": (ids[:4], [image], "overlap the image before it or run past"),
        "placeholders, no image": (ids, [], "but no images"),
        "too many": (ids, [image] * 3, "at most 2 images"),
        "short pixels": (ids, [ImageInput(image.offset, image.grid, image.pixels[:-4])], "bytes of pixel rows"),
        "odd grid": (ids, [ImageInput(image.offset, (t, h + 1, w), image.pixels)], "multiples of 2"),
        "huge grid": (ids, [ImageInput(image.offset, (1, 2**40, 2**40), image.pixels)], "bytes of pixel rows"),
        "NaN": (ids, [ImageInput(image.offset, image.grid, nan.tobytes())], "NaN"),
        "wrong offset": (ids, [ImageInput(image.offset + 1, image.grid, image.pixels)], "placeholder tokens"),
        "negative offset": (ids, [ImageInput(-3, image.grid, image.pixels)], "negative"),
    }
    for name, (prompt, images, says) in cases.items():
        assert says in _refusal(engine, prompt, images), name
    assert not engine.has_unfinished()
    tokens, _ = _run(engine, [(ids, [image])], 4)
    assert len(tokens[0]) == 4


def test_a_text_model_refuses_images(tmp_path, vl):
    text = make_tiny_model(tmp_path, **TINY_PRESETS["qwen3_5"])
    ids, images, _, _ = _request(vl, [4, _image(40, 56, 8), 3])
    engine = LLMEngine(EngineConfig(str(text), **ENGINE))
    ids = [t % 500 for t in ids]
    assert "takes no images" in _refusal(engine, ids, images)
    assert AutoTokenizer.from_pretrained(text) is not None


def _data_url(image):
    import base64
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _chat_reference(vl, text, image, n):
    """transformers' greedy reply to one user message of ``text`` and ``image``: the template's ids with the image
    token widened to the processor's grid, as transformers' own processor widens it."""
    path, _, processor, tok = vl
    tokenizer = AutoTokenizer.from_pretrained(path)
    content = [{"type": "text", "text": text}, {"type": "image"}]
    messages = [{"role": "user", "content": content}]
    ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    out = processor(images=[image], return_tensors="pt")
    grid = tuple(int(v) for v in out["image_grid_thw"][0])
    at = ids.index(tok["image"])
    ids = ids[:at] + [tok["image"]] * (grid[0] * grid[1] * grid[2] // 4) + ids[at + 1 :]
    return _hf_greedy(vl, ids, out["pixel_values"], [grid], n)


def test_llm_chat_and_generate_take_images_as_users_send_them(vl):
    from nanostream import LLM

    image = _image(40, 56, 9)
    want = _chat_reference(vl, "What is in it?", image, 10)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    url = {"type": "image_url", "image_url": {"url": _data_url(image)}}
    with LLM(str(vl[0]), **ENGINE) as llm:
        (chat,) = llm.chat([{"role": "user", "content": [{"type": "text", "text": "What is in it?"}, url]}], params,
                           use_tqdm=False)  # fmt: skip
        prompt = "<|im_start|>user\nWhat is in it?<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n"
        prompt += "<|im_start|>assistant\n"
        (raw,) = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, params, use_tqdm=False)
        with pytest.raises(InvalidRequestError, match="1 image placeholders for 2 images"):
            llm.generate({"prompt": prompt, "multi_modal_data": {"image": [image, image]}}, params)
    assert chat.token_ids == raw.token_ids == want


def test_qwen3_vl_moe_loads_its_experts_as_published_inputs_first(tmp_path):
    # Qwen3-VL-MoE's checkpoints stack their experts inputs first ([E, H, 2I], [E, I, H]); transformers saves (and
    # reads) either: the same model from both layouts gives the same tokens.
    import shutil

    from safetensors.torch import load_file, save_file

    from nanostream import LLM

    saved = make_tiny_model(tmp_path / "saved", **TINY_PRESETS["qwen3_vl_moe"])
    published = tmp_path / "published"
    shutil.copytree(saved, published)
    tensors = load_file(saved / "model.safetensors")
    stacked = [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert stacked
    tensors |= {k: tensors[k].transpose(1, 2).contiguous() for k in stacked}
    save_file(tensors, published / "model.safetensors", metadata={"format": "pt"})
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 17, 300, 42, 9] * 6]
    outputs = []
    for path in (saved, published):
        with LLM(str(path), **ENGINE) as llm:
            outputs.append(llm.generate(prompts, params, use_tqdm=False)[0].token_ids)
    assert outputs[0] == outputs[1]
    hf = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(published, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf.generate(torch.tensor(prompts), max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, 30:]
    assert outputs[1] == want.tolist()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3_vl", "qwen3_5_vl"])
def test_two_ranks_take_images_as_one_does(name, tmp_path):
    # Rank 0 alone holds the encoder: each step's image rows (and Qwen3-VL's DeepStack features) reach the worker
    # by broadcast, and each chunk's M-RoPE positions by the step's message; chunks cut the images, a request is
    # preempted, the second prompt hits the first's prefix (its image) in the cache.
    from helpers import outputs_at_one_and_two_ranks

    path = make_tiny_model(tmp_path / name, **TINY_PRESETS[name])
    processor = AutoImageProcessor.from_pretrained(path)
    vl = (path, None, processor, _placeholders(path))
    first, second = _image(40, 56, 11), _image(48, 32, 12)
    prompts = []
    for parts in ([6, first, 9], [6, first, 9, second, 4], [3, second, 7, first, 5]):
        ids, *_ = _request(vl, parts, seed=3)
        prompts.append({"prompt": ids, "multi_modal_data": {"image": [p for p in parts if not isinstance(p, int)]}})
    options = dict(ENGINE, max_num_batched_tokens=24, max_num_seqs=3, num_kvcache_blocks=20)
    one, two = outputs_at_one_and_two_ranks(path, prompts, SamplingParams(temperature=0.0, max_tokens=12), **options)
    assert [o.token_ids for o in one] == [o.token_ids for o in two]


def _placeholders(path):
    config = AutoConfig.from_pretrained(path)
    return dict(image=config.image_token_id, start=config.vision_start_token_id, end=config.vision_end_token_id)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_on_a_gpu_images_give_the_cpu_engines_tokens(backend, vl):
    # The encoder on the device (its largest batch encoded at start-up, inside the memory measurement), image rows
    # and [3, T] positions in eager prompt steps, the decode steps' CUDA graphs with M-RoPE's one position a row;
    # float32, so the tokens are the CPU's.
    requests = [_request(vl, parts, seed=i) for i, parts in enumerate(REQUESTS.values())]
    inputs = [(ids, images) for ids, images, _, _ in requests]
    cpu, _ = _run(_engine(vl), inputs, 12)
    # (the torch backend's float32 experts have no grouped_mm on CUDA to capture: the MoE model decodes eagerly there)
    eager = backend == "torch" and "Moe" in type(vl[1]).__name__
    options = dict(device="cuda", attention_backend=backend, max_num_seqs=8, enforce_eager=eager)
    gpu, _ = _run(_engine(vl, **options), inputs, 12)
    assert gpu == cpu
