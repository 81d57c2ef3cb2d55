"""Per-layer input embeddings (Gemma 4's PLE): beside the residual stream, each layer gets a small vector of its own
for each token, made once from the token and its embedding, and adds a gated projection of it to its output.

- ``PerLayerEmbedding`` (the model's): the token's row of ``embed_tokens_per_layer`` [V', L P] times sqrt(P), and the
  embedding projected by ``per_layer_model_projection`` [L P, H] times H^-1/2 and normed per layer
  (``per_layer_projection_norm``), summed and times 2^-1/2: [T, L, P].
- ``PerLayerInput`` (each layer's): out + norm(proj(act(gate(out)) * input)), the layer's output ``out`` [T, H] and
  its input [T, P] (``per_layer_input_gate`` [P, H], ``per_layer_projection`` [H, P], ``post_per_layer_input_norm``).

One rank only for now (tensor parallelism refuses the models that have them: models/sharding.py)::

    inputs = model.per_layer_embedding(input_ids, embedded)   # [T, L, P]
    out = layer.per_layer(out, inputs[:, i])
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from nanostream.layers.linear import Gemm
from nanostream.layers.norm import RMSNorm, RMSNormFn, rms_norm


class PerLayerEmbedding(nn.Module):
    def __init__(
        self, vocab: int, size: int, num_layers: int, hidden_size: int, eps: float,
        norm_kernel: RMSNormFn = rms_norm, gemm: Gemm = F.linear,
    ) -> None:  # fmt: skip
        super().__init__()
        self.size, self.num_layers, self.hidden_size, self.gemm = size, num_layers, hidden_size, gemm
        self.embed_tokens_per_layer = nn.Embedding(vocab, num_layers * size)
        self.per_layer_model_projection = nn.Linear(hidden_size, num_layers * size, bias=False)
        self.per_layer_projection_norm = RMSNorm(size, eps, norm_kernel, weight_offset=0.0)

    def forward(self, input_ids: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        # input_ids [T], embedded [T, H] (the scaled embedding) -> [T, L, P]
        table = self.embed_tokens_per_layer.weight
        tokens = F.embedding(input_ids, table) * torch.tensor(self.size**0.5).to(table.dtype)
        projected = self.gemm(embedded, self.per_layer_model_projection.weight) * self.hidden_size**-0.5
        projected = self.per_layer_projection_norm(projected.unflatten(-1, (self.num_layers, self.size)))
        return (projected + tokens.unflatten(-1, (self.num_layers, self.size))) * 2.0**-0.5


class PerLayerInput(nn.Module):
    def __init__(
        self, hidden_size: int, size: int, eps: float, act: Callable[[torch.Tensor], torch.Tensor],
        norm_kernel: RMSNormFn = rms_norm, gemm: Gemm = F.linear,
    ) -> None:  # fmt: skip
        super().__init__()
        self.act, self.gemm = act, gemm
        self.per_layer_input_gate = nn.Linear(hidden_size, size, bias=False)
        self.per_layer_projection = nn.Linear(size, hidden_size, bias=False)
        self.post_per_layer_input_norm = RMSNorm(hidden_size, eps, norm_kernel, weight_offset=0.0)

    def forward(self, out: torch.Tensor, per_layer_input: torch.Tensor) -> torch.Tensor:
        # out [T, H], per_layer_input [T, P] -> [T, H]
        gated = self.act(self.gemm(out, self.per_layer_input_gate.weight)) * per_layer_input
        return out + self.post_per_layer_input_norm(self.gemm(gated, self.per_layer_projection.weight))
