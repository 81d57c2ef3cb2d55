"""Constants and device facts that more than one kernel's launcher uses."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

try:  # Triton 3.4 and later (the launcher's launch_pdl too)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # older Triton: nothing launches as a dependent
    gdc_launch_dependents = gdc_wait = None

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


@functools.cache
def pdl(device: torch.device) -> bool:
    """Whether kernels on ``device`` may launch as programmatic dependents (CUDA's programmatic dependent launch,
    Hopper and later): such a kernel is launched while the one before it still runs and waits for it in
    ``wait_for_producer``, which takes the launch gap off a chain of small kernels (the batch-1 step's
    norms, attention prologue, attention and activation: BENCHMARKS.md, the FP8 section)."""
    return gdc_wait is not None and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


@functools.cache
def pdl_launch(device: torch.device) -> dict[str, bool]:
    """A small kernel's launch keywords on ``device``: ``PDL`` for its ``wait_for_producer``, and Triton's
    ``launch_pdl`` where it launches as a dependent (absent otherwise: Triton before 3.4 knows no such keyword)."""
    return {"PDL": True, "launch_pdl": True} if pdl(device) else {"PDL": False}


@triton.jit
def wait_for_producer(PDL: tl.constexpr):
    """A programmatic dependent's first step (``PDL``: launched as one): wait until the kernel before it has
    finished and its writes are visible, then let the kernel after it launch. Nothing may be read or written
    before it: the kernel before may still be writing what this one reads, or reading what it writes."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def let_dependents_launch(PDL: tl.constexpr):
    """For a kernel launched in order (``PDL``: its successor may be a dependent): the next kernel may launch
    now and wait for this one in its ``wait_for_producer``."""
    if PDL:
        gdc_launch_dependents()
