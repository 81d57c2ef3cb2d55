"""What the Qwen ViTs derive from the images' grids alone, before any weight is touched: where each patch sits
(its row and column, for the 2-D rotary embedding), which taps of the learned position grid it blends and with
what weights, where each frame's attention segment starts, and for Qwen2.5-VL's windowed encoder the order of
the patches window by window and each window's length.

Patches arrive in ``pixel_values`` in merge-block order, as transformers' image processor lays them out: frame by
frame, then block row, block column, row within the block, column within the block (a block being the
``merge`` x ``merge`` patches that become one language-model token). Every table here follows that order::

    grid = vision_grid([(1, 6, 8), (1, 4, 4)], spec)  # grid.rows, grid.cols: [64]; grid.segments: [48, 16]
    windows = window_grid([(1, 6, 8)], windowed_spec)  # windowed_spec.window = 2: 2 x 2 windows of 12, 12, 12, 12
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from nanostream.models.vision.qwen_vit_spec import QwenVisionSpec, QwenWindowedSpec

Grid = tuple[int, int, int]
"""An image's (or video's) patch grid: (frames t, rows h, columns w), as ``image_grid_thw`` gives it."""


@dataclasses.dataclass(frozen=True)
class VisionGrid:
    """Per-patch tables of a batch of images, all [N] or [N, 4] for N patches in ``pixel_values`` order."""

    rows: torch.Tensor  # [N] long, the patch's row in its image
    cols: torch.Tensor  # [N] long
    taps: torch.Tensor  # [N, 4] long, indices into the flattened side x side position grid
    weights: torch.Tensor  # [N, 4] float32, bilinear weights of those taps
    segments: tuple[int, ...]  # patches per attention segment (one per frame), in order


def check_grids(grids: Sequence[Grid], merge: int) -> list[Grid]:
    """``grids`` as a list of int triples; ValueError when one is not a positive grid that merge blocks tile."""
    out = []
    for grid in grids:
        t, h, w = (int(v) for v in grid)
        if min(t, h, w) < 1 or h % merge or w % merge:
            raise ValueError(
                f"image grid (t, h, w) = {(t, h, w)} must be positive with h and w multiples of the spatial merge "
                f"size {merge}; pass image_grid_thw as transformers' image processor returns it"
            )
        out.append((t, h, w))
    return out


def merge_block_order(h: int, w: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of each of a frame's h x w patches, in merge-block order; [h * w] each."""
    rows = torch.arange(h).view(h, 1).expand(h, w)
    cols = torch.arange(w).view(1, w).expand(h, w)

    def blocked(x: torch.Tensor) -> torch.Tensor:  # [h, w] -> [h/m, w/m, m, m] -> flat
        return x.reshape(h // merge, merge, w // merge, merge).permute(0, 2, 1, 3).flatten()

    return blocked(rows), blocked(cols)


def _axis_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two taps (floor, floor + 1, clamped) of the side-long learned axis that position ``index`` of a
    size-long axis reads, and their weights. Corners align (position 0 -> tap 0, size - 1 -> side - 1), as
    F.interpolate(mode="bilinear", align_corners=True). Each float32 op is the one transformers takes, so the
    weights are equal to the bit."""
    src = index.float() * (side - 1) / max(size - 1, 1)
    floor = src.floor()
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights  # [n, 2] each


def vision_grid(grids: Sequence[Grid], spec: QwenVisionSpec, device: torch.device | None = None) -> VisionGrid:
    """The tables of ``grids`` (one (t, h, w) per image, in ``pixel_values`` order), on ``device``."""
    side, merge = spec.grid_side, spec.spatial_merge_size
    rows, cols, taps, weights, segments = [], [], [], [], []
    for t, h, w in check_grids(grids, merge):
        r, c = merge_block_order(h, w, merge)
        h_taps, h_weights = _axis_taps(r, h, side)
        w_taps, w_weights = _axis_taps(c, w, side)
        # 2-D bilinear = outer product of the axes: taps (top-left, top-right, bottom-left, bottom-right)
        frame_taps = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
        frame_weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
        rows.append(r.repeat(t))
        cols.append(c.repeat(t))
        taps.append(frame_taps.repeat(t, 1))
        weights.append(frame_weights.repeat(t, 1))
        segments += [h * w] * t  # each frame attends within itself
    return VisionGrid(
        rows=torch.cat(rows).to(device),
        cols=torch.cat(cols).to(device),
        taps=torch.cat(taps).to(device),
        weights=torch.cat(weights).to(device),
        segments=tuple(segments),
    )


def merged_tokens(grids: Sequence[Grid], merge: int) -> list[int]:
    """Language-model tokens of each image: t * h * w / merge²."""
    return [t * h * w // merge**2 for t, h, w in check_grids(grids, merge)]


@dataclasses.dataclass(frozen=True)
class WindowGrid:
    """Per-patch tables of a batch of images for the windowed encoder, in window order: frame by frame, window
    row, window column, then the window's merged tokens row by row (each merge² patches in merge-block order)."""

    order: torch.Tensor  # [N / merge²] long, the merged token (in pixel_values order) at each place of window order
    rows: torch.Tensor  # [N] long, the row of each patch, in window order
    cols: torch.Tensor  # [N] long
    windows: tuple[int, ...]  # patches per window, in order (windows are cut at the frame's edge, never empty)
    frames: tuple[int, ...]  # patches per frame, in order (the full-attention blocks' segments)


def _frame_windows(gh: int, gw: int, side: int) -> tuple[torch.Tensor, list[int]]:
    """The merged tokens of a gh x gw frame (row-major indices) in window order, and each window's token count."""
    i = torch.arange(gh).view(gh, 1).expand(gh, gw)
    j = torch.arange(gw).view(1, gw).expand(gh, gw)
    across = -(-gw // side)  # windows a row
    window = (i // side) * across + j // side  # [gh, gw], the window each token falls in
    # a key unique to each token that sorts by window, then row and column inside it
    key = window * side * side + (i % side) * side + j % side
    return key.flatten().argsort(), torch.bincount(window.flatten()).tolist()


def window_grid(grids: Sequence[Grid], spec: QwenWindowedSpec, device: torch.device | None = None) -> WindowGrid:
    """The window tables of ``grids`` (one (t, h, w) per image, in ``pixel_values`` order), on ``device``."""
    merge, unit = spec.spatial_merge_size, spec.merge_unit
    order, rows, cols, windows, frames = [], [], [], [], []
    offset = 0  # merged tokens before this frame
    for t, h, w in check_grids(grids, merge):
        tokens, counts = _frame_windows(h // merge, w // merge, spec.window)
        r, c = merge_block_order(h, w, merge)
        patches = tokens[:, None] * unit + torch.arange(unit)  # [h*w/unit, unit], the frame's patches in order
        for _ in range(t):
            order.append(tokens + offset)
            rows.append(r[patches.flatten()])
            cols.append(c[patches.flatten()])
            windows += [n * unit for n in counts]
            frames.append(h * w)
            offset += h * w // unit
    return WindowGrid(
        order=torch.cat(order).to(device),
        rows=torch.cat(rows).to(device),
        cols=torch.cat(cols).to(device),
        windows=tuple(windows),
        frames=tuple(frames),
    )
