"""Images in: the bench workload with one image a request against the same requests without, one process, one GPU.

    python3 apps/bench_images.py --preset qwen3.5-9b-vl                        # 256 requests, 448 x 448 images
    python3 apps/bench_images.py --tiny-config '{"architecture": "Qwen3_5ForConditionalGeneration"}' \\
        --num-requests 8 --max-input-len 64 --max-output-len 16 --image-size 64   # the flow, on a CPU

Each request of nano-vLLM's workload (apps/workload.py: seed 0, its prompt and output lengths) gets one image of
``--image-size`` pixels square, each its own (random pixel rows, as the model's processor would give them: the
image's ``(size / patch)²`` patches, ``(size / patch / merge)²`` placeholder tokens between the vision start and
end tokens, ahead of the text). The same requests then run without their images (the text alone). Printed: output
tok/s and mean / p50 / p99 TTFT of each run, and the encoder's share: the seconds the encoder takes for all the
images (encoded apart, in the batches a step would, synchronised) over the run with images. The workload's ids
that mark images (the tokenizer's image, video, vision start and end tokens) are replaced by a plain id in both runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import workload as w
from transformers import AutoConfig

from nanostream import LLM
from nanostream.engine.images import check_images
from nanostream.options import add_engine_args
from nanostream.protocol import ImageInput


def image_requests(llm: LLM, config, workload: list, size: int) -> list[tuple[list[int], list[ImageInput]]]:
    """(prompt ids, [its one image]) of each request: the image's placeholders first, then the workload's ids."""
    tower = llm.engine.vision
    if tower is None:
        raise SystemExit("the model takes no images: use a vision-language preset (qwen3.5-9b-vl)")
    side = size // tower.spec.patch_size // tower.merge * tower.merge  # patches a side, whole merged tokens
    grid = (1, side, side)
    tokens = side * side // tower.merge**2
    start, end = config.vision_start_token_id, config.vision_end_token_id
    rng = np.random.default_rng(0)
    requests = []
    for r in workload:
        pixels = rng.standard_normal((side * side, tower.spec.patch_pixels), dtype=np.float32).tobytes()
        ids = [start] + [tower.image_token_id] * tokens + [end] + r.prompt_token_ids
        requests.append((ids, [ImageInput(1, grid, pixels)]))
    return requests


def without_vision_ids(config, workload: list) -> list:
    """The workload with each id that marks images (the image, video, vision start and end tokens: the random ids
    0-10,000 hold them where a tokenizer's specials sit low) replaced by the lowest id that marks none; the engine
    refuses placeholders that no image fills. ``config``: the model's (transformers')."""
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    marks = {v for v in (getattr(config, n, None) for n in names) if v is not None}
    plain = min(set(range(len(marks) + 1)) - marks)
    return [w.Request([plain if t in marks else t for t in r.prompt_token_ids], r.max_tokens) for r in workload]


def run(llm: LLM, prompts: list, workload: list) -> tuple[float, int, list[float]]:
    """(seconds, output tokens, each request's TTFT) of the requests through the engine, all added at once."""
    engine = llm.engine
    w.sync(llm.config.device)
    start = time.perf_counter()
    first: dict[str, float] = {}
    out = 0
    for i, ((ids, images), r) in enumerate(zip(prompts, workload, strict=True)):
        engine.add_request(f"r{i}", ids, w.params_of(r), images)
    while engine.has_unfinished():
        for delta in engine.step().deltas:
            if delta.token_ids and delta.request_id not in first:
                first[delta.request_id] = time.perf_counter() - start
            out += len(delta.token_ids)
    w.sync(llm.config.device)
    return time.perf_counter() - start, out, list(first.values())


def encoder_seconds(llm: LLM, prompts: list) -> float:
    """The encoder's time for every image, in the batches the engine's steps would make (max_patches a call)."""
    rows = llm.engine.runner.images
    checked = [
        check_images(ids, images, llm.engine.vision, llm.config, mrope=llm.engine.mrope) for ids, images in prompts
    ]
    images = [i for c in checked for i in c.images]
    rows.cache.clear()
    rows.rows_held = 0
    w.sync(llm.config.device)
    start = time.perf_counter()
    for k in range(0, len(images), 8):
        rows._encode(images[k : k + 8], llm.engine.runner.device)
        rows.cache.clear()
    w.sync(llm.config.device)
    return time.perf_counter() - start


def line(name: str, seconds: float, tokens: int, ttfts: list[float]) -> str:
    ttfts = sorted(ttfts)
    p99 = ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]
    return (
        f"{name:<12} {tokens / seconds:>10,.1f} output tok/s  TTFT mean {statistics.mean(ttfts):.3f} s, "
        f"p50 {statistics.median(ttfts):.3f} s, p99 {p99:.3f} s  ({seconds:.2f} s, {tokens:,} tokens)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    w.add_workload_args(parser)
    parser.add_argument("--image-size", type=int, default=448, help="each image's side, in pixels (default 448)")
    add_engine_args(parser, skip=("seed",))
    args = parser.parse_args()
    w.check_workload_args(parser, args)
    with w.model_dir(args) as path:
        options = w.engine_options(args)
        _, _, workload = w.load_workload(args, path, options)
        with LLM(str(path), **options) as llm:
            config = AutoConfig.from_pretrained(llm.engine.model_path)
            workload = without_vision_ids(config, workload)
            with_images = image_requests(llm, config, workload, args.image_size)
            text_only = [(r.prompt_token_ids, []) for r in workload]
            run(llm, with_images[:2], [w.Request(r.prompt_token_ids, 8) for r in workload[:2]])  # warm-up
            results = [("images", *run(llm, with_images, workload)), ("text only", *run(llm, text_only, workload))]
            encoded = encoder_seconds(llm, with_images)
        for name, seconds, tokens, ttfts in results:
            print(line(name, seconds, tokens, ttfts))
        ratio = results[0][2] / results[0][1] / (results[1][2] / results[1][1])
        print(f"images / text only: {ratio:.3f} of the output tok/s")
        print(f"encoder: {encoded:.2f} s for {len(with_images)} images = {encoded / results[0][1]:.3f} of the run")


if __name__ == "__main__":
    main()
