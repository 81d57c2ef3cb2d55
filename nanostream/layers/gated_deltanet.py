"""The Gated DeltaNet layer of Qwen3-Next and Qwen3.5 / Qwen3.6 (their ``linear_attention`` layers): its weights
as the checkpoints name them, this rank's share of them, its per-sequence state in the engine's state pool, and
its forward over a step's packed tokens (the math, as pure functions: layers/delta_rule.py).

One input projection ``in_proj`` (fused from the checkpoint's ``in_proj_qkv``, ``_z``, ``_b``, ``_a``, or from
Qwen3-Next's ``in_proj_qkvz`` and ``in_proj_ba``), then per sequence the causal conv1d and the delta rule from its
state, the gated norm, and ``out_proj``. With tensor parallelism a rank holds whole key heads ``k_heads`` and the
value heads that read them (``v_per_k`` each), so its conv channels, its states and its columns of ``out_proj``
(row parallel: one all-reduce) are its own; norm weight and conv kernel size are whole on every rank.

A step comes as ``ForwardContext`` (layers/attention.py): sequence b's tokens are
``hidden[cu_seqlens_q_host[b]:cu_seqlens_q_host[b+1]]``, its state is row ``ctx.states.slots[b]`` of the layer's
``StateCache`` (the engine zeroes or restores it before the step), and ``ctx.states.snapshots`` asks for copies of
a sequence's state after its first n tokens of the step (prefix caching) into other rows::

    layer = GatedDeltaNet(spec, layer_idx=0)
    layer.cache_spec()                       # RecurrentState: conv [C, K-1] (model dtype), ssm [Hv, Dk, Dv] float32
    out = layer(hidden, ctx)                 # [T, H]; the states of ctx.kv_caches[0] advanced in place
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from nanostream.distributed.group import SINGLE, TensorParallel
from nanostream.layers.cache_spec import RecurrentState, StateCache, StateMetadata, StateTensor, copy_rows
from nanostream.layers.delta_rule import GatedDeltaNetSpec, GatedRMSNorm, causal_conv1d, gated_delta_rule
from nanostream.layers.delta_rule_fla import DecodeRule, Heads, VarlenRule, varlen_with_snapshots
from nanostream.layers.linear import Gemm, MergedColumnLinear, TensorSlice, row_parallel_linear
from nanostream.layers.recurrent_pieces import advance_in_pieces, one_token_rows

if TYPE_CHECKING:
    from nanostream.layers.attention import ForwardContext

__all__ = ["GatedDeltaNet", "GatedDeltaNetSpec"]


def _shape(loaded: TensorSlice) -> tuple[int, ...]:
    return tuple(loaded.get_shape() if hasattr(loaded, "get_shape") else loaded.shape)


class ConvWeight(nn.Module):
    """The depthwise conv's weight [C', 1, K] (the checkpoint's ``conv1d.weight`` [C, 1, K]): the ``rows`` of it this
    rank holds, this rank's q, k and v channels one after the other."""

    def __init__(self, rows: list[range], channels: int, kernel: int) -> None:
        super().__init__()
        self.rows, self.channels = rows, channels
        self.weight = nn.Parameter(torch.empty(sum(len(r) for r in rows), 1, kernel))

    def load_weight(self, param: nn.Parameter, loaded: TensorSlice) -> None:
        expected = (self.channels, 1, param.shape[2])
        if _shape(loaded) != expected:
            raise ValueError(f"conv1d weight of shape {_shape(loaded)}, expected {expected}")
        offset = 0
        for rows in self.rows:
            param.data[offset : offset + len(rows)].copy_(loaded[rows.start : rows.stop])
            offset += len(rows)


class GatedDeltaNet(nn.Module):
    """The layer (its parameters named as the checkpoints' ``linear_attn.*``, the input projections fused into
    ``in_proj``) over this rank's key heads ``k_heads`` (None: all of them).

    ``forward(hidden, ctx)`` runs a step with the engine's state pool; ``step(hidden, cu_seqlens, conv, ssm)``
    runs one on states passed as tensors. The decoder calls the pieces: ``in_proj``, ``mix``, ``out_proj``.
    ``varlen``: the conv and delta rule of a step's sequences in one call (fla-core's kernels, CUDA); None: the torch
    reference, a sequence at a time. ``decode``: a decode step's, read and written at the slots (CUDA)."""

    def __init__(
        self,
        spec: GatedDeltaNetSpec,
        layer_idx: int = 0,
        k_heads: range | None = None,
        tp: TensorParallel = SINGLE,
        gemm: Gemm = F.linear,
        varlen: VarlenRule | None = None,
        decode: DecodeRule | None = None,
    ) -> None:
        super().__init__()
        self.spec, self.layer_idx = spec, layer_idx
        self.varlen = varlen  # all sequences of a step at once (layers/delta_rule_fla.py); None: one by one
        self.decode = decode  # a decode step in place at the slots (kernels/gated_delta_decode.py); None: as others
        s, r = spec, spec.v_per_k
        self.k_heads = range(s.num_k_heads) if k_heads is None else k_heads
        self.v_heads = range(self.k_heads.start * r, self.k_heads.stop * r)
        self.num_k_heads, self.num_v_heads = len(self.k_heads), len(self.v_heads)
        dk, dv = s.head_k_dim, s.head_v_dim
        k_rows = range(self.k_heads.start * dk, self.k_heads.stop * dk)
        v_rows = range(self.v_heads.start * dv, self.v_heads.stop * dv)
        self.key_dim, self.value_dim = len(k_rows), len(v_rows)  # this rank's
        if s.fused_projections:  # rows grouped per key head: a rank's heads are one range of each tensor
            group, ba = 2 * dk + 2 * r * dv, 2 * r
            parts = {
                "qkvz": (range(self.k_heads.start * group, self.k_heads.stop * group), s.num_k_heads * group),
                "ba": (range(self.k_heads.start * ba, self.k_heads.stop * ba), s.num_k_heads * ba),
            }
        else:
            parts = {
                "qkv.q": (k_rows, s.key_dim),
                "qkv.k": (k_rows, s.key_dim),
                "qkv.v": (v_rows, s.value_dim),
                "z": (v_rows, s.value_dim),
                "b": (self.v_heads, s.num_v_heads),
                "a": (self.v_heads, s.num_v_heads),
            }
        self.in_proj = MergedColumnLinear(s.hidden_size, parts, bias=False, gemm=gemm)
        # the conv's channels: [q | k | v] over all heads, whatever the projections' layout
        conv_rows = [k_rows, _shift(k_rows, s.key_dim), _shift(v_rows, 2 * s.key_dim)]
        self.conv1d = ConvWeight(conv_rows, s.conv_channels, s.conv_kernel)
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.norm = GatedRMSNorm(dv, s.rms_norm_eps)
        self.out_proj = row_parallel_linear(v_rows, s.hidden_size, False, tp, gemm)

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        """This rank's conv state of a sequence: [C', K-1]."""
        return (2 * self.key_dim + self.value_dim, self.spec.conv_kernel - 1)

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        """This rank's recurrent state of a sequence: [Hv', Dk, Dv] (float32)."""
        return (self.num_v_heads, self.spec.head_k_dim, self.spec.head_v_dim)

    def cache_spec(self) -> RecurrentState:
        """A sequence's state in this layer: (conv [C', K-1] in the model's dtype, ssm [Hv', Dk, Dv] float32)."""
        return RecurrentState((StateTensor(self.conv_state_shape), StateTensor(self.ssm_state_shape, torch.float32)))

    def load_weight(self, param: nn.Parameter, loaded: TensorSlice) -> None:
        """``A_log`` or ``dt_bias`` [Hv]: this rank's value heads."""
        if _shape(loaded) != (self.spec.num_v_heads,):
            raise ValueError(f"A_log / dt_bias of shape {_shape(loaded)}, expected ({self.spec.num_v_heads},)")
        param.data.copy_(loaded[self.v_heads.start : self.v_heads.stop])

    def forward(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """hidden [T, H] (normed), the step's packed tokens -> [T, H]; ``ctx``: a ``ForwardContext`` whose
        ``kv_caches[layer_idx]`` is this layer's ``StateCache`` and ``states`` the step's ``StateMetadata``."""
        return self.out_proj(self.mix(None, self.in_proj(hidden), ctx))

    def mix(self, positions: torch.Tensor | None, projected: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``in_proj``'s output [T, P] -> the gated norm's [T, Hv' Dv], the states advanced: one-token sequences in
        place at their slots (the decode kernel); the others' rows gathered from the pool, run (cut where a snapshot
        is asked for, copied there), written back. ``positions`` are not read (no position embedding here)."""
        cache, states = ctx.kv_caches[self.layer_idx], ctx.states
        if not isinstance(cache, StateCache) or states is None:
            raise TypeError(
                f"layer {self.layer_idx} is a Gated DeltaNet layer: it needs a StateCache and ctx.states, got "
                f"{type(cache).__name__} and {type(states).__name__}"
            )
        conv_pool, ssm_pool = cache.tensors  # [slots, C', K-1], [slots, Hv', Dk, Dv]
        qkv, z, beta, g = self._gates(projected)
        weight, dk = self.conv1d.weight[:, 0], self.spec.head_k_dim
        copies = states.decode_copies() if self.decode is not None and ctx.attn.is_decode else None
        if copies is not None:  # a token a sequence, in place at the slots (a CUDA graph replays this)
            core = self.decode(qkv, g, beta, weight, conv_pool, ssm_pool, states.slots, self.num_k_heads, dk)
            copy_rows(cache, copies)
            return self.norm(core, z).flatten(1)
        bounds = ctx.attn.cu_seqlens_q_host
        if len(bounds) != len(states.slots_host) + 1:
            raise ValueError(f"{len(bounds) - 1} sequences in the step, {len(states.slots_host)} state slots")
        split = one_token_rows(states, bounds, qkv.device) if self.decode is not None else None
        if split is None:
            core = self._prompt_rows((qkv, g, beta), bounds, ctx.attn.cu_seqlens_q, states, cache)
        else:  # decoding sequences beside prompt chunks: the former as a decode step runs them, in place
            t, rest = split.tokens, split.rest_tokens
            core = z.new_empty(z.shape)
            core[t] = self.decode(qkv[t], g[t], beta[t], weight, conv_pool, ssm_pool, split.slots, self.num_k_heads, dk)
            copy_rows(cache, split.copies)
            gates = (qkv[rest], g[rest], beta[rest])
            core[rest] = self._prompt_rows(gates, split.rest_bounds, split.rest_cu, split.rest, cache)
        return self.norm(core, z).flatten(1)

    def _prompt_rows(
        self, gates: tuple, bounds: list[int], cu_seqlens: torch.Tensor, states: StateMetadata, cache: StateCache
    ) -> torch.Tensor:
        """Sequence b's tokens ``bounds[b]:bounds[b+1]`` (``gates``: their qkv, g, beta) from its state (row
        ``states.slots[b]`` of the pools, gathered, advanced, written back), snapshots taken where ``states`` asks: the
        delta rule's output [T, Hv', Dv]."""
        (qkv, g, beta), (conv_pool, ssm_pool) = gates, cache.tensors
        conv, ssm = conv_pool.index_select(0, states.slots), ssm_pool.index_select(0, states.slots)  # copies
        cuts = [states.snapshots_of(b) for b in range(len(states.slots_host))]
        if self.varlen is None:
            core = self._advance_rows(qkv, g, beta, bounds, conv, ssm, cuts, cache.tensors)
        else:
            heads = Heads(self.num_k_heads, self.spec.head_k_dim, self.num_v_heads, self.spec.head_v_dim)
            weight = self.conv1d.weight[:, 0]
            core = varlen_with_snapshots(
                qkv, g, beta, weight, conv, ssm, bounds, cu_seqlens, cuts, cache.tensors, heads, self.varlen
            )
        conv_pool.index_copy_(0, states.slots, conv)
        ssm_pool.index_copy_(0, states.slots, ssm)
        return core

    def step(
        self, hidden: torch.Tensor, cu_seqlens: torch.Tensor, conv_states: torch.Tensor, ssm_states: torch.Tensor
    ) -> torch.Tensor:
        """The layer on states passed as tensors: hidden [T, H], sequence b's tokens
        ``hidden[cu_seqlens[b]:cu_seqlens[b+1]]`` (cu_seqlens [B+1]); conv_states [B, C', K-1] and ssm_states
        [B, Hv', Dk, Dv] (float32) hold each sequence's state before the step and are updated in place to its
        state after (views of a pool; rows gathered by an index tensor are copies, to be scattered back). [T, H]."""
        bounds = self._bounds(hidden, cu_seqlens, conv_states, ssm_states)
        qkv, z, beta, g = self._gates(self.in_proj(hidden))
        cuts = [[] for _ in range(len(bounds) - 1)]
        core = self._advance_rows(qkv, g, beta, bounds, conv_states, ssm_states, cuts, None)
        return self.out_proj(self.norm(core, z).flatten(1))

    def _advance_rows(
        self,
        qkv: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        bounds: list[int],
        conv: torch.Tensor,
        ssm: torch.Tensor,
        cuts: list[list[tuple[int, int]]],
        pools: tuple[torch.Tensor, ...] | None,
    ) -> torch.Tensor:
        """Sequence b's tokens from its states ``conv[b]``, ``ssm[b]`` (advanced in place), copied into row ``slot`` of
        ``pools`` after its first n tokens for each (n, slot) of ``cuts[b]``: the delta rule's output [T, Hv', Dv]."""
        core = qkv.new_empty(qkv.shape[0], self.num_v_heads, self.spec.head_v_dim)

        def advance(piece: slice, i: int) -> None:
            core[piece] = self._advance(qkv[piece], g[piece], beta[piece], conv[i], ssm[i])

        advance_in_pieces(bounds, cuts, (conv, ssm), pools, advance)
        return core

    def _gates(self, projected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(qkv [T, C'], z [T, Hv', Dv], beta [T, Hv'], g [T, Hv'] float32 log decay) of ``in_proj``'s [T, P]."""
        qkv, z, b, a = self._split(projected)
        # float32 before the exp: a float16 exp(A_log) may overflow to inf (transformers' note)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        return qkv, z, b.sigmoid(), g

    def _advance(
        self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor
    ) -> torch.Tensor:
        """One sequence's L tokens: the conv and the delta rule from its states (updated in place); [L, Hv', Dv]."""
        s, r = self.spec, self.spec.v_per_k
        x, new_conv = causal_conv1d(qkv, self.conv1d.weight[:, 0], conv_state)
        conv_state.copy_(new_conv)
        q, k, v = x.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        # [L, Hk', Dk] -> [L, Hv', Dk]: key head j serves value heads j*r .. j*r + r-1
        q = q.unflatten(-1, (self.num_k_heads, s.head_k_dim)).repeat_interleave(r, dim=1)
        k = k.unflatten(-1, (self.num_k_heads, s.head_k_dim)).repeat_interleave(r, dim=1)
        v = v.unflatten(-1, (self.num_v_heads, s.head_v_dim))
        out, state = gated_delta_rule(q, k, v, g, beta, ssm_state)
        ssm_state.copy_(state)
        return out

    def _split(self, projected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(qkv [T, C'] in the conv's channel order, z [T, Hv', Dv], b [T, Hv'], a [T, Hv']) of ``in_proj``'s [T, P]."""
        s, hv, tokens = self.spec, self.num_v_heads, projected.shape[0]
        if not s.fused_projections:
            qkv, z, b, a = projected.split([2 * self.key_dim + self.value_dim, self.value_dim, hv, hv], dim=-1)
            return qkv, z.unflatten(-1, (hv, s.head_v_dim)), b, a
        # Rows grouped per key head ([T, Hk', ...]): regroup q, k, v head-major over this rank's heads, as the conv's.
        per_k = s.v_per_k * s.head_v_dim
        qkvz, ba = projected.split([self.num_k_heads * 2 * (s.head_k_dim + per_k), 2 * hv], dim=-1)
        q, k, v, z = qkvz.unflatten(-1, (self.num_k_heads, -1)).split([s.head_k_dim, s.head_k_dim, per_k, per_k], -1)
        b, a = ba.unflatten(-1, (self.num_k_heads, -1)).split([s.v_per_k, s.v_per_k], dim=-1)
        qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=-1)
        return qkv, z.reshape(tokens, hv, s.head_v_dim), b.flatten(1), a.flatten(1)

    def _bounds(
        self, hidden: torch.Tensor, cu_seqlens: torch.Tensor, conv_states: torch.Tensor, ssm_states: torch.Tensor
    ) -> list[int]:
        """cu_seqlens as a list, once the arguments' shapes are checked."""
        s = self.spec
        if hidden.dim() != 2 or hidden.shape[1] != s.hidden_size:
            raise ValueError(f"hidden of shape {tuple(hidden.shape)}: expected [T, {s.hidden_size}]")
        bounds = cu_seqlens.tolist()
        if (
            cu_seqlens.dim() != 1
            or len(bounds) < 2
            or bounds[0] != 0
            or bounds[-1] != hidden.shape[0]
            or any(a > b for a, b in itertools.pairwise(bounds))
        ):
            raise ValueError(f"cu_seqlens {bounds}: expected [B+1] non-decreasing from 0 to {hidden.shape[0]}")
        batch = len(bounds) - 1
        for name, states, shape in (
            ("conv_states", conv_states, self.conv_state_shape),
            ("ssm_states", ssm_states, self.ssm_state_shape),
        ):
            if tuple(states.shape) != (batch, *shape):
                raise ValueError(f"{name} of shape {tuple(states.shape)}: expected {(batch, *shape)}")
        if ssm_states.dtype != torch.float32:
            raise TypeError(f"ssm_states of dtype {ssm_states.dtype}: the recurrent state is kept in torch.float32")
        return bounds


def _shift(rows: range, by: int) -> range:
    return range(rows.start + by, rows.stop + by)
