"""The benchmarks' workload: nano-vLLM's bench draws, the model they run on, and the options for both.

Every benchmark program (bench.py, bench_stream.py, bench_phases.py, bench_structured.py, bench_serve.py)
imports this module; no program imports another.

nano-vLLM's ``bench.py`` draws, and ``make_workload`` draws alike: ``random.seed(seed)``; then, for each
request, a prompt length in [min_input_len, max_input_len] and that many token ids in
[0, min(10000, vocab - 1)] (``randint``, both ends included: 142,827 prompt and 133,966 output tokens at
the defaults); then, for each request, max_tokens in [min_output_len, max_output_len]. Every request
samples at temperature 0.6 with ignore_eos, so it generates exactly max_tokens tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from presets import PRESETS, engine_defaults, random_model

from nanostream import SamplingParams
from nanostream.config import EngineConfig
from nanostream.options import engine_kwargs as engine_args

TEMPERATURE = 0.6
PROMPT_VOCAB = 10000  # nano-vLLM draws prompt ids below this


@dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]
    max_tokens: int


def params_of(r: Request) -> SamplingParams:
    """The sampling of every benchmark request: temperature 0.6, exactly ``max_tokens`` tokens."""
    return SamplingParams(temperature=TEMPERATURE, ignore_eos=True, max_tokens=r.max_tokens)


def make_workload(args: argparse.Namespace, vocab_size: int) -> list[Request]:
    """nano-vLLM's draws, in its order: all prompts first, then all max_tokens."""
    random.seed(args.seed)
    high = min(PROMPT_VOCAB, vocab_size - 1)  # inclusive, as nano-vLLM's randint(0, 10000)
    prompts = [
        [random.randint(0, high) for _ in range(random.randint(args.min_input_len, args.max_input_len))]
        for _ in range(args.num_requests)
    ]
    max_tokens = [random.randint(args.min_output_len, args.max_output_len) for _ in range(args.num_requests)]
    return [Request(p, m) for p, m in zip(prompts, max_tokens)]


def make_warmup(seed: int, vocab_size: int, n: int) -> list[Request]:
    """Short requests of their own random ids, so warm-up leaves nothing in the prefix cache for the workload."""
    rng = random.Random(seed + 1)
    return [Request([rng.randrange(min(PROMPT_VOCAB, vocab_size)) for _ in range(32)], 8) for _ in range(n)]


def round_workload(workload: list[Request], seed: int, index: int, vocab_size: int) -> list[Request]:
    """Round ``index``'s requests: the lengths of ``workload``, fresh ids (round 0: ``workload`` itself)."""
    if index == 0:
        return workload
    rng, high = random.Random(f"bench_stream round {seed} {index}"), min(PROMPT_VOCAB, vocab_size)
    return [Request([rng.randrange(high) for _ in r.prompt_token_ids], r.max_tokens) for r in workload]


@contextlib.contextmanager
def model_dir(args: argparse.Namespace) -> Iterator[Path]:
    """``--model``, or a random model built into ``--build-dir`` (reused when built alike) or a temp dir."""
    if args.model:
        yield Path(args.model)
        return
    with random_model(args.preset, args.tiny_config, args.build_dir) as path:
        yield path


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def environment(device: str) -> str:
    import platform

    import transformers

    if device.startswith("cuda"):
        where = torch.cuda.get_device_name(device)
    else:
        where = f"cpu, {torch.get_num_threads()} torch threads"
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    return f"python {platform.python_version()}, {versions}; {where}"


