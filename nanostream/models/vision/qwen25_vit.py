"""Qwen2.5-VL's vision transformer: Qwen3-VL's patch embedding, 2-D rotary and attention (qwen_vit.py), with
RMSNorm blocks, a gated SiLU MLP, no learned position grid, and attention within windows.

    patches [N, C*tp*p*p] -> Conv3d patch embedding (no bias) -> [N, D] -> window order
      -> depth x (RMSNorm -> attention with 2-D rotary, per window or per frame -> RMSNorm -> gated SiLU MLP)
      -> merger: RMSNorm, merge² neighbours concatenated, Linear -> GELU -> Linear -> [N / merge², out]
      -> pixel_values order

The blocks see the patches window by window (models/vision/qwen_vit_grid.py's ``window_grid``): each window of
``spec.window`` x ``spec.window`` merged tokens is one attention segment, except in ``fullatt_block_indexes``
blocks, where each frame is. A window's merge² patches stay together, so the merger runs in window order and
its rows are put back in the image's order at the end. Module and parameter names are transformers' own, so a
checkpoint's ``model.visual.*`` or ``visual.*`` tensors load by name::

    encoder = QwenWindowedEncoder(QwenWindowedSpec.from_config(hf_config.vision_config))
    load_vision_weights(encoder, model_dir)
    out = encoder(inputs["pixel_values"], inputs["image_grid_thw"])  # a VisionOutput without DeepStack features
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from nanostream.layers.norm import RMSNorm
from nanostream.models.vision.qwen_vit import PatchEmbed, VisionAttention, VisionOutput, VisionRotary, encoder_grids
from nanostream.models.vision.qwen_vit_grid import Grid, merged_tokens, window_grid
from nanostream.models.vision.qwen_vit_spec import QwenWindowedSpec

_EPS = 1e-6  # every RMSNorm of the encoder and its merger


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), every projection with a bias."""

    def __init__(self, spec: QwenWindowedSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class WindowedBlock(nn.Module):
    def __init__(self, spec: QwenWindowedSpec) -> None:
        super().__init__()
        self.norm1 = RMSNorm(spec.hidden_size, eps=_EPS)
        self.norm2 = RMSNorm(spec.hidden_size, eps=_EPS)
        self.attn = VisionAttention(spec)
        self.mlp = GatedMLP(spec)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], segments: Sequence[int]):
        x = x + self.attn(self.norm1(x), rotary, segments)
        return x + self.mlp(self.norm2(x))


class RMSPatchMerger(nn.Module):
    """merge² neighbouring patches -> one token of the language model's width: each patch RMS-normalised, then
    concatenated, then Linear -> erf GELU -> Linear (``mlp.0``, ``mlp.2``, as transformers names them)."""

    def __init__(self, spec: QwenWindowedSpec) -> None:
        super().__init__()
        self.width = spec.hidden_size * spec.merge_unit
        self.ln_q = RMSNorm(spec.hidden_size, eps=_EPS)
        out = spec.out_hidden_size
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))  # x: [N, D], each run of merge² rows one block


class QwenWindowedEncoder(nn.Module):
    """The encoder of a Qwen2.5-VL checkpoint; see the module docstring."""

    def __init__(self, spec: QwenWindowedSpec) -> None:
        super().__init__()
        self.spec = spec
        self.patch_embed = PatchEmbed(spec, bias=False)
        self.rotary = VisionRotary(spec)
        self.blocks = nn.ModuleList(WindowedBlock(spec) for _ in range(spec.depth))
        self.merger = RMSPatchMerger(spec)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | Sequence[Grid]) -> VisionOutput:
        """Encode a batch of images: ``pixel_values`` [N, C*tp*p*p] and ``grid_thw`` [n_images, 3] as transformers'
        image processor returns them (N = sum of t*h*w)."""
        grids = encoder_grids(pixel_values, grid_thw, self.spec)
        grid = window_grid(grids, self.spec, device=pixel_values.device)
        x = self.patch_embed(pixel_values)  # [N, D]
        n, unit = x.shape[0], self.spec.merge_unit
        x = x.view(n // unit, unit, -1)[grid.order].view(n, -1)  # window order, merge blocks kept whole
        rotary = self.rotary(grid.rows, grid.cols)  # rows and cols are in window order already
        full = set(self.spec.fullatt_block_indexes)
        for i, block in enumerate(self.blocks):
            x = block(x, rotary, grid.frames if i in full else grid.windows)
        embeds = self.merger(x)[torch.argsort(grid.order)]  # [M, out], back in pixel_values order
        tokens = tuple(merged_tokens(grids, self.spec.spatial_merge_size))
        return VisionOutput(embeds=embeds, deepstack=(), tokens_per_image=tokens)
