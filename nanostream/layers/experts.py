"""The routed experts' weights (``Experts``): every expert's gated MLP over this rank's rows of its intermediate
dimension, stacked as the fused kernel reads them, and their loading from any published checkpoint layout.
The MoE block (layers/moe.py) holds one and calls it with the router's choice.
"""

from __future__ import annotations

import torch
from torch import nn

from nanostream.layers.linear import TensorSlice
from nanostream.layers.moe_spec import MoEFn, MoESpec


class Experts(nn.Module):
    """Every expert's gated MLP over ``rows`` of its intermediate dimension (all of them at one rank).

    Checkpoint tensors arrive per expert (``load_shard(param, tensor, "gate.3")``: expert 3's gate_proj,
    [I, H]) or stacked (``"gate_up"``: [E, 2I, H] as transformers' ``save_pretrained`` writes it, or inputs first,
    [E, H, 2I], as gpt-oss (gate and up interleaved), Llama 4 and Qwen3-VL-MoE publish it, whichever the tensor's
    shape says; ``"down"``: [E, H, I], or [E, I, H]; the
    biases ``"gate_up"`` of ``w13_bias``, [E, 2I] laid out as its weight's 2I, and ``"down"`` of
    ``w2_bias``, [E, H]); either way only this rank's rows are read.

    Down's bias is loaded on every rank but added only by the one holding the first rows: each rank's
    output is a partial sum that the block's all-reduce adds."""

    def __init__(self, hidden_size: int, spec: MoESpec, rows: range, kernel: MoEFn) -> None:
        super().__init__()
        num_experts = spec.num_experts
        self.rows, self.total, self.kernel, self.activation = rows, spec.intermediate_size, kernel, spec.activation
        self.transposed, self.interleaved = spec.transposed_experts, spec.interleaved_gate_up
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * len(rows), hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, len(rows)))
        self.w13_bias = nn.Parameter(torch.empty(num_experts, 2 * len(rows))) if spec.expert_bias else None
        self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden_size)) if spec.expert_bias else None
        self.adds_down_bias = rows.start == 0

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        w2_bias = self.w2_bias if self.adds_down_bias else None
        return self.kernel(
            x, self.w13, self.w2, topk_weights, topk_ids, w13_bias=self.w13_bias, w2_bias=w2_bias,
            activation=self.activation,
        )  # fmt: skip

    def shards(self, param: nn.Parameter) -> list[str]:
        """The checkpoint parts ``param`` is made of, each to be loaded once."""
        if param is self.w13_bias or param is self.w2_bias:
            return ["gate_up" if param is self.w13_bias else "down"]
        parts = ("gate", "up") if param is self.w13 else ("down",)
        return [f"{part}.{e}" for e in range(self.w13.shape[0]) for part in parts]

    def load_shard(self, param: nn.Parameter, loaded: TensorSlice, shard: str) -> list[str]:
        """Copy this rank's part of ``loaded`` (``shard``: "gate.E", "up.E", "down.E", "gate_up" or "down");
        the parts of ``shards`` it filled."""
        a, b, n, total = self.rows.start, self.rows.stop, len(self.rows), self.total
        shape = tuple(loaded.get_shape() if hasattr(loaded, "get_shape") else loaded.shape)
        num_experts, hidden = self.w13.shape[0], self.w13.shape[2]
        if param is self.w13_bias:
            self._check("gate_up bias", shape, (num_experts, 2 * total))
            gate, up = self._gate_and_up(loaded, dim=1)  # [E, n] each
            param.data[:, :n].copy_(gate)
            param.data[:, n:].copy_(up)
            return [shard]
        if param is self.w2_bias:
            self._check("down bias", shape, (num_experts, hidden))
            param.data.copy_(loaded[:])
            return [shard]
        if shard == "gate_up":
            transposed = self._inputs_first(shard, shape, (num_experts, 2 * total, hidden))
            gate, up = self._gate_and_up(loaded, dim=2 if transposed else 1)
            if transposed:  # [E, H, n] -> [E, n, H]
                gate, up = gate.transpose(1, 2), up.transpose(1, 2)
            param.data[:, :n].copy_(gate)
            param.data[:, n:].copy_(up)
            return self.shards(param)
        if shard == "down":
            transposed = self._inputs_first(shard, shape, (num_experts, hidden, total))
            param.data.copy_(loaded[:, a:b].transpose(1, 2) if transposed else loaded[:, :, a:b])
            return self.shards(param)
        part, expert = shard.split(".")
        e = int(expert)
        if e >= num_experts:
            raise ValueError(f"expert {e} in the checkpoint, but the config has {num_experts} experts")
        if part == "down":
            self._check(shard, shape, (hidden, total))
            param.data[e].copy_(loaded[:, a:b])
        else:
            self._check(shard, shape, (total, hidden))
            offset = 0 if part == "gate" else n
            param.data[e, offset : offset + n].copy_(loaded[a:b])
        return [shard]

    def _gate_and_up(self, loaded: TensorSlice, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's gate and up entries along ``dim`` of a stacked gate_up tensor (or its bias)."""
        a, b, total = self.rows.start, self.rows.stop, self.total
        lead = (slice(None),) * dim
        if self.interleaved:  # gate 0, up 0, gate 1, up 1, ...: this rank's 2n entries, read at once, then split
            both = loaded[(*lead, slice(2 * a, 2 * b))]
            return both[(*lead, slice(0, None, 2))], both[(*lead, slice(1, None, 2))]
        return loaded[(*lead, slice(a, b))], loaded[(*lead, slice(total + a, total + b))]

    def _inputs_first(self, shard: str, shape: tuple[int, ...], outputs_first: tuple[int, int, int]) -> bool:
        """Whether a stacked tensor of ``shape`` is laid out inputs first ([E, in, out]) rather than ``outputs_first``:
        as its shape says (checkpoints of one family come either way, and transformers reads both), the family's
        declared layout where both fit (a square one)."""
        inputs_first = (outputs_first[0], outputs_first[2], outputs_first[1])
        if shape == inputs_first == outputs_first or self.interleaved:  # (gpt-oss's layout is its own: as declared)
            self._check(shard, shape, inputs_first if self.transposed else outputs_first)
            return self.transposed
        if shape not in (inputs_first, outputs_first):
            self._check(shard, shape, inputs_first if self.transposed else outputs_first)
        return shape == inputs_first

    @staticmethod
    def _check(shard: str, shape: tuple[int, ...], expected: tuple[int, ...]) -> None:
        if shape != expected:
            raise ValueError(f"experts' {shard} tensor of shape {shape}, expected {expected}")
