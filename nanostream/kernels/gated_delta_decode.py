"""A Gated DeltaNet decode step (one token a sequence) in two Triton kernels that read and write the state pool in
place, at each sequence's slot: no gather into a batch and no scatter back (the recurrent state is the step's
largest read, 2 MiB a sequence a layer at Qwen3.5-9B's shape), and the slots are a device tensor, so a CUDA graph
captures the step with them as an input. A slot < 0 is a padding row: nothing is read or written for it.

- ``conv_decode``: the depthwise causal conv1d over the state's K-1 inputs and the token's, SiLU (or none: LFM2's
  short convolution, layers/short_conv.py), the state shifted by one; summed in float32, rounded to the weight's
  dtype (the reference's rounding).
- ``delta_rule_decode``: q and k L2-normalised (q scaled by 1/sqrt(Dk)), then per value head
  S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q  — in float32, as layers/delta_rule.py.

    core = decode_step(qkv, g, beta, weight, conv_pool, ssm_pool, slots, k_heads, dk)  # [B, Hv, Dv]
    # = delta_rule_decode(conv_decode(qkv, weight, conv_pool, slots), g, beta, ssm_pool, slots, k_heads, dk)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_decode_kernel(
    x_ptr, w_ptr, state_ptr, slot_ptr, out_ptr,
    stride_x, stride_o, C, K: tl.constexpr, BLOCK: tl.constexpr, SILU: tl.constexpr,
):  # fmt: skip
    # program (b, channel block): y = silu(sum_j window[j] * w[:, j]), window = [state (K-1 columns), x_b]; SILU=False:
    # the sum alone
    b, cb = tl.program_id(0).to(tl.int64), tl.program_id(1)
    slot = tl.load(slot_ptr + b)
    ch = cb * BLOCK + tl.arange(0, BLOCK)
    mask = ch < tl.where(slot >= 0, C, 0)
    row = state_ptr + tl.maximum(slot, 0) * C * (K - 1) + ch * (K - 1)
    x = tl.load(x_ptr + b * stride_x + ch, mask=mask, other=0.0)
    acc = x.to(tl.float32) * tl.load(w_ptr + ch * K + (K - 1), mask=mask, other=0.0).to(tl.float32)
    prev = tl.load(row, mask=mask, other=0.0)
    for j in tl.static_range(K - 1):
        acc += prev.to(tl.float32) * tl.load(w_ptr + ch * K + j, mask=mask, other=0.0).to(tl.float32)
        if j < K - 2:
            nxt = tl.load(row + j + 1, mask=mask, other=0.0)
            tl.store(row + j, nxt, mask=mask)
            prev = nxt
    tl.store(row + (K - 2), x.to(state_ptr.dtype.element_ty), mask=mask)
    y = acc.to(w_ptr.dtype.element_ty).to(tl.float32)
    if SILU:
        y = y * tl.sigmoid(y)
    tl.store(out_ptr + b * stride_o + ch, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _delta_rule_decode_kernel(
    x_ptr, g_ptr, beta_ptr, state_ptr, slot_ptr, out_ptr,
    stride_x, HV, R, scale, eps,
    HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    # program (b, value head h, BV columns of Dv): the state's [DK, BV] tile, read once and written once
    b, h, vb = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), tl.program_id(2)
    slot = tl.load(slot_ptr + b)
    live = slot >= 0
    kh = h // R
    dk = tl.arange(0, DK)
    dv = vb * BV + tl.arange(0, BV)
    vmask = dv < tl.where(live, DV, 0)
    row = x_ptr + b * stride_x
    kmask = dk < tl.where(live, DK, 0)
    q = tl.load(row + kh * DK + dk, mask=kmask, other=0.0).to(tl.float32)
    k = tl.load(row + HK * DK + kh * DK + dk, mask=kmask, other=0.0).to(tl.float32)
    v = tl.load(row + 2 * HK * DK + h * DV + dv, mask=vmask, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, 0) + eps) * scale
    k = k * tl.rsqrt(tl.sum(k * k, 0) + eps)
    decay = tl.exp(tl.load(g_ptr + b * HV + h).to(tl.float32))  # (padding rows too: g and beta have them)
    beta = tl.load(beta_ptr + b * HV + h).to(tl.float32)
    tile = state_ptr + (tl.maximum(slot, 0) * HV + h) * DK * DV + dk[:, None] * DV + dv[None, :]
    mask = kmask[:, None] & vmask[None, :]
    s = tl.load(tile, mask=mask, other=0.0) * decay  # [DK, BV]
    recalled = tl.sum(s * k[:, None], 0)
    s += k[:, None] * (beta * (v - recalled))[None, :]
    tl.store(tile, s, mask=mask)
    out = tl.sum(s * q[:, None], 0)
    tl.store(out_ptr + (b * HV + h) * DV + dv, out.to(out_ptr.dtype.element_ty), mask=vmask)


def conv_decode(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, slots: torch.Tensor, silu: bool = True
) -> torch.Tensor:
    """x [B, C] (a token a sequence), weight [C, K], state [S, C, K-1] (the pool, advanced in place at rows
    ``slots`` [B] int64; < 0: padding) -> silu(conv) [B, C] in x's dtype (``silu=False``: conv)."""
    batch, channels = x.shape
    kernel = weight.shape[1]
    assert kernel >= 2 and state.shape[1:] == (channels, kernel - 1) and state.is_contiguous(), state.shape
    assert weight.is_contiguous() and x.stride(1) == 1 and slots.shape == (batch,), (weight.stride(), x.stride())
    out = torch.empty_like(x)
    block = 256
    grid = (batch, triton.cdiv(channels, block))
    _conv_decode_kernel[grid](
        x, weight, state, slots, out, x.stride(0), out.stride(0), channels, kernel, block, silu,
    )  # fmt: skip
    return out


