"""Rotary position embedding: how a model rotates (``RopeSpec``), its cos/sin tables, and the reference rotation.
The rope types transformers scales the frequencies by are layers/rope_scaling.py's; reading a config's rope
parameters into a ``RopeSpec`` (``rope_spec``) is layers/rope_config.py's.

Every table is in one format, ``[max_position, D/2]`` float32, and rotates full rotate-half pairs ``(i, i + D/2)``
of a head of D dims; the fused attention prologue (kernels/qkv_prologue.py) reads the same tables. Families that
rotate otherwise run in it through a fixed permutation of each head's dims (``RopeSpec.head_order``):

- partial rotary (Phi-3, GLM-4: only the first ``rotary_dim`` dims rotate, pairs ``(i, i + rotary_dim/2)``), whose
  pass-through dims land on pairs with cos = 1, sin = 0;
- interleaved pairs ``(2i, 2i + 1)`` (GLM-4).

Permuting the q and k projection rows of each head alike (and their biases, and per-head q/k norm weights) once
after loading leaves q·k, so attention, unchanged: the permuted model rotates in the one format.

    spec = rope_spec(config.rope_parameters, head_dim=128, max_position_embeddings=131072,
                     allowed=("default", "yarn"), model="Qwen3ForCausalLM")
    rotary = RotaryEmbedding(128, 131072, spec)
    q, k = rotary(positions, q, k)   # q: [T, Hq, D], k: [T, Hkv, D]

The tables are bit-identical to transformers' (5.24) cos/sin, attention factor folded in as it folds it: each
step is the same float32 op on the same values as ``transformers.modeling_rope_utils``.

M-RoPE (Qwen3.5, Qwen3-VL: ``RopeSpec.mrope_section``) gives a token three positions, [3, T] (temporal, height,
width; models/vision/mrope.py), and turns each pair by one of them: the rotary then reads, for token t and pair
j, the table's row ``positions[axis(j), t]`` (``tables_at``). A text token's three positions are equal, so
[T] positions, the tables as they are, rotate it alike; a model with M-RoPE takes either.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from nanostream.layers.rope_scaling import RopeScaling, default_inv_freq

RotaryFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""``(positions, q, k, cos, sin)`` -> rotated (q, k): this module's ``apply_rotary`` or a compiled form of it."""


def dims_problem(head_dim: int, rotary_dim: int) -> str | None:
    """What keeps a head of ``head_dim`` dims rotating ``rotary_dim`` of them from the table format, or None."""
    if head_dim % 2:
        return f"head_dim {head_dim} is odd; the rotary tables pair a head's dims"
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        return f"a rotary dim of {rotary_dim} in a head of {head_dim} (it must be even, from 2 to head_dim)"
    return None


