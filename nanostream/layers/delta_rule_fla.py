"""The Gated DeltaNet's conv and delta rule over a step's packed sequences through fla-core's Triton kernels
(flash-linear-attention's ops, on PyPI): what a CUDA model runs in place of layers/delta_rule.py's per-sequence
torch reference.

``varlen_delta_rule`` takes every sequence of one call at once, from and into its states: the conv through
``fla.modules.causal_conv1d`` (its state is [N, C, K], the oldest column never read: ours, [N, C, K-1], padded
in front), the delta rule through ``chunk_gated_delta_rule`` (prompt chunks) or
``fused_recurrent_gated_delta_rule`` (a step of one token a sequence), both with the value heads reading their
key head (``HV > H``), q and k L2-normalised in the kernel, the state [N, Hv, Dk, Dv] float32 as ours. A decode
step's conv is a few elementwise torch ops on [N, C, K] (no varlen bookkeeping, so a CUDA graph captures the step).

    core = varlen_delta_rule(qkv, g, beta, weight, conv, ssm, cu_seqlens, heads)  # conv, ssm advanced in place
"""

from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F


class Heads(NamedTuple):
    """This rank's heads of a Gated DeltaNet layer: key heads, their dim, value heads, their dim."""

    k: int
    dk: int
    v: int
    dv: int


def fla_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model on ``device`` in ``dtype`` runs the kernels: on CUDA, with fla-core installed, and not in
    float32, whose models keep the reference's exact float32 arithmetic (the kernels' tensor-core products round
    their inputs to TF32)."""
    return device.type == "cuda" and dtype != torch.float32 and importlib.util.find_spec("fla") is not None


def varlen_delta_rule(
    qkv: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    weight: torch.Tensor,
    conv: torch.Tensor,
    ssm: torch.Tensor,
    cu_seqlens: torch.Tensor,
    heads: Heads,
    decode: bool = False,
) -> torch.Tensor:
    """N sequences' tokens: qkv [T, C] (the conv's input: q, k, v channels), g [T, Hv] float32 log decay, beta
    [T, Hv], weight [C, K], conv [N, C, K-1] and ssm [N, Hv, Dk, Dv] float32 their states (advanced in place),
    cu_seqlens [N+1] int32 on the device (each sequence at least one token); ``decode``: every sequence has one
    token. Returns the delta rule's output [T, Hv, Dv] in qkv's dtype."""
    from fla.modules.causal_conv1d import causal_conv1d
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    split = [heads.k * heads.dk, heads.k * heads.dk, heads.v * heads.dv]
    cu = cu_seqlens.long()
    state = F.pad(conv, (1, 0)).contiguous()  # [N, C, K]: fla's, whose first column is never read
    x, final = causal_conv1d(
        qkv[None], weight, initial_state=state, output_final_state=True, activation="silu", cu_seqlens=cu
    )
    conv.copy_(final[..., 1:])
    q, k, v = x.split(split, dim=-1)  # [1, T, ...]
    # (a decode step too: fla 0.6's fused recurrent rule, batched one token a sequence, did not match the reference
    # on an H200, 2-3% of outputs off; the chunked rule does at every length)
    rule, g, beta = chunk_gated_delta_rule, g[None], beta[None]
    q, k = q.unflatten(-1, (heads.k, heads.dk)), k.unflatten(-1, (heads.k, heads.dk))  # [B, T, Hk, Dk]
    v = v.unflatten(-1, (heads.v, heads.dv))  # [B, T, Hv, Dv]
    out, final_ssm = rule(
        q, k, v, g, beta, scale=heads.dk**-0.5, initial_state=ssm.contiguous(), output_final_state=True,
        use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
    )  # fmt: skip
    ssm.copy_(final_ssm)
    return out.flatten(0, 1)  # [T, Hv, Dv]


VarlenRule = Callable[..., torch.Tensor]
"""``varlen_delta_rule``'s signature: (qkv, g, beta, weight, conv, ssm, cu_seqlens, heads, decode) -> [T, Hv, Dv]."""
DecodeRule = Callable[..., torch.Tensor]
"""kernels/gated_delta_decode.py's ``decode_step``: (qkv, g, beta, weight, conv_pool, ssm_pool, slots, k_heads, dk)
-> [B, Hv, Dv], the pools advanced in place at rows ``slots``."""


def varlen_with_snapshots(
    qkv: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    weight: torch.Tensor,
    conv: torch.Tensor,
    ssm: torch.Tensor,
    bounds: list[int],
    cu_seqlens: torch.Tensor,
    cuts: list[list[tuple[int, int]]],
    pools: tuple[torch.Tensor, torch.Tensor],
    heads: Heads,
    rule: VarlenRule = varlen_delta_rule,
) -> torch.Tensor:
    """``rule`` (``varlen_delta_rule``) over a step's sequences (sequence b's tokens ``bounds[b]:bounds[b+1]``,
    ``cu_seqlens`` the same on the device), each state copied into row ``slot`` of ``pools`` (conv, ssm) after
    its first n tokens for each (n, slot) of ``cuts[b]``. A sequence's tokens are cut there and the r-th pieces
    of all sequences run in one call: a step without a snapshot inside a chunk is one call. [T, Hv, Dv]."""
    pieces = []  # per sequence: (first token, end, the slots that take its state after them)
    for b, (start, end) in enumerate(itertools.pairwise(bounds)):
        marks: dict[int, list[int]] = {}
        for n, slot in cuts[b]:
            marks.setdefault(n, []).append(slot)
        done, mine = 0, []
        for n in sorted(set(marks) | {end - start}):
            mine.append((start + done, start + n, marks.get(n, [])))
            done = n
        pieces.append(mine)
    rounds = max(len(p) for p in pieces)
    if rounds == 1:  # the step as it is, in one call
        decode = bounds[-1] == len(bounds) - 1  # one token a sequence
        core = rule(qkv, g, beta, weight, conv, ssm, cu_seqlens, heads, decode)
        _copy_snapshots(pieces, 0, conv, ssm, pools)
        return core
    core = qkv.new_empty(qkv.shape[0], heads.v, heads.dv)
    for r in range(rounds):
        rows = [b for b, p in enumerate(pieces) if len(p) > r and p[r][1] > p[r][0]]
        if rows:
            tokens = torch.cat([torch.arange(*pieces[b][r][:2]) for b in rows]).to(qkv.device)
            lengths = [pieces[b][r][1] - pieces[b][r][0] for b in rows]
            cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32).to(qkv.device)
            index = torch.tensor(rows).to(qkv.device)
            sub_conv, sub_ssm = conv.index_select(0, index), ssm.index_select(0, index)
            core[tokens] = rule(qkv[tokens], g[tokens], beta[tokens], weight, sub_conv, sub_ssm, cu, heads, False)
            conv.index_copy_(0, index, sub_conv)
            ssm.index_copy_(0, index, sub_ssm)
        _copy_snapshots(pieces, r, conv, ssm, pools)
    return core


def _copy_snapshots(pieces: list, r: int, conv: torch.Tensor, ssm: torch.Tensor, pools: tuple) -> None:
    for b, mine in enumerate(pieces):
        for slot in mine[r][2] if len(mine) > r else ():
            pools[0][slot].copy_(conv[b])
            pools[1][slot].copy_(ssm[b])
