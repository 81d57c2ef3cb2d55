"""The Qwen vision transformer (Qwen3-VL's, Qwen3.5/3.6's): patches of ``pixel_values`` in, one embedding of the
language model's width per ``merge``² patches out, and for Qwen3-VL the DeepStack features of chosen blocks.

    patches [N, C*tp*p*p] -> Conv3d patch embedding + bilinearly resampled learned position grid -> [N, D]
      -> depth x (LayerNorm -> attention with 2-D rotary, per frame -> LayerNorm -> GELU MLP), residual
      -> merger: LayerNorm, merge² neighbours concatenated, Linear -> GELU -> Linear -> [N / merge², out]

Module and parameter names are transformers' own, so a checkpoint's ``model.visual.*`` tensors load by name
(models/vision/weights.py). Images are prepared by transformers' image processor, never here::

    encoder = QwenVisionEncoder(QwenVisionSpec.from_config(hf_config.vision_config))
    load_vision_weights(encoder, model_dir)
    out = encoder(inputs["pixel_values"], inputs["image_grid_thw"])
    per_image = out.split(inputs["image_grid_thw"])  # one [tokens_i, out_hidden_size] per image
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from nanostream.models.vision.qwen_vit_grid import Grid, VisionGrid, check_grids, merged_tokens, vision_grid
from nanostream.models.vision.qwen_vit_spec import QwenVisionSpec, QwenViTSizes

_EPS = 1e-6  # every LayerNorm of the encoder and its mergers


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class VisionRotary(nn.Module):
    """The 2-D rotary embedding: a head's first quarter of frequencies turns with the patch's row, the second
    with its column, and the [row | col] angles are repeated over both halves that rotate_half pairs."""

    def __init__(self, spec: QwenViTSizes) -> None:
        super().__init__()
        half = spec.head_dim // 2
        inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [head_dim / 4]

    def forward(self, rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, [N, head_dim] float32 each."""
        angles = torch.cat([rows[:, None].float() * self.inv_freq, cols[:, None].float() * self.inv_freq], dim=-1)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention within each segment (a frame, or a window of one), fused qkv with bias."""

    def __init__(self, spec: QwenViTSizes) -> None:
        super().__init__()
        self.num_heads, self.head_dim = spec.num_heads, spec.head_dim
        self.qkv = nn.Linear(spec.hidden_size, 3 * spec.hidden_size)
        self.proj = nn.Linear(spec.hidden_size, spec.hidden_size)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], segments: Sequence[int]):
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)  # [N, H, Dh] each
        cos, sin = (t[:, None, :] for t in rotary)  # [N, 1, Dh]
        # rotate in float32 whatever the weights' dtype, as the checkpoints were trained
        qf, kf = q.float(), k.float()
        q = (qf * cos + _rotate_half(qf) * sin).to(x.dtype)
        k = (kf * cos + _rotate_half(kf) * sin).to(x.dtype)
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, H, N, Dh]
        # one SDPA per segment: the segments are short (a few thousand patches) and unequal, and a block-diagonal
        # mask over the whole batch would cost N² memory
        outs = [
            F.scaled_dot_product_attention(qs, ks, vs, scale=self.head_dim**-0.5)
            for qs, ks, vs in zip(*(t.split(list(segments), dim=2) for t in (q, k, v)))
        ]
        out = torch.cat(outs, dim=2).transpose(1, 2).reshape(n, -1)  # [N, H * Dh]
        return self.proj(out)


class VisionMLP(nn.Module):
    def __init__(self, spec: QwenVisionSpec) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(spec.hidden_size, spec.intermediate_size)
        self.linear_fc2 = nn.Linear(spec.intermediate_size, spec.hidden_size)
        self.approximate = spec.gelu_approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class VisionBlock(nn.Module):
    def __init__(self, spec: QwenVisionSpec) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(spec.hidden_size, eps=_EPS)
        self.norm2 = nn.LayerNorm(spec.hidden_size, eps=_EPS)
        self.attn = VisionAttention(spec)
        self.mlp = VisionMLP(spec)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], segments: Sequence[int]):
        x = x + self.attn(self.norm1(x), rotary, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """merge² neighbouring patches -> one token of the language model's width. The final merger normalises each
    patch before concatenating; a DeepStack merger (``after_concat``) normalises the concatenation."""

    def __init__(self, spec: QwenVisionSpec, after_concat: bool = False) -> None:
        super().__init__()
        self.width = spec.hidden_size * spec.merge_unit
        self.after_concat = after_concat
        self.norm = nn.LayerNorm(self.width if after_concat else spec.hidden_size, eps=_EPS)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, spec.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, D] in merge-block order, so each run of merge² rows is one block
        x = self.norm(x.view(-1, self.width)) if self.after_concat else self.norm(x).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))  # erf GELU here, whatever the blocks use


class PatchEmbed(nn.Module):
    """One [C*tp*p*p] row of pixel_values -> [D]; Qwen2.5-VL's convolution has no bias."""

    def __init__(self, spec: QwenViTSizes, bias: bool = True) -> None:
        super().__init__()
        self.shape = (spec.in_channels, spec.temporal_patch_size, spec.patch_size, spec.patch_size)
        kernel = self.shape[1:]
        # a Conv3d whose stride is its kernel is a matmul, but the convolution is what transformers runs: keeping
        # it keeps float32 outputs equal to the bit
        self.proj = nn.Conv3d(spec.in_channels, spec.hidden_size, kernel_size=kernel, stride=kernel, bias=bias)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        pixels = pixels.to(self.proj.weight.dtype).view(-1, *self.shape)
        return self.proj(pixels).flatten(1)  # [N, D]


