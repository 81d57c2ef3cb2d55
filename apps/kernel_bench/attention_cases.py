"""The attention cases (decode and prefill shapes), their random paged inputs and a float32 reference."""

from __future__ import annotations

import itertools
import math
import random
import statistics
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernel_bench.harness import DEVICE, DTYPE, HKV, HQ, MAX_SETS, SCALE, D, l2_bytes


def causal_pairs(q_len: int, seq_len: int, window: int | None = None) -> int:
    """(query, key) pairs attended when q_len queries are the last of seq_len tokens (each sees at most
    ``window`` keys, its own included)."""
    if window is None:
        return q_len * (seq_len - q_len) + q_len * (q_len + 1) // 2
    return sum(min(p + 1, window) for p in range(seq_len - q_len, seq_len))


def visible_keys(seq_len: int, window: int | None) -> int:
    """Keys the last query of a seq_len context attends (what decode reads of its KV)."""
    return seq_len if window is None else min(seq_len, window)


@dataclass(frozen=True)
class Case:
    kind: str  # "decode" | "prefill"
    name: str
    block_size: int
    seq_lens: tuple[int, ...]  # context of each sequence, new tokens included
    q_lens: tuple[int, ...]  # new (query) tokens: the last q_lens[i] of each context
    window: int | None = None  # sliding window: a query at p sees keys (p - window, p]
    section: str = "kernels"

    @property
    def uid(self) -> str:
        return f"{self.section}/{self.kind} {self.name} bs{self.block_size}"

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    @property
    def kv_bytes(self) -> int:  # each context's K and V read once (in decode, a window's keys only)
        keys = sum(n if self.kind == "prefill" else visible_keys(n, self.window) for n in self.seq_lens)
        return keys * HKV * D * 2 * DTYPE.itemsize

    @property
    def io_bytes(self) -> int:  # + q read, out written, block tables and lengths
        width = -(-max(self.seq_lens) // self.block_size)
        return self.kv_bytes + 2 * self.num_tokens * HQ * D * DTYPE.itemsize + 4 * len(self.seq_lens) * (width + 2)

    @property
    def flops(self) -> int:  # QK^T and PV: 2 * D each per (query, key) pair and head
        return 4 * D * HQ * sum(causal_pairs(q, n, self.window) for q, n in zip(self.q_lens, self.seq_lens))


def attention_cases(quick: bool, seed: int) -> list[Case]:
    rng = random.Random(seed)
    half = [rng.randint(100, 2132) for _ in range(128)]
    mixed = [*half, *(100 + 2132 - n for n in half)]  # uniform over 100..2132, mean exactly 1,116
    rng.shuffle(mixed)
    mixed = tuple(mixed)
    mixed_name = f"b256 ctx~{round(statistics.mean(mixed))}"
    cases = []
    for bs in (256, 16):
        shapes = [(mixed_name, mixed)]
        if not quick:
            shapes += [(f"b{b} ctx1024", (1024,) * b) for b in (1, 8, 64, 256)] + [("b8 ctx32768", (32768,) * 8)]
        elif bs == 256:
            shapes += [("b1 ctx1024", (1024,)), ("b64 ctx1024", (1024,) * 64)]
        cases += [Case("decode", name, bs, lens, (1,) * len(lens)) for name, lens in shapes]
    prefills = [("8x1024", 8, 1024, 0), ("4x2048+2048", 4, 2048, 2048), ("2x4096", 2, 4096, 0)]
    for name, b, new, prefix in prefills[:1] if quick else prefills:
        cases.append(Case("prefill", name, 256, (prefix + new,) * b, (new,) * b))
    return cases


WINDOW_CONTEXT = 4096
WINDOWS = (None, 128, 1024)


def window_cases(quick: bool) -> list[Case]:
    """Decode at a 4,096-token context: full attention and sliding windows of 128 and 1,024 tokens, at the
    kernels section's batch sizes (--quick: 1 and 64); block size 256."""
    cases = []
    for b in (1, 64) if quick else (1, 8, 64, 256):
        for w in WINDOWS:
            name = f"b{b} ctx{WINDOW_CONTEXT} " + ("full" if w is None else f"w{w}")
            cases.append(Case("decode", name, 256, (WINDOW_CONTEXT,) * b, (1,) * b, window=w, section="window"))
    return cases


@dataclass
class Batch:
    """One input set; every set of a case shares the pool but has its own blocks and queries."""

    q: torch.Tensor  # [T, Hq, D]
    block_tables: torch.Tensor  # [B, W] int32, padded with 0
    seq_lens: torch.Tensor  # [B] int32
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    out: torch.Tensor  # [T, Hq, D], where our kernels write
    cu_host: list[int]


def make_inputs(case: Case) -> tuple[torch.Tensor, torch.Tensor, list[Batch]]:
    """A random KV pool and enough input sets to exceed L2 four times over (at most MAX_SETS)."""
    bs = case.block_size
    per_seq = [-(-n // bs) for n in case.seq_lens]
    blocks_per_set = sum(per_seq)
    set_bytes = case.kv_bytes + 2 * case.num_tokens * HQ * D * DTYPE.itemsize
    n_sets = max(1, min(MAX_SETS, math.ceil(4 * l2_bytes() / set_bytes)))
    num_blocks = n_sets * blocks_per_set
    k_cache = torch.randn(num_blocks, bs, HKV, D, dtype=DTYPE, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks).tolist()  # each set's blocks scattered over the whole pool
    width = max(per_seq)
    cu = [0, *itertools.accumulate(case.q_lens)]
    seq_lens = torch.tensor(case.seq_lens, dtype=torch.int32, device=DEVICE)
    cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    batches = []
    for s in range(n_sets):
        ids = iter(perm[s * blocks_per_set : (s + 1) * blocks_per_set])
        rows = [[next(ids) for _ in range(p)] + [0] * (width - p) for p in per_seq]
        q = torch.randn(case.num_tokens, HQ, D, dtype=DTYPE, device=DEVICE)
        table = torch.tensor(rows, dtype=torch.int32, device=DEVICE)
        batches.append(Batch(q, table, seq_lens, cu_seqlens, torch.empty_like(q), cu))
    return k_cache, v_cache, batches


def reference(q: torch.Tensor, k_cache, v_cache, table: torch.Tensor, seq_len: int, window=None) -> torch.Tensor:
    """float32 attention of q [Lq, Hq, D], the last Lq positions of a seq_len context, over its pool blocks
    (with a window: query at p over keys (p - window, p])."""
    bs = k_cache.shape[1]
    blocks = table[: -(-seq_len // bs)].long()
    k = k_cache[blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(HQ // HKV, dim=1)  # [L, Hq, D]
    v = v_cache[blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(HQ // HKV, dim=1)
    lq = q.shape[0]
    ones = torch.ones(lq, seq_len, dtype=torch.bool, device=q.device)
    mask = ones.tril(seq_len - lq)  # bottom-right causal
    if window is not None:
        mask &= ~ones.tril(seq_len - lq - window)
    o = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=SCALE
    )
    return o.transpose(0, 1)


def rel_error(out: torch.Tensor, case: Case, batch: Batch, k_cache, v_cache) -> tuple[float, bool]:
    """(the largest ‖out − ref‖ / ‖ref‖ of any sequence, every element of out finite)."""
    finite = bool(torch.isfinite(out).all())
    worst = 0.0
    for i, seq_len in enumerate(case.seq_lens):
        start, end = batch.cu_host[i], batch.cu_host[i + 1]
        ref = reference(batch.q[start:end], k_cache, v_cache, batch.block_tables[i], seq_len, case.window)
        err = ((out[start:end].float() - ref).norm() / ref.norm()).item()
        worst = err if math.isnan(err) else max(worst, err)
        if math.isnan(worst):
            break
    return worst, finite
