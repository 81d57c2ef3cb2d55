"""The Gated DeltaNet decode step against its byte floor (GPU only; CUDA-graph timing), at Qwen3.5-9B's heads
(16 key heads read by 32 value heads of 128, conv kernel 4), one layer, batch 1, 64 and 256, slots scattered in a
pool of 512.

- ours: kernels/gated_delta_decode.py's ``decode_step`` (the conv, then the delta rule, in place at the slots);
- fla: fla-core's ``fused_recurrent_gated_delta_rule`` on the same states, which takes a batch of states, not
  slots: the rows gathered from the pool before and scattered back after (what using it in the engine costs),
  the conv as ours (fla has no slot-indexed conv update).

The floor: the bytes a step must move (each sequence's recurrent state [32, 128, 128] float32 read and written,
its conv state read and written, its qkv, g, beta read and its output written) at the copy bandwidth this script
measures (a 1 GiB device-to-device copy).

    python3 apps/bench_gdn.py
"""

from __future__ import annotations

import sys
from functools import partial

import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, ".")
from nanostream.kernels.gated_delta_decode import conv_decode, decode_step

HK, HV, D, K = 16, 32, 128, 4
C = 2 * HK * D + HV * D
POOL = 512


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench_cudagraph(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3)


def step_bytes(batch: int) -> int:
    state = HV * D * D * 4 + C * (K - 1) * 2  # float32 recurrent state, bf16 conv state
    return batch * (2 * state + C * 2 + HV * 4 + HV * 2 + HV * D * 2)


def main() -> None:
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    conv_pool = torch.randn(POOL, C, K - 1, device=dev, dtype=torch.bfloat16)
    ssm_pool = torch.randn(POOL, HV, D, D, device=dev) * 0.1
    weight = torch.randn(C, K, device=dev, dtype=torch.bfloat16) * 0.5
    rows = [("batch", "ours us", "ours / floor", "fla+gather us", "fla / floor", "floor us")]
    for batch in (1, 64, 256):
        slots = torch.randperm(POOL, device=dev)[:batch]
        qkv = torch.randn(batch, C, device=dev, dtype=torch.bfloat16)
        g = -torch.rand(batch, HV, device=dev) * 0.3
        beta = torch.rand(batch, HV, device=dev, dtype=torch.bfloat16)
        floor_us = step_bytes(batch) / bandwidth * 1e6
        ours = do_bench_cudagraph(partial(decode_step, qkv, g, beta, weight, conv_pool, ssm_pool, slots, HK, D)) * 1e3
        fla_us = fla_step_us(qkv, g, beta, weight, conv_pool, ssm_pool, slots)
        fla_cells = ("-", "-") if fla_us is None else (f"{fla_us:.1f}", f"{floor_us / fla_us:.2f}")
        rows.append((str(batch), f"{ours:.1f}", f"{floor_us / ours:.2f}", *fla_cells, f"{floor_us:.1f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)))
    print("(ours / floor: the share of the copy bandwidth the step reaches; 1.0 is the floor)")


def fla_step_us(qkv, g, beta, weight, conv_pool, ssm_pool, slots) -> float | None:
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    except ImportError:
        return None
    batch = qkv.shape[0]

    def step() -> None:
        x = conv_decode(qkv, weight, conv_pool, slots)
        q, k, v = x.split([HK * D, HK * D, HV * D], dim=-1)
        state = ssm_pool.index_select(0, slots)
        _, final = fused_recurrent_gated_delta_rule(
            q.view(batch, 1, HK, D), k.view(batch, 1, HK, D), v.view(batch, 1, HV, D), g[:, None], beta[:, None],
            scale=D**-0.5, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        ssm_pool.index_copy_(0, slots, final)

    return do_bench_cudagraph(step) * 1e3


if __name__ == "__main__":
    main()
