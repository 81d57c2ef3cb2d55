"""The one-token FP8 GEMV's tiles (kernels/fp8_gemv.py): which launches it takes, and how it splits a weight.

A program streams a ``block_n`` x (``groups`` x 128) slab of the weight a step; ``gemv_config`` picks the tile, the
pipeline and the split of K for a weight's shape and the GPU's SMs, from the sweeps of apps/fp8_gemm_sweep.py --gemv.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from ._device import num_sms

MAX_ROWS = 4  # up to these many tokens the weight-streaming kernel runs (its rows unrolled)
GROUP = 128  # the columns a step's scale covers (block-wise checkpoints' 128); per-row weights use it as the tile


class GemvConfig(NamedTuple):
    """A program's columns, its step's groups of 128 columns (``groups``), warps, pipeline stages and the
    split of K (``split_k`` programs share a tile's K, their float32 partials summed by a second kernel)."""

    block_n: int
    groups: int
    num_warps: int
    num_stages: int
    split_k: int = 1


MIN_STEPS_PER_SPLIT = 4
WIDE_TILES_PER_SM = 4
GEMV_ROWS = 1
"""Tokens up to which layers/fp8_linear.py takes this kernel: on an H200 at Qwen3-8B's four projections it runs
one token in about 0.85x the time of the activation quantizer and the block kernel (apps/fp8_gemm_sweep.py
--gemv), four in 1.3x at its best tiles (the CUDA cores' work grows with the rows, the tensor cores' does not)."""


def gemv_config(n: int, k: int, sms: int) -> GemvConfig:
    """The tile and split for an [``n``, ``k``] weight on a GPU of ``sms`` SMs: 32 columns a program, steps of
    512 columns, 4 stages; K splits only where the tiles leave half the SMs idle (a narrow layer), until each SM
    has one, each split at least 4 steps (``apps/fp8_gemm_sweep.py --gemv`` at one token: within 3% of the best at
    each of Qwen3-8B's projections on an H200; splitting a weight of 128 tiles or more only adds partials). A
    wide layer, of 4 tiles an SM or more, takes 64 rows and steps of 256 columns in 3 stages: Qwen3-8B's
    gate_up_proj in 25.9 us against 28.1 on an H200 (a CUDA graph of 12 weights in turn). Unsplit, a layer
    whose last wave of 32-row tiles leaves SMs idle that 16-row tiles would fill (a tenth of them or more)
    takes those, in 3 stages: Qwen3-8B's qkv_proj, 192 tiles for 132 SMs, in 10.24 us against 10.77 on an
    H200 (before the lanes' own sums) and 11.08 against 11.50 on an H100.

    >>> gemv_config(4096, 12288, 132)  # Qwen3-8B's down_proj on an H200: 128 tiles, one split
    GemvConfig(block_n=32, groups=4, num_warps=4, num_stages=4, split_k=1)
    >>> gemv_config(6144, 4096, 132)  # its qkv_proj: 192 tiles of 32 (a last wave of 60), 384 of 16 (120)
    GemvConfig(block_n=16, groups=4, num_warps=4, num_stages=3, split_k=1)
    >>> gemv_config(1024, 3072, 132).split_k  # Qwen3-0.6B's o_proj: 32 tiles, K in 6 steps: one split
    1
    """
    block_n, groups = 32, 4
    tiles = triton.cdiv(n, block_n)
    if tiles >= WIDE_TILES_PER_SM * sms:  # a wide layer (gate_up_proj): fewer, taller programs
        return GemvConfig(64, 2, 4, 3)
    steps = triton.cdiv(k, groups * GROUP)
    splits = 1
    if 2 * tiles < sms:
        splits = max(1, min(triton.cdiv(sms, tiles), steps // MIN_STEPS_PER_SPLIT))
    if splits == 1 and _waves_filled(triton.cdiv(n, 16), sms) >= _waves_filled(tiles, sms) + 0.1:
        return GemvConfig(16, groups, 4, 3)
    return GemvConfig(block_n, groups, 4, 4, splits)


def _waves_filled(programs: int, sms: int) -> float:
    """The share of ``sms`` x waves that ``programs`` fill (1.0: the last wave is whole)."""
    return programs / (triton.cdiv(programs, sms) * sms)


def gemv_takes(m: int, block: tuple[int, int], k: int, block_n: int = 32) -> bool:
    """Whether the weight-streaming kernel runs ``m`` tokens of a weight scaled in ``block``: at most MAX_ROWS
    tokens, and scales one a row (one group along K) or in blocks of GROUP columns whose rows a tile divides
    (``block_n``; a fused [gate | up]'s tile holds half as many of each)."""
    block_rows, block_cols = block
    return 1 <= m <= MAX_ROWS and (block_cols >= k or (block_cols == GROUP and block_rows % block_n == 0))


def whole_tiles(n: int, k: int, cfg: GemvConfig) -> bool:
    """Whether an [``n``, ``k``] weight is whole tiles and whole steps of ``cfg`` (a split takes whole steps): the
    kernel's loads then need no mask (Triton 3.6's sm90 loop at Qwen3-8B's 32 x 512 tile: ~12% fewer instructions a
    step; a batch-1 chain of 36 layers, ``apps/fp8_gemm_sweep.py --layers``, about 1% faster on an H100)."""
    return n % cfg.block_n == 0 and k % (cfg.groups * GROUP) == 0


def norm_fuses(n: int, k: int, device: torch.device) -> bool:
    """Whether the one-token GEMV of an [``n``, ``k``] weight can end in the residual add and norm after it
    (``fp8_gemv_add_norm``): where its K is not split (the sum kernel would have to)."""
    return gemv_config(n, k, num_sms(device)).split_k == 1


def launch_config(x: torch.Tensor, n: int, block: tuple[int, int], config, act: str | None) -> tuple[GemvConfig, bool]:
    """The launch's config (``config``, else ``gemv_config``'s) and whether the activation is its epilogue."""
    m, k = x.shape
    cfg = GemvConfig(*config) if config else gemv_config(n, k, num_sms(x.device))
    gated = act is not None and cfg.split_k == 1
    if not config and not gemv_takes(m, block, k, cfg.block_n // 2 if gated else cfg.block_n):
        cfg = cfg._replace(block_n=32)  # a wide layer's tile of 64 rows in blocks of 32 or 96: a tile of 32
    return cfg, gated
