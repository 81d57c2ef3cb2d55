"""The "ceilings" section: device-to-device copy bandwidth and a bf16 matmul's rate, on random data."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kernel_bench.harness import need_cuda
from kernel_bench.peaks import measure_ceilings

if TYPE_CHECKING:
    from kernel_bench.run import Run


def section_ceilings(run: Run) -> None:
    need_cuda()

    def measure() -> None:
        run.report["ceilings"] = measure_ceilings(run.args.quick)

    run.unit("ceilings", measure)
    c = run.report["ceilings"]
    if c:
        print(f"   copy {c['copy_tbs']:.2f} TB/s, bf16 matmul {c['matmul_n']}^3 {c['matmul_tflops']:.0f} TFLOP/s")
