"""Loading a vision encoder's weights from a checkpoint's safetensors, by transformers' names.

transformers 5 saves a Qwen3-VL / Qwen3.5 encoder under ``model.visual.``; Qwen2-VL-era checkpoints (and some
Qwen2.5-VL uploads) under ``visual.``. The encoder's own parameter names are the rest of the name, so every
parameter must be found and every tensor under the prefix must be used::

    load_vision_weights(encoder, Path("Qwen3.5-9B"))

An encoder whose parameters come from several places of the checkpoint (Gemma 3's tower and projector) names
them by groups, its own prefix -> the checkpoint's alternatives::

    load_vision_weights(encoder, Path("gemma-3-4b-it"), {"vision_model.": ("vision_tower.vision_model.",), ...})
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from nanostream.errors import ModelLoadError

VISION_PREFIXES = ("model.visual.", "visual.")


def _shards(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / name for name in names]
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError(f"{path} has no .safetensors files to load the vision encoder from")
    return shards


def load_vision_weights(
    encoder: nn.Module, path: Path, prefixes: tuple[str, ...] | dict[str, tuple[str, ...]] = VISION_PREFIXES
) -> None:
    """Copy the checkpoint's tensors under the first of ``prefixes`` that it has into ``encoder``'s parameters
    (cast to their dtype, on their device); a dict: for each of the encoder's name prefixes, the checkpoint's.
    ModelLoadError names a missing, unexpected or misshapen tensor."""
    shards = _shards(Path(path))
    keys = {}  # checkpoint name -> shard
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            keys.update(dict.fromkeys(f.keys(), shard))
    groups = prefixes if isinstance(prefixes, dict) else {"": prefixes}
    chosen = {  # the checkpoint's prefix -> the encoder's
        next((p for p in options if any(k.startswith(p) for k in keys)), options[0]): own
        for own, options in groups.items()
    }
    params = dict(encoder.named_parameters())
    found = set()
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            for key, prefix in ((k, p) for k, s in keys.items() if s == shard for p in chosen if k.startswith(p)):
                name = chosen[prefix] + key[len(prefix) :]
                if name.startswith(getattr(encoder, "unused", ())):  # a part the image features do not use
                    continue
                if name not in params:
                    raise ModelLoadError(f"checkpoint tensor {key} has no place in the vision encoder")
                tensor, param = f.get_tensor(key), params[name]
                if tensor.shape != param.shape:
                    raise ModelLoadError(
                        f"checkpoint tensor {key} has shape {tuple(tensor.shape)} but the vision config gives "
                        f"{tuple(param.shape)}; is config.json's vision_config the checkpoint's own?"
                    )
                with torch.no_grad():
                    param.copy_(tensor.to(param.dtype))
                found.add(name)
    missing = sorted(set(params) - set(found))
    if missing:
        raise ModelLoadError(
            f"the checkpoint at {path} lacks {len(missing)} vision encoder tensors (first: {missing[0]}) under "
            f"{' or '.join(p for options in groups.values() for p in options)}; is it a vision-language checkpoint?"
        )
