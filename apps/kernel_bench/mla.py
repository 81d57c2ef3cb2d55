"""The "mla" section: the paged MLA decode kernel (nanostream.kernels.mla_decode) at DeepSeek-V3's latent (kv_lora_rank
512 + qk_rope_head_dim 64, bf16) for 16 heads (Moonlight-16B-A3B at one GPU, DeepSeek-V3 at 8) and 128 (DeepSeek-V3 at
one), 1, 64 and 256 sequences of ~1k and ~8k tokens of context, block size 16 and random block tables.

Each output is checked against the torch reference (layers/latent_ops.py) on the first four sequences (BAD over
harness.TOL); its floor is the bytes a step must read (each entry once, the queries and outputs) at the measured copy
bandwidth: %copy is the share of it reached (the issue's goal: 0.7 at 256 sequences).
"""

from __future__ import annotations

import functools
import traceback
from typing import TYPE_CHECKING, Any

import torch

from kernel_bench.attention import load_kernel
from kernel_bench.harness import DEVICE, TOL, check_alive_after, need_cuda, short
from kernel_bench.report import fmt_impl
from kernel_bench.timing import best_us, time_calls

if TYPE_CHECKING:
    from kernel_bench.run import Run

C, R, PAGE = 512, 64, 16
HEADS = (16, 128)
BATCHES = (1, 64, 256)
CONTEXTS = (1024, 8192)


def bench_mla(run: Run, heads: int, batch: int, context: int, kernels: dict) -> None:
    gen = torch.Generator(DEVICE).manual_seed(run.args.seed + heads + batch + context)
    lens = torch.randint(context * 7 // 8, context * 9 // 8, (batch,), generator=gen, device=DEVICE)
    blocks = (lens + PAGE - 1) // PAGE
    width = int(blocks.max())
    num_blocks = int(blocks.sum())
    latent = torch.randn(num_blocks, PAGE, C + R, device=DEVICE, generator=gen).bfloat16()
    tables = torch.zeros(batch, width, dtype=torch.int32, device=DEVICE)
    perm, at = torch.randperm(num_blocks, generator=gen, device=DEVICE).to(torch.int32), 0
    for i, n in enumerate(blocks.tolist()):
        tables[i, :n] = perm[at : at + n]
        at += n
    q = (torch.randn(batch, heads, C + R, device=DEVICE, generator=gen) * 0.05).bfloat16()
    seq_lens, max_len, scale = lens.to(torch.int32), int(lens.max()), (128 + R) ** -0.5
    row: dict[str, Any] = {"heads": heads, "batch": batch, "context": context, "impls": {}}
    run.report.setdefault("mla", []).append(row)
    decode, reference = kernels["decode"], kernels["reference"]
    res: dict[str, Any] = {}
    row["impls"]["mla decode"] = res
    call = functools.partial(decode, q, latent, tables, seq_lens, scale, max_len, C)
    try:
        out = call()
        few = slice(0, min(batch, 4))
        ref = reference(q[few].float(), latent, tables[few], seq_lens[few], scale, max_len, C)
        err = ((out[few].float() - ref).norm() / ref.norm()).item()
        res["err"], res["ok"] = err, bool(torch.isfinite(out).all()) and err < TOL
    except Exception as exc:
        res["error"] = short(exc)
        traceback.print_exc()
        check_alive_after(exc)
        return
    time_calls(res, [call])
    t, ceil = best_us(res), run.ceilings()
    if t:
        io_bytes = int(lens.sum()) * (C + R) * 2 + batch * heads * (2 * C + R) * 2
        res["tbs"] = io_bytes / (t * 1e-6) / 1e12
        res["frac_copy"] = res["tbs"] / ceil["copy_tbs"] if ceil else None
    print(f"   mla decode: {fmt_impl(res)}")


def section_mla(run: Run) -> None:
    need_cuda()
    from nanostream.layers.latent_ops import latent_decode_reference

    kernels = {"decode": load_kernel("mla_decode", "paged_mla_decode"), "reference": latent_decode_reference}
    for heads in HEADS:
        for batch in BATCHES:
            for context in CONTEXTS:
                uid = f"mla/H={heads} B={batch} ctx={context}"
                run.unit(uid, lambda h=heads, b=batch, c=context: bench_mla(run, h, b, c, kernels))
