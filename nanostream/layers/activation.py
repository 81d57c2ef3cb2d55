"""The gated activations of the decoder's MLP: act(gate) * up of a fused [gate | up] projection.

``ACTIVATIONS`` maps a config's ``hidden_act`` (or Gemma's ``hidden_activation``) to the reference of
each; ``LayerKernels`` holds the implementation the layers run (these, compiled forms, or Triton's).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """The reference: silu(gate) * up of a fused [T, 2 * I] projection x = [gate | up]; [T, I]."""
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU with the tanh approximation of GELU (Gemma's ``gelu_pytorch_tanh``): gelu(gate) * up."""
    gate, up = x.chunk(2, -1)
    return F.gelu(gate, approximate="tanh") * up


ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
"""A config's activation name -> the gated activation nanostream runs for it (``LayerKernels.gated``)."""
UNGATED_ACTIVATIONS = ("xielu",)
"""The activations of an ungated MLP, down(act(up)) (Apertus's learned xIELU, layers/xielu.py)."""


class SiluAndMul(nn.Module):
    """A gated activation; ``kernel`` (fixed at construction): ``silu_and_mul``, ``gelu_tanh_and_mul``, a
    torch.compile'd form of either, or ``nanostream.kernels.norm_act``'s; ``activation`` names it ("silu",
    "gelu_tanh"), for a GEMV that applies it itself (layers/linear.py ``MergedColumnLinear.activated``)."""

    def __init__(self, kernel: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul, activation: str = "silu") -> None:
        super().__init__()
        self.kernel, self.activation = kernel, activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x)
