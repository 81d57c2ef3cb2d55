"""What the routed experts compute besides their GEMMs, shared by the fused kernel (kernels/fused_moe.py) and
the torch reference (layers/moe_reference.py): the experts' activation (``"silu"``, Gemma 4's ``"gelu_tanh"`` or
gpt-oss's ``ClampedSwiGLU``) and,
in the batch-invariant mode, each token's top-k outputs added in order. Torch only (no Triton).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's experts' activation (``swiglu_alpha``, ``swiglu_limit``): gate clamped from above at ``limit``,
    up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""

    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        # transformers' GptOssExperts' operations in its order: float32 results equal to the bit.
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


Activation = Literal["silu", "gelu_tanh"] | ClampedSwiGLU
"""The experts' activation of their gate and up projections: ``"silu"`` (silu(gate) * up), ``"gelu_tanh"``
(gelu(gate) * up, GELU's tanh approximation) or a ``ClampedSwiGLU``."""
GATED_ACTIVATIONS = ("silu", "gelu_tanh")
"""The ``Activation`` names (the others are ``ClampedSwiGLU``s)."""


def gated_activation(activation: Activation, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up, ``activation`` one of ``GATED_ACTIVATIONS`` or a ``ClampedSwiGLU``."""
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    return activation(gate, up)


def ordered_topk_sum(out: torch.Tensor) -> torch.Tensor:
    """[T, K, H] -> [T, H]: each token's K rows added one after another in top-k order (a reduction
    kernel may split K differently for a different T)."""
    total = out[:, 0]
    for i in range(1, out.shape[1]):
        total = total + out[:, i]
    return total
