"""The paged MLA decode kernel's tiles (heads a program, tokens a tile, warps, pipeline stages) at DeepSeek-V3's
latent (512 + 64, bf16), 128 heads (DeepSeek-V3 on one GPU) and 16 (Moonlight, or V3 over 8 GPUs), 256 sequences of
8k tokens: the six fastest against the byte floor (each entry read once at the measured copy bandwidth), each
checked against the default tiles' output. GPU only, ~2 min:

    python3 apps/mla_sweep.py
"""

import functools
import itertools
import sys

import torch
from bench_gdn import copy_bandwidth
from triton.testing import do_bench_cudagraph

sys.path.insert(0, ".")
from nanostream.kernels.mla_decode import paged_mla_decode

C, R, PAGE = 512, 64, 16


def main() -> None:
    dev, bw = "cuda", copy_bandwidth()
    print(f"{torch.cuda.get_device_name()} copy {bw / 1e12:.2f} TB/s", flush=True)
    for heads, batch, ctx in ((128, 256, 8192), (16, 256, 8192)):
        g = torch.Generator(dev).manual_seed(0)
        nblk = batch * ctx // PAGE
        latent = torch.randn(nblk, PAGE, C + R, device=dev, generator=g).bfloat16()
        tables = torch.randperm(nblk, device=dev, generator=g).to(torch.int32).view(batch, ctx // PAGE)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        q = (torch.randn(batch, heads, C + R, device=dev, generator=g) * 0.05).bfloat16()
        floor = (batch * ctx * (C + R) * 2) / bw * 1e6
        base = paged_mla_decode(q, latent, tables, lens, 0.07, ctx, C).float()
        rows = []
        for bh, bn, w, st in itertools.product((16, 32, 64), (16, 32, 64), (4, 8), (1, 2)):
            if bh > heads or (bh == 64 and bn == 64 and w == 4):
                continue
            try:
                fn = functools.partial(paged_mla_decode, q, latent, tables, lens, 0.07, ctx, C, block_h=bh, block_n=bn,
                                       num_warps=w, num_stages=st)  # fmt: skip
                err = ((fn().float() - base).norm() / base.norm()).item()
                us = do_bench_cudagraph(fn, rep=50) * 1e3
                rows.append((us, bh, bn, w, st, err))
            except Exception as exc:
                print("  fail", bh, bn, w, st, str(exc)[:80], flush=True)
        rows.sort()
        print(f"H={heads} B={batch} ctx={ctx} floor {floor:.0f} us; best:", flush=True)
        for us, bh, bn, w, st, err in rows[:6]:
            tiles = f"block_h {bh} block_n {bn} warps {w} stages {st}"
            print(f"  {us:8.1f} us  {floor / us:.2f} of floor  {tiles}  err {err:.1e}")
        default = [r for r in rows if r[1:5] == (16, 32, 4, 1)] or [r for r in rows if r[1:4] == (16, 32, 4)]
        print("  default-ish:", [f"{r[0]:.1f} us st{r[4]}" for r in default], flush=True)


if __name__ == "__main__":
    main()
