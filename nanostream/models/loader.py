"""Finding a model directory and loading safetensors weights into a model by their Hugging Face names, or
random ones (``load_format="dummy"``).

Tensors are read as safetensors slices: a module that holds part of a tensor (a tensor-parallel shard, a
part of a fused projection, one expert's rows) reads only that part of the file. An FP8 weight is read whole
with its scale and dequantized (models/quantization.py), then placed in the same way."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import zlib
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from nanostream.errors import ModelLoadError
from nanostream.layers import fp8_linear
from nanostream.layers.linear import TensorSlice
from nanostream.models.architectures import supported_list
from nanostream.models.quantization import FP8_WEIGHT_DTYPE, Fp8Spec, fp8_spec

log = logging.getLogger(__name__)
# Checkpoint tensors that hold nothing the model needs (recomputed buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Older names of an FP8 KV cache's per-layer scales (AutoFP8's, vLLM's earlier ones) -> ``self_attn.k_scale`` etc.
_KV_SCALE_NAMES = {
    "self_attn.k_proj.output_scale": "self_attn.k_scale",
    "self_attn.v_proj.output_scale": "self_attn.v_scale",
    "self_attn.k_proj.k_scale": "self_attn.k_scale",
    "self_attn.v_proj.v_scale": "self_attn.v_scale",
}


def resolve_model_path(model: str) -> Path:
    """A local Hugging Face model directory for ``model`` (a path, or a hub id when the hub is reachable)."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} has no config.json; pass a Hugging Face model directory")
        return path
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ModelLoadError(f"model directory {model!r} does not exist; pass a local Hugging Face model directory")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelLoadError(
            f"{model!r} is not a local directory and huggingface_hub is not installed to fetch it; "
            "pass a local model directory"
        ) from None
    try:
        return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"]))
    except Exception as exc:
        raise ModelLoadError(
            f"could not fetch {model!r} from the Hugging Face hub ({type(exc).__name__}: {exc}); "
            "pass a local model directory instead"
        ) from exc


def _resolve(model: nn.Module, name: str) -> tuple[str, str | None]:
    """The parameter of ``model`` a checkpoint tensor goes to, and the part of it (None: the whole)."""
    aliases = getattr(model, "checkpoint_aliases", {})
    parts = [aliases.get(p, p) for p in name.split(".")]
    if "experts" in parts:  # an MoE block's experts: per expert, or stacked
        i = parts.index("experts")
        rest, block = parts[i + 1 :], parts[: i + 1]
        per_expert = getattr(model, "checkpoint_expert_tensors", {})
        stacked = getattr(model, "checkpoint_stacked_experts", {})
        if len(rest) == 3 and rest[0].isdigit() and rest[1] in per_expert and rest[2] == "weight":
            param, part = per_expert[rest[1]]
            return ".".join([*block, param]), f"{part}.{int(rest[0])}"
        if len(rest) == 1 and rest[0] in stacked:
            param, part = stacked[rest[0]]
            return ".".join([*block, param]), part
    renamed = getattr(model, "checkpoint_modules", {})
    for i, part in enumerate(parts):
        if part in renamed:
            module, shard = renamed[part]
            return ".".join([*parts[:i], module, *parts[i + 1 :]]), shard
    return ".".join(parts), None


def _wanted(model: nn.Module, pname: str, param: nn.Parameter) -> list[str]:
    """The parts ``pname`` must be loaded as: one per shard of a merged or expert module, else one."""
    module = model.get_submodule(pname.rsplit(".", 1)[0])
    if hasattr(module, "shards"):  # layers.experts.Experts
        return [f"{pname}:{s}" for s in module.shards(param)]
    shards = getattr(module, "shard_offsets", None)
    return [f"{pname}:{s}" for s in shards] if shards else [f"{pname}:None"]


