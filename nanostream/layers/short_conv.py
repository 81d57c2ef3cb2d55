"""The gated short convolution of LFM2's ``conv`` layers: a token mixer with a fixed-size state per sequence.

``in_proj`` gives three gates of the hidden size, [B | C | x]; the layer convolves B * x over the last ``kernel``
tokens, channel by channel (a depthwise causal conv1d, no activation), and gates the result by C before
``out_proj``. A sequence's state is the conv's last ``kernel - 1`` inputs, [H', K-1] in the model's dtype, a slot of
the engine's state pool with the prefix cache's snapshots as Gated DeltaNet's (layers/gated_deltanet.py). With
tensor parallelism a rank holds ``channels`` of the hidden size: its rows of each gate, of the conv and of the
state, its columns of ``out_proj`` (row parallel: one all-reduce)::

    layer = ShortConv(ShortConvSpec(hidden_size=1024, kernel=3), layer_idx=0)
    layer.cache_spec()                  # RecurrentState: conv [1024, 2]
    out = layer.out_proj(layer.mix(None, layer.in_proj(hidden), ctx))   # [T, H]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from nanostream.distributed.group import SINGLE, TensorParallel
from nanostream.layers.cache_spec import RecurrentState, StateCache, StateMetadata, StateTensor, copy_rows
from nanostream.layers.delta_rule import causal_conv1d
from nanostream.layers.gated_deltanet import ConvWeight
from nanostream.layers.linear import Gemm, MergedColumnLinear, row_parallel_linear
from nanostream.layers.recurrent_pieces import advance_in_pieces, one_token_rows

if TYPE_CHECKING:
    from nanostream.layers.attention import ForwardContext


ConvDecode = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""A decode step's conv in place at the state slots: (x [B, C], weight [C, K], the pool [S, C, K-1], slots [B], < 0:
padding) -> [B, C] (kernels/gated_delta_decode.py's ``conv_decode`` without SiLU)."""


@dataclass(frozen=True)
class ShortConvSpec:
    """The short convolution layers' shape: the hidden size (its channels) and the conv's kernel (``conv_L_cache``)."""

    hidden_size: int
    kernel: int


class ShortConv(nn.Module):
    """The layer over this rank's ``channels`` (None: all), its parameters named as the checkpoints' ``conv.*``.
    ``decode``: a decode step's conv in place at the slots (a CUDA graph replays it); None: the reference path."""

    def __init__(
        self,
        spec: ShortConvSpec,
        layer_idx: int = 0,
        channels: range | None = None,
        tp: TensorParallel = SINGLE,
        gemm: Gemm = F.linear,
        decode: ConvDecode | None = None,
    ) -> None:
        super().__init__()
        h = spec.hidden_size
        self.spec, self.layer_idx, self.decode = spec, layer_idx, decode
        self.channels = range(h) if channels is None else channels
        parts = {gate: (self.channels, h) for gate in ("B", "C", "x")}
        self.in_proj = MergedColumnLinear(h, parts, bias=False, gemm=gemm)
        self.conv = ConvWeight([self.channels], h, spec.kernel)
        self.out_proj = row_parallel_linear(self.channels, h, False, tp, gemm)

    def cache_spec(self) -> RecurrentState:
        """A sequence's state in this layer: the conv's last K-1 inputs, [H', K-1] in the model's dtype."""
        return RecurrentState((StateTensor((len(self.channels), self.spec.kernel - 1)),))

    def mix(self, positions: torch.Tensor | None, projected: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``in_proj``'s output [T, 3 H'] -> the gated conv's [T, H'], each sequence's state advanced (and copied
        where a snapshot is asked for). ``positions`` are not read."""
        cache, states = ctx.kv_caches[self.layer_idx], ctx.states
        if not isinstance(cache, StateCache) or states is None:
            raise TypeError(f"layer {self.layer_idx} is a short convolution: it needs a StateCache and ctx.states")
        (pool,) = cache.tensors  # [slots, H', K-1]
        b, c, x = projected.chunk(3, dim=-1)  # [T, H'] each
        bx = b * x
        weight = self.conv.weight[:, 0]  # [H', K]
        copies = states.decode_copies() if self.decode is not None and ctx.attn.is_decode else None
        if copies is not None:  # a token a sequence, in place at the slots (a CUDA graph replays this)
            y = self.decode(bx, weight, pool, states.slots)
            copy_rows(cache, copies)
            return c * y
        bounds = ctx.attn.cu_seqlens_q_host
        split = one_token_rows(states, bounds, bx.device) if self.decode is not None else None
        if split is None:
            return self._prompt_rows(bx, c, weight, bounds, states, pool)
        # decoding sequences beside prompt chunks: the former in place at their slots, as a decode step runs them
        t, rest, out = split.tokens, split.rest_tokens, torch.empty_like(bx)
        out[t] = c[t] * self.decode(bx[t], weight, pool, split.slots)
        copy_rows(cache, split.copies)
        out[rest] = self._prompt_rows(bx[rest], c[rest], weight, split.rest_bounds, split.rest, pool)
        return out

    def _prompt_rows(
        self,
        bx: torch.Tensor,
        c: torch.Tensor,
        weight: torch.Tensor,
        bounds: list[int],
        states: StateMetadata,
        pool: torch.Tensor,
    ) -> torch.Tensor:
        """Sequence b's tokens ``bounds[b]:bounds[b+1]`` from row ``states.slots[b]`` of ``pool`` (gathered,
        advanced, written back; snapshots copied where ``states`` asks): the gated conv's output [T, H']."""
        out = torch.empty_like(bx)
        conv = pool.index_select(0, states.slots)  # copies, [B, H', K-1]

        def advance(piece: slice, i: int) -> None:
            y, new_state = causal_conv1d(bx[piece], weight, conv[i], silu=False)
            conv[i].copy_(new_state)
            out[piece] = c[piece] * y

        cuts = [states.snapshots_of(i) for i in range(len(states.slots_host))]
        advance_in_pieces(bounds, cuts, (conv,), (pool,), advance)
        pool.index_copy_(0, states.slots, conv)
        return out
