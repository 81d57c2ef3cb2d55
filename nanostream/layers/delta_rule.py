"""Gated DeltaNet's math as pure functions, the CPU torch reference (the layer, its weights and its states:
layers/gated_deltanet.py), and the shape of a layer (``GatedDeltaNetSpec``).

Per token t and value head h, a state S [Dk, Dv] carried from the sequence's earlier tokens:

    S   = exp(g_t) * S                                # decay: g_t = -exp(A_log) * softplus(a_t + dt_bias) <= 0
    S   = S + k_t (beta_t * (v_t - S^T k_t))^T        # delta rule: S's readout at k_t moves towards v_t
    o_t = S^T q_t                                     # beta_t = sigmoid(b_t); q_t, k_t L2-normalised

q_t is also scaled by 1 / sqrt(Dk), and value head h reads key head h // (Hv / Hk) (q and k repeated as in GQA).
q, k and v come out of one depthwise causal conv1d (kernel K, then SiLU) over their concatenated channels
[q (Hk*Dk), k (Hk*Dk), v (Hv*Dv)]; o goes through a gated RMSNorm per head (norm(o) * weight * silu(z)) and out_proj.

A sequence's state between steps (zeros for a fresh one): the conv state [C, K-1], its last K-1 conv inputs
(C = 2*Hk*Dk + Hv*Dv; transformers' cache keeps K, the oldest never read), and the recurrent state
[Hv, Dk, Dv] in float32. Dtypes follow transformers: activations stay in the module's dtype, the delta rule
runs in float32 (its output cast back), the decay g is float32 throughout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanostream.layers.norm import rms_norm


@dataclass(frozen=True)
class GatedDeltaNetSpec:
    """A Gated DeltaNet layer's sizes, read from a config's ``linear_*`` keys (models/layer_kinds.py)."""

    hidden_size: int
    num_k_heads: int  # linear_num_key_heads: q and k heads
    num_v_heads: int  # linear_num_value_heads: a multiple of num_k_heads
    head_k_dim: int  # linear_key_head_dim
    head_v_dim: int  # linear_value_head_dim
    conv_kernel: int  # linear_conv_kernel_dim
    rms_norm_eps: float
    fused_projections: bool
    """The checkpoints' input projections: ``in_proj_qkvz`` (its rows grouped per key head i: [q_i, k_i, v_i, z_i],
    v_i and z_i that head's r = Hv / Hk value heads) and ``in_proj_ba`` ([b_i (r), a_i (r)] per key head), as
    Qwen3-Next's; else ``in_proj_qkv`` (the conv's channel order), ``in_proj_z``, ``in_proj_b``, ``in_proj_a``,
    as Qwen3.5's."""

    def __post_init__(self) -> None:
        sizes = ("hidden_size", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_kernel")
        small = [name for name in sizes if getattr(self, name) < 1]
        if small:
            raise ValueError(f"GatedDeltaNetSpec: {', '.join(small)} must be at least 1")
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"num_v_heads ({self.num_v_heads}) must be a multiple of num_k_heads ({self.num_k_heads})")

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def v_per_k(self) -> int:
        """r: the value heads that read one key head."""
        return self.num_v_heads // self.num_k_heads

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        """A sequence's conv state: [C, K-1], the model's dtype."""
        return (self.conv_channels, self.conv_kernel - 1)

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        """A sequence's recurrent state: [Hv, Dk, Dv], float32."""
        return (self.num_v_heads, self.head_k_dim, self.head_v_dim)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (FLA's form, which transformers copies: eps inside the root)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, silu: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's depthwise causal conv1d and SiLU (``silu=False``: none, the short convolution's), continuing
    from ``conv_state``.

    x: [L, C] (L >= 1); weight: [C, K] (``conv1d.weight[:, 0]``); conv_state: [C, K-1], the inputs before x (zeros for a
    fresh sequence). Returns (y [L, C] in x's dtype, the new state [C, K-1] in weight's dtype); conv_state is
    not modified. Computed in weight's dtype, as transformers does.
    """
    k = weight.shape[1]
    window = torch.cat([conv_state.t().to(weight.dtype), x.to(weight.dtype)])  # [K-1+L, C]
    # y[t, c] = sum_j window[t + j, c] * weight[c, j]: as a product and a sum over each token's K inputs, not
    # F.conv1d, whose grouped CPU kernel took ~20 ms for a few tokens (500x this) on some inputs
    # (summed in float32 and rounded once, as the convolution's kernels accumulate a bfloat16 one)
    y = (window.float().unfold(0, k, 1) * weight.float()).sum(-1).to(weight.dtype)  # [L, C, K] -> [L, C]
    return (F.silu(y) if silu else y).to(x.dtype), window[window.shape[0] - (k - 1) :].t()


def gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's gated delta rule, token by token in float32 (the reference; vectorised over heads).

    q, k: [L, Hv, Dk], the conv's output with key heads already repeated to value heads; this function
    L2-normalises them and scales q by 1 / sqrt(Dk) (in float32, as FLA's ``use_qk_l2norm_in_kernel``).
    v: [L, Hv, Dv]; g: [L, Hv] log decay (<= 0); beta: [L, Hv]; state: [Hv, Dk, Dv] (not modified).
    Returns (out [L, Hv, Dv] in q's dtype, the new state [Hv, Dk, Dv] float32).
    """
    out_dtype = q.dtype
    q = l2_normalize(q.float()) * q.shape[-1] ** -0.5
    k = l2_normalize(k.float())
    v, beta, decay = v.float(), beta.float(), g.float().exp()
    s = state.float().clone()  # [Hv, Dk, Dv]
    out = torch.empty_like(v)  # [L, Hv, Dv]
    for t in range(q.shape[0]):
        s = s * decay[t, :, None, None]
        recalled = torch.einsum("hk,hkv->hv", k[t], s)  # what s already holds at k_t
        s = s + torch.einsum("hk,hv->hkv", k[t], beta[t, :, None] * (v[t] - recalled))
        out[t] = torch.einsum("hk,hkv->hv", q[t], s)
    return out.to(out_dtype), s


class GatedRMSNorm(nn.Module):
    """norm(x) * weight * silu(z) over the last dim (a head's Dv), rounded as transformers' RMSNormGated: the
    normalised x cast to x's dtype before the weight, the gate's SiLU in float32, the product cast back. Its weight
    is plain (no 1 + w, whatever the model's other norms do)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return (rms_norm(x, self.weight, self.eps) * F.silu(z.float())).to(x.dtype)
