"""xIELU, the learned activation of an ungated MLP (``hidden_act: xielu``, Apertus): per layer two learned
scalars and two constants, all four from the checkpoint (``mlp.act_fn.alpha_p``, ``alpha_n``, ``beta``, ``eps``)::

    y = a_p x^2 + b x                          x > 0
    y = (expm1(min(x, eps)) - x) a_n + b x     otherwise

with a_p = softplus(alpha_p) and a_n = b + softplus(alpha_n), in the order transformers' reference computes them
(so a float32 model is token-exact). Elementwise: every tensor-parallel rank holds it whole.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanostream.layers.linear import TensorSlice


class XIELU(nn.Module):
    """x [T, I] -> [T, I]; its four scalars are [1] parameters, read from the checkpoint's [1] or [] tensors."""

    def __init__(self) -> None:
        super().__init__()
        for name in ("alpha_p", "alpha_n", "beta", "eps"):
            setattr(self, name, nn.Parameter(torch.zeros(1), requires_grad=False))

    def load_weight(self, param: nn.Parameter, loaded: TensorSlice) -> None:
        value = loaded[...]  # a [1] or 0-dim tensor (a slice of a 0-dim one takes no ``[:]``)
        if value.numel() != 1:
            raise ValueError(f"an xIELU scalar of shape {tuple(value.shape)}, expected one value")
        param.data.copy_(value.reshape(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        positive = alpha_p * x * x + self.beta * x
        negative = (torch.expm1(torch.min(x, self.eps)) - x) * alpha_n + self.beta * x
        return torch.where(x > 0, positive, negative)
