"""SiLU-and-mul, the gated activation of the decoder's MLP."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """The reference: silu(gate) * up of a fused [T, 2 * I] projection x = [gate | up]; [T, I]."""
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """``kernel`` (fixed at construction): ``silu_and_mul``, a torch.compile'd form of it, or
    ``nanostream.kernels.norm_act.silu_and_mul``."""

    def __init__(self, kernel: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul) -> None:
        super().__init__()
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x)
