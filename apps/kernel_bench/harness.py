"""What every section shares: the attention shape, the errors that steer a run, CUDA state."""

from __future__ import annotations

import contextlib
import gc
from pathlib import Path

import torch
from presets import QWEN3_0_6B, attention_shape

ROOT = Path(__file__).resolve().parents[2]  # the checkout
KERNELS = ROOT / "nanostream" / "kernels"  # loaded on its own where nanostream cannot be imported
HQ, HKV, D = attention_shape(QWEN3_0_6B)
DTYPE = torch.bfloat16
DEVICE = "cuda"
SCALE = D**-0.5
DEFAULT_L2_BYTES = 60 << 20  # H200; the device's own figure is used when torch reports it
MAX_SETS = 64  # input sets one timing cycles through
TOL = 2e-2  # relative error vs float32: bf16 operands land between 1e-3 and 1e-2


class Skipped(Exception):
    """A section that cannot run on this machine."""


class Unavailable(Exception):
    """A unit that cannot run with this configuration (an attention backend that will not construct)."""


class ContextLost(Exception):
    """A sticky CUDA error (illegal address, ...): nothing more can run in this process."""


def need_cuda() -> None:
    if not torch.cuda.is_available():
        raise Skipped("needs CUDA")


def cuda_alive() -> bool:
    try:
        torch.cuda.synchronize()
        return torch.ones(1, device=DEVICE).add_(1).item() == 2.0
    except Exception:
        return False


def free_cuda() -> None:
    gc.collect()
    if torch.cuda.is_available():
        with contextlib.suppress(Exception):  # a lost context: ContextLost is already on its way
            torch.cuda.empty_cache()


def short(exc: BaseException) -> str:
    """One line for the table: the exception's first line (and its last, for multi-line compiler errors)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = " | ".join(lines[:1] + lines[-1:]) if len(lines) > 1 else (lines[0] if lines else "")
    return f"{type(exc).__name__}: {text}"[:240]


def check_alive_after(exc: BaseException) -> None:
    """Raise ContextLost if ``exc`` left the CUDA context unusable."""
    if torch.cuda.is_available() and not cuda_alive():
        raise ContextLost(short(exc)) from exc


def l2_bytes() -> int:
    return getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or DEFAULT_L2_BYTES
