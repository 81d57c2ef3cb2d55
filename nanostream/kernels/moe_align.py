"""The fused MoE's first step (kernels/fused_moe.py): the T*K (token, expert) pairs sorted by expert, each
expert's run padded to a multiple of BLOCK_M (a pad entry holds T*K, a pair that does not exist), and each
block's expert.

No host sync: up to ``ALIGN_KERNEL_PAIRS`` pairs (decode) one Triton program, beyond it torch ops on the device.
The buffers have a static length (T*K pairs plus at most BLOCK_M - 1 pads for each of the min(E, T*K) experts
that can have pairs), so a CUDA graph captures it at a fixed T, and the GEMMs' programs past the padded end
return at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ALIGN_KERNEL_PAIRS = 4096
"""Up to this many (token, expert) pairs the alignment is one Triton program (decode: a launch where the torch
ops take a dozen); beyond it (prefill) the torch ops."""


@triton.jit
def _align_kernel(
    ids_ptr, sorted_ptr, block_experts_ptr, num_padded_ptr, scratch_ptr, num_pairs, num_experts, length,
    BLOCK_M: tl.constexpr, PAIRS: tl.constexpr, BINS: tl.constexpr, RUN_BLOCKS: tl.constexpr,
):  # fmt: skip
    # One program: counts per expert -> padded runs -> each pair's slot, taken from its expert's cursor with an
    # atomic add. The order of the pairs within a run is the atomics', but no row's result depends on it (a
    # row's products and sums are its own), so the output is the same whatever it is.
    offs = tl.arange(0, PAIRS)
    valid = offs < num_pairs
    ids = tl.load(ids_ptr + offs, mask=valid, other=0).to(tl.int32)
    ids = tl.where(valid, ids, BINS - 1)  # past every expert (BINS >= 2 E): counted in a bin nobody reads
    bins = tl.arange(0, BINS)
    is_expert = bins < num_experts
    counts = tl.histogram(ids, BINS)  # [BINS]
    padded = tl.where(is_expert, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    tl.store(scratch_ptr + bins, starts, mask=is_expert)  # the cursors
    tl.store(scratch_ptr + BINS + bins, starts, mask=is_expert)
    tl.store(scratch_ptr + 2 * BINS + bins, ends, mask=is_expert)
    tl.store(num_padded_ptr, tl.sum(padded, 0))
    for p0 in range(0, length, PAIRS):  # every slot a pad first
        tl.store(sorted_ptr + p0 + offs, num_pairs, mask=p0 + offs < length)
    tl.debug_barrier()  # the cursors and the pads written before any thread takes a slot
    slot = tl.atomic_add(scratch_ptr + ids, 1, mask=valid)
    tl.store(sorted_ptr + slot, offs, mask=valid)
    blocks = tl.arange(0, RUN_BLOCKS)
    for e in range(0, num_experts):  # each run's blocks name its expert (blocks past the last are never read)
        first, last = tl.load(scratch_ptr + BINS + e) // BLOCK_M, tl.load(scratch_ptr + 2 * BINS + e) // BLOCK_M
        for b0 in range(first, last, RUN_BLOCKS):
            tl.store(block_experts_ptr + b0 + blocks, e, mask=b0 + blocks < last)


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, K] -> (sorted_pairs [P] int32: pair indices t*K + k by expert, each expert's run padded to
    a multiple of ``block_m`` with T*K; block_experts [P / block_m] int32; num_padded [1] int32, the padded
    length used). P is a static bound of T, K, E and block_m alone. Within an expert's run the pairs may
    come in any order."""
    num_pairs = topk_ids.numel()
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    length = triton.cdiv(bound, block_m) * block_m
    device = topk_ids.device
    if num_pairs <= ALIGN_KERNEL_PAIRS and topk_ids.is_contiguous():
        sorted_pairs = torch.empty(length, dtype=torch.int32, device=device)
        block_experts = torch.empty(length // block_m, dtype=torch.int32, device=device)
        num_padded = torch.empty(1, dtype=torch.int32, device=device)
        bins = 2 * triton.next_power_of_2(num_experts)
        scratch = torch.empty(3 * bins, dtype=torch.int32, device=device)
        pairs = max(16, triton.next_power_of_2(num_pairs))
        _align_kernel[(1,)](
            topk_ids, sorted_pairs, block_experts, num_padded, scratch, num_pairs, num_experts, length,
            BLOCK_M=block_m, PAIRS=pairs, BINS=bins, RUN_BLOCKS=max(16, triton.next_power_of_2(pairs // block_m)),
            num_warps=8 if pairs >= 2048 else 4,
        )  # fmt: skip
        return sorted_pairs, block_experts, num_padded
    flat = topk_ids.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))  # [E]; not bincount (a host sync)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0, dtype=torch.int32)  # [E]: each expert's padded run ends here
    order = torch.argsort(flat, stable=True)  # [T*K] pairs by expert
    by_expert = flat[order]
    rank = torch.arange(num_pairs, device=device) - (torch.cumsum(counts, 0) - counts)[by_expert]  # within its run
    sorted_pairs = torch.full((length,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, (ends - padded)[by_expert] + rank, order.to(torch.int32))
    block_starts = torch.arange(0, length, block_m, dtype=torch.int32, device=device)
    # A block past the last run gets expert E (clamped: its program returns before reading it).
    block_experts = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_pairs, block_experts, ends[-1:]