def encoder_grids(pixels: torch.Tensor, grid_thw: torch.Tensor | Sequence[Grid], spec: QwenViTSizes) -> list[Grid]:
    """``grid_thw`` as (t, h, w) triples; ValueError where ``pixels`` (pixel_values, [N, C*tp*p*p]) do not match."""
    grids = check_grids(grid_thw.tolist() if torch.is_tensor(grid_thw) else grid_thw, spec.spatial_merge_size)
    if pixels.dim() != 2 or pixels.shape[1] != spec.patch_pixels:
        raise ValueError(
            f"pixel_values has shape {tuple(pixels.shape)}; the encoder takes [patches, "
            f"{spec.patch_pixels}] as the model's own image processor returns it"
        )
    patches = sum(t * h * w for t, h, w in grids)
    if patches != pixels.shape[0]:
        raise ValueError(
            f"pixel_values has {pixels.shape[0]} patches but image_grid_thw {grids} describes "
            f"{patches}; pass both from one call of the image processor"
        )
    return grids


@dataclasses.dataclass(frozen=True)
class VisionOutput:
    """``embeds``: [M, out_hidden_size], the images' tokens back to back (M = sum of t*h*w / merge²), to replace
    the prompt's image placeholder tokens in order. ``deepstack``: one [M, out_hidden_size] per DeepStack block
    (Qwen3-VL adds the i-th to the language model's hidden states after its i-th layer); empty for Qwen3.5 and
    Qwen2.5-VL."""

    embeds: torch.Tensor
    deepstack: tuple[torch.Tensor, ...]
    tokens_per_image: tuple[int, ...]

    def split(self) -> list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]]:
        """(embeds, deepstack features) of each image, in order: what an encoder cache keeps per image."""
        sizes = list(self.tokens_per_image)
        per_level = [f.split(sizes) for f in self.deepstack]
        return [(e, tuple(level[i] for level in per_level)) for i, e in enumerate(self.embeds.split(sizes))]


class QwenVisionEncoder(nn.Module):
    """The encoder of a Qwen3-VL or Qwen3.5/3.6 checkpoint; see the module docstring."""

    def __init__(self, spec: QwenVisionSpec) -> None:
        super().__init__()
        self.spec = spec
        self.patch_embed = PatchEmbed(spec)
        self.pos_embed = nn.Embedding(spec.num_position_embeddings, spec.hidden_size)
        self.rotary = VisionRotary(spec)
        self.blocks = nn.ModuleList(VisionBlock(spec) for _ in range(spec.depth))
        self.merger = PatchMerger(spec)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(spec, after_concat=True) for _ in spec.deepstack_visual_indexes
        )

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | Sequence[Grid]) -> VisionOutput:
        """Encode a batch of images: ``pixel_values`` [N, C*tp*p*p] and ``grid_thw`` [n_images, 3] as transformers'
        image processor returns them (N = sum of t*h*w)."""
        grids = encoder_grids(pixel_values, grid_thw, self.spec)
        grid = vision_grid(grids, self.spec, device=pixel_values.device)
        x = self.patch_embed(pixel_values)
        x = x + self._positions(grid).to(x.dtype)
        rotary = self.rotary(grid.rows, grid.cols)
        levels = dict(zip(self.spec.deepstack_visual_indexes, self.deepstack_merger_list))
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, rotary, grid.segments)
            if i in levels:
                deepstack.append(levels[i](x))
        tokens = tuple(merged_tokens(grids, self.spec.spatial_merge_size))
        return VisionOutput(embeds=self.merger(x), deepstack=tuple(deepstack), tokens_per_image=tokens)

    def _positions(self, grid: VisionGrid) -> torch.Tensor:
        """The learned position grid resampled bilinearly to each patch: [N, D]."""
        return (self.pos_embed(grid.taps) * grid.weights[:, :, None]).sum(1)