@dataclass(frozen=True)
class RopeSpec:
    """How a model rotates: ``RopeSpec(1e6)`` is plain RoPE over the whole head; ``rope_spec`` reads a config's.

    ``rotary_dim``: the dims that rotate, the head's first ones (partial_rotary_factor × head_dim); None: all.
    ``interleaved``: the model rotates pairs (2i, 2i + 1) (GLM-4), not (i, i + rotary_dim/2).
    ``mrope_section``: M-RoPE's (t, h, w) split of the pairs, interleaved as Qwen3.5 and Qwen3-VL split them, or
    in three runs as Qwen2-VL and Qwen2.5-VL do (``mrope_interleaved`` False) (``mrope_axes``); None: one position a
    token."""

    theta: float
    scaling: RopeScaling | None = None
    rotary_dim: int | None = None
    interleaved: bool = False
    mrope_section: tuple[int, int, int] | None = None
    mrope_interleaved: bool = True

    @property
    def rope_type(self) -> str:
        return "default" if self.scaling is None else self.scaling.rope_type

    def head_order(self, head_dim: int) -> torch.Tensor | None:
        """The permutation of a head's dims that puts this model's rotation in the table format; None: identity.

        ``order`` (LongTensor [head_dim]): rotating ``x[..., order]`` with the tables equals the model's rotation
        of ``x``, permuted: ``rotate(x[..., order]) == model_rotation(x)[..., order]``. Apply it once to each head's
        q and k projection rows, their biases and q/k norm weights (``permute_heads``). Its first half holds the
        first dim of each rotated pair, then half the pass-through dims; its second half the pairs' second dims,
        then the other pass-through dims, on which the tables hold cos = 1, sin = 0."""
        rotary_dim = self.rotary_dim or head_dim
        if rotary_dim == head_dim and not self.interleaved:
            return None
        pairs = torch.arange(rotary_dim // 2)
        first, second = (2 * pairs, 2 * pairs + 1) if self.interleaved else (pairs, pairs + rotary_dim // 2)
        passed = torch.arange(rotary_dim, head_dim).view(2, -1)
        return torch.cat((first, passed[0], second, passed[1]))

    def mrope_axes(self, head_dim: int) -> torch.Tensor | None:
        """Which of a token's three M-RoPE positions (0 temporal, 1 height, 2 width) each table column turns by:
        LongTensor [head_dim/2]; None without M-RoPE. Pairs interleave t, h, w, t, h, w, ... as transformers'
        Qwen3.5 / Qwen3-VL rotary does: pair j takes height where j % 3 == 1 and j < 3 * section[1], width where
        j % 3 == 2 and j < 3 * section[2], temporal elsewhere (and the pass-through columns, which turn by none).
        Not interleaved (Qwen2-VL, Qwen2.5-VL): the first section[0] pairs temporal, the next section[1] height, the
        next section[2] width."""
        if self.mrope_section is None:
            return None
        j = torch.arange(head_dim // 2)
        _, height, width = self.mrope_section
        if not self.mrope_interleaved:
            t = self.mrope_section[0]
            return ((j >= t).long() + (j >= t + height).long()) * (j < t + height + width).long()
        axes = torch.zeros_like(j)
        axes[(j % 3 == 1) & (j < 3 * height)] = 1
        axes[(j % 3 == 2) & (j < 3 * width)] = 2
        return axes

    def tables(self, head_dim: int, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [max_position, head_dim/2] float32, in the order of ``head_order``."""
        rotary_dim = self.rotary_dim or head_dim
        problem = dims_problem(head_dim, rotary_dim)
        if problem is not None:
            raise ValueError(f"RopeSpec cannot rotate {problem}")
        positions = torch.arange(max_position).float()
        if self.scaling is None:
            angles = positions[:, None] * default_inv_freq(self.theta, rotary_dim)[None, :]
            scale = 1.0
        else:
            angles, scale = self.scaling.angles(positions, self.theta, rotary_dim), self.scaling.table_scale
        cos, sin = angles.cos() * scale, angles.sin() * scale  # [P, rotary_dim/2]
        passed = (head_dim - rotary_dim) // 2  # pass-through pairs: cos 1, sin 0 leave them as they are
        cos = torch.cat((cos, torch.ones(max_position, passed)), dim=1)
        sin = torch.cat((sin, torch.zeros(max_position, passed)), dim=1)
        return cos, sin


def permute_heads(rows: torch.Tensor, order: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``rows`` (a projection's weight [H·D, in] or bias [H·D], or a per-head norm weight [D]) with each head's
    D rows in ``order``: ``permute_heads(w, order, D)[h·D + j] == w[h·D + order[j]]``. Apply once."""
    return rows.unflatten(0, (-1, head_dim))[:, order].flatten(0, 1)


def apply_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference. q: [T, Hq, D], k: [T, Hkv, D], positions: [T]; cos, sin: [max_position, D/2] float32."""
    cos = cos[positions][:, None, :].to(q.dtype)  # [T, 1, D/2]
    sin = sin[positions][:, None, :].to(q.dtype)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RotaryEmbedding(nn.Module):
    """cos/sin tables [max_position, D/2] (float32, also read by the fused attention prologue) built from
    ``spec``, and ``kernel``, fixed at construction, that rotates with them. Where ``spec.head_order(head_dim)``
    is not None, q and k must come in that order (their projection rows permuted once, ``permute_heads``)."""

    def __init__(self, head_dim: int, max_position: int, spec: RopeSpec, kernel: RotaryFn = apply_rotary) -> None:
        super().__init__()
        self.spec = spec
        cos, sin = spec.tables(head_dim, max_position)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.register_buffer("mrope_axes", spec.mrope_axes(head_dim), persistent=False)  # [D/2] long, or None
        self.kernel = kernel

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, Hq, D], k: [T, Hkv, D], positions: [T], or [3, T] with M-RoPE
        if positions.dim() == 1:
            return self.kernel(positions, q, k, self.cos, self.sin)
        rows, cos, sin = self.tables_at(positions)
        return self.kernel(rows, q, k, cos, sin)

    def tables_at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows [T], cos, sin): the tables and the row of them each token reads, as ``kernel`` and the fused
        attention prologue take them. [T] positions read the whole tables; M-RoPE's [3, T] read tables gathered for
        these T tokens ([T, D/2] each, row t token t's): column j of row t is the whole table's at row
        ``positions[axis(j), t]``, the same float32 values transformers computes for that angle."""
        if positions.dim() == 1:
            return positions, self.cos, self.sin
        if self.mrope_axes is None or positions.shape[0] != 3:
            raise ValueError(
                f"positions of shape {tuple(positions.shape)}: this rotary takes [T] positions"
                + ("" if self.mrope_axes is None else " or M-RoPE's [3, T] (temporal, height, width)")
            )
        per_pair = positions[self.mrope_axes].T  # [T, D/2]: the position pair j of token t turns by
        columns = torch.arange(per_pair.shape[1], device=positions.device)
        rows = torch.arange(per_pair.shape[0], device=positions.device)
        return rows, self.cos[per_pair, columns], self.sin[per_pair, columns]
