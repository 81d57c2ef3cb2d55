"""How an embedding checkpoint turns its hidden states into one vector: read from its sentence-transformers
files (``modules.json``: a ``Pooling`` module's ``config.json``, a ``Normalize`` module) and its
config.json's Matryoshka fields (``is_matryoshka``, ``matryoshka_dimensions``: vLLM's names).

    read_pooling(Path("/models/Qwen3-Embedding-0.6B"), "auto")
        -> PoolingConfig(mode="last", normalize=True, matryoshka=None)

``runner``: "generate" serves no embeddings (None); "pooling" serves them, with last-token pooling,
normalised, where the checkpoint says nothing (Qwen3-Embedding's); "auto" serves them when the
checkpoint has a sentence-transformers pooling config. What nanostream does not implement (mean or CLS
pooling, a Dense projection after pooling) is refused at load, naming it: never a wrong vector.
"""

from __future__ import annotations

import json
from pathlib import Path

from nanostream.protocol import PoolingConfig

_POOLING = "sentence_transformers.models.Pooling"
_NORMALIZE = "sentence_transformers.models.Normalize"
_TRANSFORMER = "sentence_transformers.models.Transformer"
_MODES = {  # sentence-transformers' pooling_mode_* keys -> what nanostream calls them (None: not implemented)
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": None,
    "pooling_mode_cls_token": None,
    "pooling_mode_max_tokens": None,
    "pooling_mode_mean_sqrt_len_tokens": None,
    "pooling_mode_weightedmean_tokens": None,
}


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None


def read_pooling(model_path: Path, runner: str) -> PoolingConfig | None:
    """The checkpoint's pooling for ``runner``, or None when it serves no embeddings."""
    modules_file = model_path / "modules.json"
    modules = _json(modules_file) if modules_file.is_file() else []
    kinds = {m.get("type"): m.get("path", "") for m in modules if isinstance(m, dict)}
    if runner == "generate" or (runner == "auto" and _POOLING not in kinds):
        return None
    unknown = sorted(k for k in kinds if k not in (_POOLING, _NORMALIZE, _TRANSFORMER))
    if unknown:
        raise ValueError(
            f"{modules_file} has the module(s) {', '.join(map(str, unknown))}, which nanostream does not run "
            "(it pools the model's hidden states and normalises them, nothing after)"
        )
    mode = "last"
    if _POOLING in kinds:
        pooling = _json(model_path / kinds[_POOLING] / "config.json")
        chosen = [key for key in _MODES if pooling.get(key)]
        if chosen != ["pooling_mode_lasttoken"]:
            raise ValueError(
                f"this checkpoint pools by {', '.join(chosen) or 'nothing'} ({kinds[_POOLING]}/config.json); "
                "nanostream pools the last token only (Qwen3-Embedding, gte-Qwen2, e5-mistral)"
            )
    config = _json(model_path / "config.json")
    dims = config.get("matryoshka_dimensions")
    matryoshka = sorted(dims) if isinstance(dims, list) and dims else (True if config.get("is_matryoshka") else None)
    normalize = _NORMALIZE in kinds or not modules  # (no sentence-transformers files: Qwen3-Embedding's way)
    return PoolingConfig(mode, normalize, matryoshka)
