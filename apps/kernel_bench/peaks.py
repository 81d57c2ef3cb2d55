"""The device's peaks on random data: device-to-device copy bandwidth and a bf16 matmul's rate.

What the "ceilings" section reports, what a run measures first (``Run``), and what apps/step_stats.py and
apps/bench_phases.py set a step's floor by. It knows nothing of a run.
"""

from __future__ import annotations

import torch

from kernel_bench.harness import DEVICE, DTYPE, free_cuda


def copy_ms(nbytes: int) -> float:
    """Median ms of a device-to-device copy of nbytes (random values)."""
    from triton.testing import do_bench

    src = torch.empty(nbytes // 2, dtype=DTYPE, device=DEVICE).normal_()
    dst = torch.empty_like(src)
    return do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")


def matmul_ms(n: int) -> float:
    """Median ms of a bf16 n x n x n matmul on random values."""
    from triton.testing import do_bench

    a, b = (torch.randn(n, n, dtype=DTYPE, device=DEVICE) for _ in range(2))
    c = torch.empty(n, n, dtype=DTYPE, device=DEVICE)
    return do_bench(lambda: torch.matmul(a, b, out=c), warmup=50, rep=300, return_mode="median")


def measure_ceilings(quick: bool) -> dict:
    """Each ceiling measured twice (the spread is the noise); the faster run is the ceiling."""
    nbytes = (512 << 20) if quick else (2 << 30)  # per buffer
    copy_tbs = [2 * nbytes / (copy_ms(nbytes) * 1e-3) / 1e12 for _ in range(2)]
    free_cuda()
    n = 4096 if quick else 8192
    tflops = [2 * n**3 / (matmul_ms(n) * 1e-3) / 1e12 for _ in range(2)]
    free_cuda()
    return {
        "copy_tbs": max(copy_tbs),
        "copy_tbs_runs": copy_tbs,
        "copy_buffer_bytes": nbytes,
        "matmul_tflops": max(tflops),
        "matmul_tflops_runs": tflops,
        "matmul_n": n,
    }


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes/s (read + written) of a device-to-device copy of ``nbytes``: the faster of two runs."""
    return max(2 * nbytes / (copy_ms(nbytes) * 1e-3) for _ in range(2))
