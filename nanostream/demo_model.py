"""The embedded demo model: what ``nanostream demo``, ``nanostream serve``, ``nanostream generate`` and
the Gradio app run when no ``--model`` is given.

A Qwen3-architecture model of 11.7M parameters (6 layers, width 384, 6k-token byte-level BPE), trained
from scratch in two minutes on one GPU on the King James Bible and the BSD fortune files, so it writes
scripture-flavoured English and short quips. It is a toy for trying nanostream without a download,
not a model to rely on: point ``--model`` at a real checkpoint for real use. ``apps/train_demo_model.py``
reproduces it; ``demo-model/README.md`` beside this file is its model card.
"""

from __future__ import annotations

from pathlib import Path

from nanostream.errors import ModelLoadError

DEMO_MODEL_DIR = Path(__file__).resolve().parent / "demo-model"


def default_model_dir() -> Path:
    """The demo model's directory (Hugging Face format), shipped inside the package."""
    if not (DEMO_MODEL_DIR / "model.safetensors").is_file():
        raise ModelLoadError(
            f"the embedded demo model is missing from {DEMO_MODEL_DIR} (an install without package data?); "
            "reinstall nanostream, or pass --model with a Hugging Face model directory"
        )
    return DEMO_MODEL_DIR
