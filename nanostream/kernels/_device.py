"""Constants and device facts that more than one kernel's launcher uses."""

from __future__ import annotations

import functools

import torch

LOG2E = 1.4426950408889634  # log2(e): the attention kernels take softmax scale * LOG2E and work in base 2


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``: the split heuristics size their grids from it.

    Off CUDA (Triton's interpreter, the CPU tests) any value gives correct results; it only decides which
    split counts the tests exercise. 132 is an H200's count, the GPU this project is measured on, so
    the interpreter picks the split counts that GPU picks at the same shapes. At the CPU tests' shapes
    the decode kernel then runs 1, 2, 4, 11 and 64 splits: 11 fills only part of the merge kernel's
    power-of-two tile (its masked lanes) and 64 is the split cap. The values the two launchers used
    before (16 and 4) gave only powers of two (1, 2, 4 and 16; 1, 2 and 4) and never reached the cap;
    the price is ~0.8 s on the kernel test files (8.9 s against 8.1 s with 16 and 7.8 s with 4, on a
    2-core VM). The sampling kernel splits a row only beyond 8 tiles of 1,024 tokens, so at the tests'
    vocabularies it runs one split per row for any value here; its tests pass ``num_splits`` to cover
    the split path.
    """
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count
