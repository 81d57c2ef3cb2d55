"""DeepSeek's router (``MoESpec.router == "grouped_topk"``): DeepSeek-V3's, GLM-4.5's, MiniMax-M2's.

Each expert gets a score from its logit, a sigmoid (or a softmax over the experts: ``MoESpec.scoring``), in
float32. The experts are chosen on the scores plus a learned ``e_score_correction_bias`` (``correction_bias``;
the bias balances the experts' load and steers the choice only), limited to groups: the experts split into
``groups`` equal groups, each ranked by the sum of its two best biased scores, and the top k are taken among the
experts of the ``topk_groups`` best groups. A chosen expert's weight is its unbiased score, divided by the k
weights' sum (``renormalize``; plus 1e-20, as DeepSeek's), times ``scaling`` (``routed_scaling_factor``):

    weights, ids = GroupedTopKRouter(hidden_size, spec)(x)   # [T, K] float32, [T, K] int64

The router GEMM runs in float32 on a float32 weight where ``float32_router`` (transformers keeps DeepSeek-V3's and
GLM-4.5's gate and bias in float32 whatever the model's dtype), else in the model's dtype with the scores taken in
float32 (MiniMax-M2's, whose bias is then in the model's dtype too, as transformers holds it). The choice is
``torch.topk`` on the same float32 values as transformers' (unsorted, in its order), so ties go the same way.
With tensor parallelism the router is whole on every rank, its bias too, and every rank picks the same experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanostream.layers.linear import Gemm, TensorSlice
from nanostream.layers.moe_spec import MoESpec


class GroupedTopKRouter(nn.Module):
    """Gate linear -> scores -> biased, group-limited top k -> the unbiased scores of the chosen experts,
    renormalised and scaled: (weights [T, K] float32, expert ids [T, K] int64)."""

    def __init__(self, hidden_size: int, spec: MoESpec, gemm: Gemm = F.linear) -> None:
        super().__init__()
        dtype = torch.float32 if spec.float32_router else None  # None: the default dtype, the model's
        self.gemm, self.float32 = gemm, spec.float32_router
        self.weight = nn.Parameter(torch.empty(spec.num_experts, hidden_size, dtype=dtype))
        self.e_score_correction_bias = None
        if spec.correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(spec.num_experts, dtype=dtype))
        self.top_k, self.groups, self.topk_groups = spec.top_k, spec.groups, spec.topk_groups
        self.sigmoid, self.renormalize, self.scaling = spec.scoring == "sigmoid", spec.renormalize, spec.scaling

    def load_weight(self, param: nn.Parameter, loaded: TensorSlice) -> None:
        """A checkpoint tensor into ``param``; a correction bias stored as [1, E] (ERNIE 4.5's) taken as [E]."""
        value = loaded[:]
        if param is self.e_score_correction_bias and value.dim() == 2 and value.shape[0] == 1:
            value = value[0]
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"a router tensor of shape {tuple(value.shape)}, expected {tuple(param.shape)}")
        param.data.copy_(value)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [T, H] -> weights [T, K] float32, ids [T, K] int64
        logits = self.gemm(x.float(), self.weight) if self.float32 else self.gemm(x, self.weight)  # [T, E]
        scores = logits.float().sigmoid() if self.sigmoid else torch.softmax(logits.float(), dim=-1)  # [T, E] float32
        ids = grouped_topk(scores, self.e_score_correction_bias, self.top_k, self.groups, self.topk_groups)
        weights = scores.gather(1, ids)  # the chosen experts' unbiased scores
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if self.scaling != 1.0:
            weights = weights * self.scaling
        return weights, ids


def grouped_topk(
    scores: torch.Tensor, bias: torch.Tensor | None, top_k: int, groups: int = 1, topk_groups: int = 1
) -> torch.Tensor:
    """The ``top_k`` experts of each row of ``scores`` [T, E] (float32) plus ``bias`` [E], among the experts of the
    ``topk_groups`` groups (of ``groups`` equal ones) whose two best biased scores sum highest: ids [T, K] int64,
    in ``torch.topk``'s unsorted order."""
    choice = scores if bias is None else scores + bias  # [T, E] float32
    if groups > 1:
        per_group = choice.unflatten(-1, (groups, -1))  # [T, G, E/G]
        group_scores = per_group.topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        best = group_scores.topk(topk_groups, dim=-1, sorted=False)[1]  # [T, topk_groups]
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # [T, G]
        choice = choice.masked_fill(~kept.repeat_interleave(per_group.shape[-1], dim=-1), float("-inf"))
    return torch.topk(choice, top_k, dim=-1, sorted=False)[1]
