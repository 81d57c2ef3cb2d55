"""Finding a model directory and loading safetensors weights into a model by their Hugging Face names.

Tensors are read as safetensors slices: a module that holds part of a tensor (a tensor-parallel shard, a
part of a fused projection) reads only that part of the file."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from nanostream.errors import ModelLoadError
from nanostream.models.architectures import supported_list

# Checkpoint tensors that hold nothing the model needs (recomputed buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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


def load_weights(model: nn.Module, path: Path) -> None:
    """Copy every tensor of ``path/*.safetensors`` into ``model``; raise if a parameter stays unloaded, or if
    a tensor has no place in the model (its weights are for another architecture than config.json names).

    ``model.checkpoint_modules`` maps a checkpoint module name to (its module in ``model``, a shard of it or
    None): ``{"q_proj": ("qkv_proj", "q"), "q_norm": ("attn.q_norm", None)}``. A module with a shard takes it
    with ``load_shard(param, slice, shard)``; one with ``load_weight(param, slice)`` (the tensor-parallel
    layers) reads its own part; any other parameter is copied whole."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {path}")
    params = dict(model.named_parameters())
    renamed = getattr(model, "checkpoint_modules", {})
    spec = getattr(model, "spec", None)
    tied = getattr(spec, "tie_word_embeddings", False)
    loaded: set[str] = set()
    unexpected: list[str] = []
    for file in files:
        with safe_open(os.fspath(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                    continue
                target, shard = name, None
                parts = name.split(".")
                for i, part in enumerate(parts):
                    if part in renamed:
                        module, shard = renamed[part]
                        target = ".".join([*parts[:i], module, *parts[i + 1 :]])
                        break
                param = params.get(target)
                if param is None:
                    unexpected.append(name)
                    continue
                tensor = f.get_slice(name)
                module = model.get_submodule(target.rsplit(".", 1)[0])
                with torch.no_grad():
                    if shard is not None:
                        module.load_shard(param, tensor, shard)
                    elif hasattr(module, "load_weight"):
                        module.load_weight(param, tensor)
                    else:
                        shape = tuple(tensor.get_shape())
                        if tuple(param.shape) != shape:
                            raise ModelLoadError(f"{name}: checkpoint shape {shape}, model {tuple(param.shape)}")
                        param.copy_(tensor[:])
                loaded.add(f"{target}:{shard}")
    if unexpected:
        arch = getattr(spec, "architecture", "this model")
        raise ModelLoadError(
            f"{path} holds {len(unexpected)} tensor(s) that {arch} has no place for, e.g. "
            f"{', '.join(unexpected[:3])}; is config.json's architectures right? nanostream runs {supported_list()}"
        )
    missing = []
    for pname, _ in model.named_parameters():
        shards = getattr(model.get_submodule(pname.rsplit(".", 1)[0]), "shard_offsets", None)
        wanted = [f"{pname}:{s}" for s in shards] if shards else [f"{pname}:None"]
        missing += [w for w in wanted if w not in loaded]
    if missing:
        shown = ", ".join(m.replace(":None", "") for m in missing[:5])
        raise ModelLoadError(f"{path} lacks {len(missing)} weight(s) the model needs, e.g. {shown}")