# ---- command-line options ------------------------------------------------------------------------


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The workload's and the model's options (every benchmark program takes them)."""
    parser.add_argument("--seed", type=int, default=0, help="random.seed of the workload; also the engine's seed")
    parser.add_argument("--num-requests", type=int, default=256, help="requests in the workload")
    parser.add_argument("--min-input-len", type=int, default=100, help="shortest prompt, in tokens")
    parser.add_argument("--max-input-len", type=int, default=1024, help="longest prompt, in tokens")
    parser.add_argument("--min-output-len", type=int, default=100, help="smallest max_tokens")
    parser.add_argument("--max-output-len", type=int, default=1024, help="largest max_tokens")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads of every engine; None: torch's own")
    model = parser.add_argument_group("model (default: the tiny random model, built into a temp dir)")
    model.add_argument("--model", help="a Hugging Face model directory (or hub id) instead of a built one")
    model.add_argument("--preset", choices=sorted(PRESETS), help="build a random-weight model of this shape")
    model.add_argument(
        "--tiny-config",
        help='JSON of make_tiny_model overrides, over --preset: \'{"hidden_size": 256, "num_hidden_layers": 4}\'',
    )
    model.add_argument("--build-dir", help="build the model here and keep it; reused when built with the same settings")


def check_workload_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``parser.error`` on bad workload or model options; parses ``--tiny-config`` in place."""
    for lo, hi in (("min_input_len", "max_input_len"), ("min_output_len", "max_output_len")):
        if not 1 <= getattr(args, lo) <= getattr(args, hi):
            parser.error(f"need 1 <= --{lo.replace('_', '-')} <= --{hi.replace('_', '-')}")
    if args.num_requests < 1:
        parser.error("--num-requests must be positive")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be positive")
    try:
        args.tiny_config = json.loads(args.tiny_config or "{}")
    except json.JSONDecodeError as exc:
        parser.error(f"--tiny-config is not valid JSON ({exc})")
    if not isinstance(args.tiny_config, dict):
        parser.error("--tiny-config must be a JSON object, e.g. '{\"num_hidden_layers\": 4}'")
    if args.model and (args.preset or args.tiny_config or args.build_dir):
        parser.error("--model runs an existing model; --preset, --tiny-config and --build-dir build one: pick one")


def engine_options(args: argparse.Namespace) -> dict:
    """The engine options given on the command line, less ``seed`` (``--seed`` is the workload's), over what
    the preset needs (``load_format="dummy"`` for the shapes built without weights)."""
    given = {k: v for k, v in engine_args(args).items() if k != "seed"}
    return {**engine_defaults(getattr(args, "preset", None)), **given}


def load_workload(
    args: argparse.Namespace, model: Path, engine_kwargs: dict
) -> tuple[Any, EngineConfig, list[Request]]:
    """The model's HF config, the resolved engine config and the workload; prints what they are."""
    from nanostream.models.model_config import read_model_config

    hf_config = read_model_config(model).text  # a multimodal checkpoint: its language model's
    cfg = EngineConfig.from_kwargs(str(model), **engine_kwargs).resolve(
        max_position_embeddings=hf_config.max_position_embeddings, cuda_available=torch.cuda.is_available()
    )
    if args.max_input_len + args.max_output_len > cfg.max_model_len:
        raise SystemExit(
            f"--max-input-len + --max-output-len ({args.max_input_len + args.max_output_len}) exceeds "
            f"max_model_len ({cfg.max_model_len}); lower them or raise --max-model-len"
        )
    workload = make_workload(args, hf_config.vocab_size)
    prompt_tokens = sum(len(r.prompt_token_ids) for r in workload)
    print(
        f"workload: {len(workload)} requests, seed {args.seed}, {prompt_tokens} prompt tokens "
        f"(len {args.min_input_len}-{args.max_input_len}), {sum(r.max_tokens for r in workload)} output tokens "
        f"(len {args.min_output_len}-{args.max_output_len}), temperature {TEMPERATURE}, ignore_eos"
    )
    print(f"env: {environment(cfg.device)}")
    print(
        f"model: {model}, {hf_config.num_hidden_layers} layers, hidden {hf_config.hidden_size}, "
        f"vocab {hf_config.vocab_size}"
    )
    return hf_config, cfg, workload