def short_conv_decode(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``conv_decode`` without SiLU: LFM2's short convolution (layers/short_conv.py)."""
    return conv_decode(x, weight, state, slots, silu=False)


def delta_rule_decode(
    x: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    k_heads: int,
    head_k_dim: int,
) -> torch.Tensor:
    """x [B, C] the conv's output (q [Hk*Dk], k [Hk*Dk], v [Hv*Dv] channels), g [B, Hv] log decay (float32),
    beta [B, Hv], state [S, Hv, Dk, Dv] float32 (the pool, advanced in place at rows ``slots``; < 0: padding)
    -> o [B, Hv, Dv] in x's dtype. Value head h reads key head h // (Hv / Hk)."""
    batch = x.shape[0]
    _, hv, dk, dv = state.shape
    assert dk == head_k_dim and dk == triton.next_power_of_2(dk), f"head_k_dim {dk}: a power of two"
    assert x.shape[1] == 2 * k_heads * dk + hv * dv and x.stride(1) == 1, (x.shape, k_heads, state.shape)
    assert state.dtype == torch.float32 and state.is_contiguous() and hv % k_heads == 0
    assert g.shape == beta.shape == (batch, hv) and g.is_contiguous() and beta.is_contiguous(), (g.shape, beta.shape)
    out = x.new_empty(batch, hv, dv)
    bv = min(32, triton.next_power_of_2(dv))
    grid = (batch, hv, triton.cdiv(dv, bv))
    _delta_rule_decode_kernel[grid](
        x, g, beta, state, slots, out, x.stride(0), hv, hv // k_heads, dk**-0.5, 1e-6, k_heads, dk, dv, bv,
    )  # fmt: skip
    return out


def decode_step(
    qkv: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    k_heads: int,
    head_k_dim: int,
) -> torch.Tensor:
    """The conv, then the delta rule (layers/delta_rule_fla.py's ``DecodeRule``): [B, Hv, Dv]."""
    x = conv_decode(qkv, weight, conv_state, slots)
    return delta_rule_decode(x, g.contiguous(), beta.contiguous(), ssm_state, slots, k_heads, head_k_dim)