def checkpoint_files(path: Path) -> list[Path]:
    """The checkpoint's ``*.safetensors`` files, sorted; ``ModelLoadError`` where it has none."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"no *.safetensors files in {path}; to run the config's shapes with random weights, "
            "pass load_format='dummy' (--load-format dummy)"
        )
    return files


def load_weights(model: nn.Module, path: Path) -> None:
    """Copy every tensor of ``path/*.safetensors`` into ``model``; raise if a parameter stays unloaded, or if
    a tensor has no place in the model (its weights are for another architecture than config.json names).
    ``model.checkpoint_suffixes`` renames the end of a tensor's name (``block.e_score_correction_bias`` ->
    ``block.gate.e_score_correction_bias``) before it is placed.

    ``model.checkpoint_modules`` maps a checkpoint module name to (its module in ``model``, a shard of it or
    None): ``{"q_proj": ("qkv_proj", "q"), "q_norm": ("attn.q_norm", None)}``. A module with a shard takes it
    with ``load_shard(param, slice, shard)``; one with ``load_weight(param, slice)`` (the tensor-parallel
    layers) reads its own part; any other parameter is copied whole. ``checkpoint_aliases`` renames whole
    modules (Mixtral's ``block_sparse_moe`` is ``mlp``); an MoE block's experts come per expert
    (``checkpoint_expert_tensors``: ``experts.3.gate_proj.weight`` is part "gate.3" of ``experts.w13``) or
    stacked (``checkpoint_stacked_experts``: ``experts.gate_up_proj``), and the ``Experts`` module's
    ``load_shard`` says which of its parts each filled.

    An FP8 checkpoint (config.json's ``quantization_config``, models/quantization.py): each FP8 weight is read
    whole with its scale and dequantized in float32 on the parameter's device, and that tensor is placed as
    above (the copy casts it to the parameter's dtype); its scale is consumed with it."""
    files = checkpoint_files(path)
    params = dict(model.named_parameters())
    spec = getattr(model, "spec", None)
    tied = getattr(spec, "tie_word_embeddings", False)
    arch = getattr(spec, "architecture", "this model")
    fp8 = fp8_spec(_quantization_config(path), arch)
    loaded: set[str] = set()
    unexpected: list[str] = []
    renamed = {**_KV_SCALE_NAMES, **getattr(model, "checkpoint_suffixes", {})}
    with contextlib.ExitStack() as stack:
        opened = [stack.enter_context(safe_open(os.fspath(file), framework="pt", device="cpu")) for file in files]
        where = {name: f for f in opened for name in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
        scales = fp8.scales(where) if fp8 else {}
        consumed = set(scales.values())
        unused: dict[str, int] = {}  # tensors of parts nanostream does not run, by prefix
        for name in where:
            if name in consumed:  # an FP8 weight's scale, read with it
                continue
            # a multimodal checkpoint's language model (None: its vision tower, its projector)
            local = spec.name_in_model(name) if spec is not None else name
            skip = next((p for p in getattr(spec, "unused_tensors", ()) if name.startswith(p)), None)
            if skip is not None or local is None:
                skip = skip or name.split(".", 1)[0] + "."
                unused[skip] = unused.get(skip, 0) + 1
                continue
            for old, new in renamed.items():
                if local.endswith("." + old):
                    local = local.removesuffix(old) + new
            if (
                name.endswith(_IGNORED_SUFFIXES)
                or (tied and local == "lm_head.weight")
                or (fp8 and fp8.is_unread(name))
            ):
                continue
            target, shard = _resolve(model, local)
            param = params.get(target)
            if param is None:
                unexpected.append(name)
                continue
            module = model.get_submodule(target.rsplit(".", 1)[0])
            if param.dtype == FP8_WEIGHT_DTYPE:  # a layer that keeps the checkpoint's FP8 (on a GPU)
                filled = _load_kept(module, name, where, scales, fp8, shard)
                loaded.update(f"{target}:{s}" for s in (filled or [shard]))
                continue
            tensor = _read(name, where, scales, fp8, param.device)
            filled = None
            with torch.no_grad():
                if shard is not None:
                    filled = module.load_shard(param, tensor, shard)
                elif hasattr(module, "load_weight"):
                    filled = module.load_weight(param, tensor)  # a fused module: the parts it filled
                else:
                    shape = tuple(tensor.shape if isinstance(tensor, torch.Tensor) else tensor.get_shape())
                    if tuple(param.shape) != shape:
                        raise ModelLoadError(f"{name}: checkpoint shape {shape}, model {tuple(param.shape)}")
                    param.copy_(tensor[:])
            loaded.update(f"{target}:{s}" for s in (filled or [shard]))
    for prefix, count in unused.items():
        log.info("%s: %d tensors under %s* not loaded (not the language model's)", arch, count, prefix)
    if unexpected:
        raise ModelLoadError(
            f"{path} holds {len(unexpected)} tensor(s) that {arch} has no place for, e.g. "
            f"{', '.join(unexpected[:3])}; is config.json's architectures right? nanostream runs {supported_list()}"
        )
    missing = [
        w
        for pname, param in model.named_parameters()
        if not pname.endswith(".weight_scale")  # a kept FP8 weight's scales: loaded with it
        for w in _wanted(model, pname, param)
        if w not in loaded
    ]
    if missing:
        shown = ", ".join(m.replace(":None", "") for m in missing[:5])
        raise ModelLoadError(f"{path} lacks {len(missing)} weight(s) the model needs, e.g. {shown}")


def _quantization_config(path: Path) -> dict | None:
    config = path / "config.json"
    return json.loads(config.read_text()).get("quantization_config") if config.is_file() else None


def _load_kept(module: nn.Module, name: str, where: dict, scales: dict[str, str], fp8: Fp8Spec, shard: str | None):
    """Checkpoint weight ``name`` into ``module``, a linear layer that keeps FP8 (``Linear.load_fp8``): its
    FP8 values and scales as stored, or for a tensor the checkpoint left unquantized, quantized here in the
    layer's blocks; the parts it filled."""
    if name in scales:
        loaded, scale = where[name].get_slice(name), where[scales[name]].get_tensor(scales[name])
        block = fp8.block_of(name, tuple(loaded.get_shape()), loaded.get_dtype() == "F8_E4M3", scale)
    else:
        full = where[name].get_tensor(name)
        if full.dtype == FP8_WEIGHT_DTYPE:
            _read(name, where, scales, fp8, full.device)  # raises: no scale
        block = module.fp8_block
        loaded, scale = fp8_linear.quantize(full, block)
    with torch.no_grad():
        return module.load_fp8(loaded, scale, block, shard)


def _read(name: str, where: dict, scales: dict[str, str], fp8: Fp8Spec | None, device: torch.device) -> TensorSlice:
    """Checkpoint tensor ``name`` (``where``: each name's open file): a safetensors slice, or for an FP8 weight
    (in ``scales``) its real values, float32 on ``device``; an FP8 tensor without a scale is refused."""
    if name in scales:
        scale = scales[name]
        return fp8.dequantize(name, where[name].get_tensor(name).to(device), where[scale].get_tensor(scale))
    tensor = where[name].get_slice(name)
    dtype = tensor.get_dtype()
    if not dtype.startswith("F8"):
        return tensor
    if fp8 is None:
        why = "config.json has no quantization_config to say how to read it"
    elif fp8.leaves_unquantized(name.rsplit(".", 1)[0]):
        why = "quantization_config's ignore list leaves its module unquantized"
    else:
        why = f"the checkpoint lacks its scale, {' or '.join(name + s for s in fp8.scale_suffixes)}"
    raise ModelLoadError(f"{name} is stored as {dtype} without a scale: {why}")


DUMMY_GAIN = 0.5
"""A dummy matrix's entries have standard deviation ``DUMMY_GAIN / sqrt(fan_in)``: each projection shrinks
its input's scale by about this much, so the residual stream grows by O(1) a layer at any width and depth
and a bfloat16 forward stays finite; norm weights are near 1."""


@torch.no_grad()
def load_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Fill every parameter with random values (``load_format="dummy"``: benchmarks of a shape without a
    checkpoint): norm weights 1 + U(-0.05, 0.05), biases (the stacked experts' too) N(0, 0.02^2), matrices and
    stacked experts N(0, (DUMMY_GAIN / sqrt(fan_in))^2) (fan_in: the last dimension).

    Each parameter's values come from a generator seeded by its name (and ``seed``) on its own device, so
    every tensor-parallel rank holds the same router, norms and biases. An FP8 config's model gets them in its
    compute dtype too, where it dequantizes an FP8 checkpoint; a layer that keeps FP8 weights (on a GPU) gets
    the values the unquantized model gets, quantized in its blocks, with their scales (so a dummy FP8 model is
    the FP8 checkpoint of the dummy model in the compute dtype)."""
    dtype = next(p.dtype for p in model.parameters() if p.dtype != FP8_WEIGHT_DTYPE)  # the compute dtype
    for name, param in model.named_parameters():
        gen = torch.Generator(param.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        if name.endswith(".weight_scale"):
            continue  # a kept FP8 weight's: made with it
        if param.dtype == FP8_WEIGHT_DTYPE:  # the values an unquantized model of this dtype gets, quantized
            layer = model.get_submodule(name.rsplit(".", 1)[0])
            values = torch.empty(param.shape, dtype=dtype, device=param.device).normal_(
                0.0, DUMMY_GAIN / param.shape[-1] ** 0.5, generator=gen
            )
            q, scale = fp8_linear.quantize(values, layer.fp8_block)
            param.copy_(q)
            layer.weight_scale.copy_(scale)
        elif param.dim() == 1 and name.endswith("norm.weight"):
            param.uniform_(0.95, 1.05, generator=gen)
        elif param.dim() == 1 or name.endswith("_bias"):  # gpt-oss's experts' biases are [E, n]
            param.normal_(0.0, 0.02, generator=gen)
        else:
            param.normal_(0.0, DUMMY_GAIN / param.shape[-1] ** 0.5, generator=gen)
