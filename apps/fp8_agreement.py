"""How far FP8 moves a model's logits: bf16 weights and cache against FP8 weights, and FP8 weights with an FP8
KV cache, on the same prompts, teacher-forced (every variant reads the same tokens).

    python apps/fp8_agreement.py --preset qwen3-8b-fp8 --build-dir /tmp/qwen3-8b-fp8

The model is the preset's shape with dummy weights: the bf16 variant gets them in bf16, the FP8 variants the
same values quantized in the config's blocks (models/loader.py: ``load_dummy_weights``), so the three differ by
FP8 alone. Each prompt is prefilled in one step through the torch attention backend, whose FP8 pool is read
back (dequantized) for every key, so the FP8 cache's rounding is in every attention. Per position: the cosine
of the logits with bf16's and whether the argmax (the greedy token) is bf16's. Random weights give flatter
distributions than a trained model's, so their near-ties make the argmax figure a lower bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from presets import PRESETS, random_model


def logits_of(
    path: Path, prompts: list[list[int]], keep_fp8: bool, kv_dtype: torch.dtype | None, device: torch.device
) -> list:
    from transformers import AutoConfig

    from nanostream import SamplingParams
    from nanostream.engine.runner.kv_pool import WarmupChunk, allocate_kv_pool
    from nanostream.engine.runner.step_inputs import pack_step
    from nanostream.engine.sequence import Sequence
    from nanostream.layers.attention import ForwardContext
    from nanostream.layers.attention_backend import TorchAttention
    from nanostream.layers.layer_kernels import LayerKernels
    from nanostream.models import decoder_spec, load_model

    longest = max(map(len, prompts))
    spec = decoder_spec(AutoConfig.from_pretrained(path), max_model_len=longest + 16)
    if not keep_fp8:  # the bf16 twin
        spec = dataclasses.replace(spec, quantization=None)
    model = load_model(spec, LayerKernels(TorchAttention()), path, dtype=torch.bfloat16, device=device,
                       load_format="dummy", keep_fp8=keep_fp8)  # fmt: skip
    block = 256
    blocks = -(-longest // block)
    kv = allocate_kv_pool(spec, blocks, block, kv_dtype or torch.bfloat16, device)
    out = []
    for prompt in prompts:
        seq = Sequence("s", prompt, SamplingParams(), max_tokens=1, sampling_seed=0, stop_token_ids=frozenset())
        seq.block_table = list(range(blocks))
        inputs = pack_step([WarmupChunk(seq, 0, len(prompt))], block, device)
        with torch.inference_mode():
            hidden = model(inputs.input_ids, inputs.positions, ForwardContext(inputs.meta, kv))
            out.append(model.compute_logits(hidden).float().cpu())
    del model, kv
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen3-8b-fp8", choices=sorted(PRESETS))
    parser.add_argument("--build-dir")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per prompt (positions scored)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny-config", default="{}", help="JSON of make_tiny_model overrides over the preset")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    prompts = [[rng.randint(0, 10000) for _ in range(args.tokens)] for _ in range(args.prompts)]
    from nanostream.kernels.fp8_kv import FP8_KV_DTYPE

    device = torch.device(args.device)
    with random_model(args.preset, json.loads(args.tiny_config), args.build_dir) as path:
        ref = logits_of(path, prompts, keep_fp8=False, kv_dtype=None, device=device)
        print(f"{'variant':<22} {'cosine mean':>12} {'cosine p1':>10} {'argmax = bf16':>14}")
        for label, kv in (("FP8 weights", None), ("FP8 weights + FP8 KV", FP8_KV_DTYPE)):
            got = logits_of(path, prompts, keep_fp8=True, kv_dtype=kv, device=device)
            cos = torch.cat([torch.cosine_similarity(a, b, dim=-1) for a, b in zip(ref, got, strict=True)])
            same = torch.cat([a.argmax(-1) == b.argmax(-1) for a, b in zip(ref, got, strict=True)])
            print(
                f"{label:<22} {cos.mean().item():>12.5f} {cos.quantile(0.01).item():>10.5f} "
                f"{same.float().mean().item():>14.3f}   ({len(same)} positions)"
            )


if __name__ == "__main__":
    main()
