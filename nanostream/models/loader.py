"""Finding a model directory and loading safetensors weights into a model by their Hugging Face names."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from nanostream.errors import ModelLoadError

log = logging.getLogger(__name__)

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
    """Copy every tensor of ``path/*.safetensors`` into ``model``; raise if a parameter stays unloaded."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {path}")
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules", {})
    tied = getattr(getattr(model, "spec", None), "tie_word_embeddings", False)
    loaded: set[str] = set()
    for file in files:
        with safe_open(os.fspath(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                    continue
                tensor = f.get_tensor(name)
                target, shard = name, None
                parts = name.split(".")
                for i, part in enumerate(parts):
                    if part in packed:
                        fused, shard = packed[part]
                        target = ".".join([*parts[:i], fused, *parts[i + 1 :]])
                        break
                param = params.get(target)
                if param is None:
                    log.warning("checkpoint tensor %s has no place in the model; ignored", name)
                    continue
                with torch.no_grad():
                    if shard is None:
                        if param.shape != tensor.shape:
                            raise ModelLoadError(
                                f"{name}: checkpoint shape {tuple(tensor.shape)}, model {tuple(param.shape)}"
                            )
                        param.copy_(tensor)
                    else:
                        module = model.get_submodule(target.rsplit(".", 1)[0])
                        module.load_shard(param, tensor, shard)
                loaded.add(f"{target}:{shard}")
    missing = []
    for pname, _ in model.named_parameters():
        shards = getattr(model.get_submodule(pname.rsplit(".", 1)[0]), "shard_offsets", None)
        wanted = [f"{pname}:{s}" for s in shards] if shards else [f"{pname}:None"]
        missing += [w for w in wanted if w not in loaded]
    if missing:
        shown = ", ".join(m.replace(":None", "") for m in missing[:5])
        raise ModelLoadError(f"{path} lacks {len(missing)} weight(s) the model needs, e.g. {shown}")
