"""Sliding-window attention and attention sinks through every attention backend.

The torch backend (the reference, and what the CPU token-exact runs use) against transformers' own
definitions: its sliding-window mask function (masking_utils) and gpt-oss's eager attention, which
appends the sink logit as a softmax column and drops it. The Triton backend (the interpreter on CPU)
and the FlashAttention backend (fakes of FA2 and FA4 that follow the libraries' documented window
convention) against the torch backend. Steps are packed as the engine packs them: fresh prompts,
prefix-cache hits (a few queries at the end of a long context), chunks that continue across the
window's edge, decode batches and mixed steps.
"""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch
from test_flash_attention_backend import (
    SCALE,
    FakeFA2,
    FakeFA4,
    Step,
    _context,
    _install,
    cpu_backend,
    make_step,
    rel_err,
)
from transformers import masking_utils
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from nanostream.layers.attention_backend import KVCache, TorchAttention
from nanostream.layers.flash_attention import FlashAttention
from nanostream.layers.triton_attention import TritonAttention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (cached, new) per sequence. Prefill: a fresh prompt, a prefix hit whose 5 queries end a 205-token
# context, a chunk continuing mid-block. Decode: contexts of 1 to 300. Mixed: decode rows first (the
# scheduler's order), then a fresh prompt and a chunk.
STEPS = {
    "prefill": [(0, 40), (200, 5), (37, 30)],
    "decode": [(0, 1), (16, 1), (99, 1), (299, 1)],
    "mixed": [(99, 1), (0, 1), (0, 25), (150, 10)],
}
WINDOWS = [None, 1, 3, 16, 100]


def sinks_for(hq: int, seed: int) -> torch.Tensor:
    return 2 * torch.randn(hq, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def clone(step: Step, dtype: torch.dtype | None = None) -> Step:
    """The step on its own copy of the pool (in ``dtype``, when given)."""
    dtype = dtype or step.q.dtype
    cache = KVCache(step.cache.k.to(dtype, copy=True), step.cache.v.to(dtype, copy=True))
    return Step(step.q.to(dtype), step.k.to(dtype), step.v.to(dtype), cache, step.meta)


def forward(backend, step: Step, window, sinks) -> torch.Tensor:
    return backend.forward(step.q, step.k, step.v, step.cache, step.meta, SCALE, window=window, sinks=sinks)


def transformers_attention(step: Step, window, sinks) -> torch.Tensor:
    """transformers' gpt-oss eager attention under transformers' (sliding-window) causal mask, sequence by
    sequence, over the pool that a forward of ``step`` left (its new K/V stored). No sinks: sink logits of
    -inf, whose softmax column is 0."""
    meta, (hq, hkv) = step.meta, (step.q.shape[1], step.cache.k.shape[2])
    mask_fn = (
        masking_utils.causal_mask_function
        if window is None
        else masking_utils.sliding_window_causal_mask_function(window)
    )
    sink_logits = torch.full((hq,), float("-inf"), device=DEVICE) if sinks is None else sinks
    module = types.SimpleNamespace(num_key_value_groups=hq // hkv, sinks=sink_logits.to(step.q.dtype), training=False)
    out = torch.empty_like(step.q)
    for i, n in enumerate(meta.seq_lens_host):
        start, end = meta.cu_seqlens_q_host[i], meta.cu_seqlens_q_host[i + 1]
        q_idx = torch.arange(n - (end - start), n, device=DEVICE)[:, None]  # the queries' positions
        visible = mask_fn(0, 0, q_idx, torch.arange(n, device=DEVICE)[None, :])
        mask = torch.zeros(visible.shape, dtype=step.q.dtype, device=DEVICE).masked_fill(~visible, float("-inf"))
        k = _context(step.cache.k, meta.block_tables[i], n).transpose(0, 1)[None]  # [1, Hkv, n, D]
        v = _context(step.cache.v, meta.block_tables[i], n).transpose(0, 1)[None]
        q = step.q[start:end].transpose(0, 1)[None]
        out[start:end] = eager_attention_forward(module, q, k, v, mask[None, None], SCALE)[0][0]
    return out


# ---- the torch backend against transformers' definitions -----------------------------------------


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("kind", list(STEPS))
def test_torch_backend_matches_transformers(kind, window, sinks):
    step = make_step(STEPS[kind], 8, 2, 16, 16, seed=len(kind), device=DEVICE)
    sink_logits = sinks_for(8, 1) if sinks else None
    for dtype, bound in ((torch.float64, 1e-12), (torch.float32, 1e-6)):
        s = clone(step, dtype)
        out = forward(TorchAttention(), s, window, sink_logits)
        assert out.dtype == dtype and not out.isnan().any()
        assert rel_err(out, transformers_attention(s, window, sink_logits)) < bound, dtype


def test_window_and_sinks_change_the_output():
    # the prefix hit's 5 queries see 205 keys: a window of 16 and sinks each move their outputs
    step = make_step(STEPS["prefill"], 8, 2, 16, 16, seed=5, device=DEVICE)
    full = forward(TorchAttention(), clone(step), None, None)
    windowed = forward(TorchAttention(), clone(step), 16, None)
    sunk = forward(TorchAttention(), clone(step), None, sinks_for(8, 2) + 4)  # e^sink ~ a tenth of the keys' mass
    hit = slice(40, 45)  # the prefix hit's rows
    assert rel_err(windowed[hit], full[hit]) > 0.1 and rel_err(sunk[hit], full[hit]) > 0.01
    wide = forward(TorchAttention(), clone(step), 205, None)  # a window as long as every context hides nothing
    assert rel_err(wide, full) < 1e-6


@pytest.mark.parametrize("backend_cls", [TorchAttention, TritonAttention])
def test_chunked_prefill_across_the_window_edge_matches_one_step(backend_cls):
    """A 70-token prompt in one step and in chunks of 30 and 40: the second chunk's first queries see
    keys of the first chunk through the window."""
    step = make_step([(0, 70)], 8, 2, 16, 5, seed=9, device=DEVICE)
    sinks = sinks_for(8, 3)
    whole = forward(backend_cls(), clone(step), 16, sinks)
    chunked, meta = clone(step), step.meta
    outs = []
    for lo, hi in ((0, 30), (30, 70)):
        chunk_meta = dataclasses.replace(
            meta,
            slot_mapping=meta.slot_mapping[lo:hi],
            cu_seqlens_q=torch.tensor([0, hi - lo], dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor([hi], dtype=torch.int32, device=DEVICE),
            max_seqlen_q=hi - lo,
            max_seqlen_k=hi,
            cu_seqlens_q_host=[0, hi - lo],
            seq_lens_host=[hi],
        )
        chunk = Step(chunked.q[lo:hi], chunked.k[lo:hi], chunked.v[lo:hi], chunked.cache, chunk_meta)
        outs.append(forward(backend_cls(), chunk, 16, sinks))
    assert rel_err(torch.cat(outs), whole) < 1e-6


@pytest.mark.parametrize("window", [0, -3, 2.5, True])
def test_a_window_that_is_not_a_positive_int_is_refused(window):
    step = make_step(STEPS["decode"], 4, 2, 16, 16, seed=0, device=DEVICE)
    for backend in (TorchAttention(), TritonAttention()):
        with pytest.raises(ValueError, match="window must be a positive number of tokens"):
            forward(backend, clone(step), window, None)


# ---- the Triton backend against the torch backend (the interpreter on CPU) ------------------------


@pytest.mark.parametrize(
    "kind, window, sinks, block_size",
    [
        ("prefill", 1, True, 16),
        ("prefill", 3, False, 5),  # a block size that divides no window
        ("prefill", 16, True, 5),
        ("prefill", 100, True, 16),
        ("decode", 3, True, 16),
        ("decode", 100, False, 5),  # two splits over the window
        ("mixed", 16, True, 5),  # the decode rows and the chunks each get the window and the sinks
        ("mixed", None, True, 16),
    ],
)
def test_triton_backend_matches_torch(kind, window, sinks, block_size):
    step = make_step(STEPS[kind], 8, 2, 16, block_size, seed=block_size, device=DEVICE)
    sink_logits = sinks_for(8, 4) if sinks else None
    ref = forward(TorchAttention(), clone(step), window, sink_logits)
    out = forward(TritonAttention(), clone(step), window, sink_logits)
    assert not out.isnan().any() and rel_err(out, ref) < 1e-5


# ---- the FlashAttention backend through fakes that follow the libraries' window and sink rules ----


def _windowed(q, k, v, scale, left, sink):
    """FlashAttention's local attention, bottom-right aligned: query j of Lq (position Lk - Lq + j) sees
    keys in [pos - left, pos] (left None or -1: all before it); a sink logit per head in the denominator."""
    lq, lk, rep = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    pos_q = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
    pos_k = torch.arange(lk, device=q.device)[None, :]
    visible = pos_k <= pos_q
    if left is not None and left >= 0:
        visible &= pos_k >= pos_q - left
    scores = scores.masked_fill(~visible, float("-inf"))
    if sink is not None:
        scores = torch.cat([scores, sink.float()[:, None, None].expand(-1, lq, 1)], -1)
    probs = scores.softmax(-1)[..., :lk]
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)


class WindowedFA4(FakeFA4):
    """FakeFA4's checks and record, then attention with ``window_size`` and ``learnable_sink`` (bfloat16
    only, as FA4 asserts)."""

    def flash_attn_varlen_func(self, q, k, v, window_size=(None, None), learnable_sink=None, **kw):
        super().flash_attn_varlen_func(q, k, v, **kw)
        self.calls[-1].update(window_size=window_size, learnable_sink=learnable_sink)
        assert window_size[1] in (None, 0), "right of the diagonal: nothing (causal)"
        if learnable_sink is not None:
            assert learnable_sink.dtype == torch.bfloat16 and learnable_sink.shape == (q.shape[-2],)
        cu, lens, table = kw.get("cu_seqlens_q"), kw["seqused_k"], kw["page_table"]
        out = torch.empty_like(q)
        for i in range(lens.numel()):
            rows = i if cu is None else slice(int(cu[i]), int(cu[i + 1]))
            n = int(lens[i])
            kc, vc = _context(k, table[i], n), _context(v, table[i], n)
            out[rows] = _windowed(q[rows], kc, vc, kw["softmax_scale"], window_size[0], learnable_sink)
        return out, None


class WindowedFA2(FakeFA2):
    """FakeFA2's checks and record, then attention with ``window_size`` (FA2 has no sinks)."""

    def flash_attn_varlen_func(self, q, k, v, cu_q, cu_k, max_q, max_k, window_size=(-1, -1), **kw):
        super().flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **kw)
        self.calls[-1]["window_size"] = window_size
        out = torch.empty_like(q)
        for i in range(cu_q.numel() - 1):
            rows, n = slice(int(cu_q[i]), int(cu_q[i + 1])), int(cu_k[i + 1] - cu_k[i])
            kc, vc = _context(k, kw["block_table"][i], n), _context(v, kw["block_table"][i], n)
            out[rows] = _windowed(q[rows], kc, vc, kw["softmax_scale"], window_size[0], None)
        return out

    def flash_attn_with_kvcache(self, q, k_cache, v_cache, window_size=(-1, -1), **kw):
        super().flash_attn_with_kvcache(q, k_cache, v_cache, **kw)
        self.calls[-1]["window_size"] = window_size
        out = torch.empty_like(q)
        for i, n in enumerate(kw["cache_seqlens"].tolist()):
            kc, vc = _context(k_cache, kw["block_table"][i], n), _context(v_cache, kw["block_table"][i], n)
            out[i] = _windowed(q[i], kc, vc, kw["softmax_scale"], window_size[0], None)
        return out


def install_windowed(monkeypatch, version: int):
    """The fake FlashAttention-``version`` modules, their functions the windowed fake's."""
    _install(monkeypatch, version)
    fake = WindowedFA2() if version == 2 else WindowedFA4()
    module = sys.modules["flash_attn" if version == 2 else "flash_attn.cute"]
    for name in ("flash_attn_varlen_func", "flash_attn_with_kvcache")[: 2 if version == 2 else 1]:
        monkeypatch.setattr(module, name, getattr(fake, name))
    return fake


@pytest.mark.parametrize("window", [None, 1, 16, 100])
@pytest.mark.parametrize("kind", list(STEPS))
@pytest.mark.parametrize("version", [2, 4])
def test_flash_attention_window_matches_torch(monkeypatch, version, kind, window):
    fake = install_windowed(monkeypatch, version)
    step = make_step(STEPS[kind], 8, 2, 32, 256, seed=version, device=DEVICE)
    ref = forward(TorchAttention(), clone(step), window, None)
    out = forward(cpu_backend(version), clone(step), window, None)
    assert not out.isnan().any() and rel_err(out, ref) < 1e-5
    calls = fake.calls
    assert len(calls) == (2 if kind == "mixed" else 1)
    default = (-1, -1) if version == 2 else (None, None)  # no window: the library's own default, untouched
    assert all(c["window_size"] == (default if window is None else (window - 1, 0)) for c in calls)


@pytest.mark.parametrize("kind", list(STEPS))
def test_fa4_takes_bfloat16_sinks(monkeypatch, kind):
    fake = install_windowed(monkeypatch, 4)
    step = make_step(STEPS[kind], 8, 2, 32, 16, seed=11, device=DEVICE)
    sinks = sinks_for(8, 5).bfloat16().float()  # a bfloat16 model's sinks: the cast to bfloat16 is exact
    low = clone(step, torch.bfloat16)
    ref = forward(TorchAttention(), clone(low, torch.float32), 16, sinks)
    out = forward(cpu_backend(4), low, 16, sinks)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < 1e-2
    assert fake.calls and all(torch.equal(c["learnable_sink"].float(), sinks) for c in fake.calls)


@pytest.mark.parametrize("version, dtype", [(2, torch.float32), (4, torch.float32)])
@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_sinks_flash_attention_cannot_take_run_the_triton_kernels(monkeypatch, version, dtype, kind):
    # FA2 has no sinks, FA4 takes them in bfloat16 only (float32 here stands for float16 on a GPU)
    fake = install_windowed(monkeypatch, version)
    step = make_step(STEPS[kind], 8, 2, 32, 256, seed=13, device=DEVICE)
    sinks = sinks_for(8, 6)
    ref = forward(TorchAttention(), clone(step, dtype), 16, sinks)
    out = forward(cpu_backend(version), clone(step, dtype), 16, sinks)
    assert not fake.calls, "a FlashAttention call got sinks it cannot take"
    assert not out.isnan().any() and rel_err(out, ref) < 1e-5


# ---- GPU: the Triton kernels inside a CUDA graph, the real FlashAttention-4 ------------------------


@pytest.mark.gpu
def test_triton_decode_with_window_and_sinks_replays_in_a_cuda_graph():
    """Captured once at a context bound, replayed on other contexts and tables with padding rows
    (slot -1, length 1), as the engine's decode graphs are."""
    hq, hkv, d, bs, bucket, width, num_blocks = 64, 8, 64, 16, 8, 300, 1200
    backend, sinks, window = TritonAttention(), sinks_for(hq, 7), 128
    capture = make_step([(n - 1, 1) for n in range(1, 1600, 200)], hq, hkv, d, bs, seed=0, num_blocks=num_blocks,
                        device="cuda")  # fmt: skip
    tables = torch.zeros(bucket, width, dtype=torch.int32, device="cuda")
    tables[:, : capture.meta.block_tables.shape[1]] = capture.meta.block_tables
    meta = dataclasses.replace(capture.meta, block_tables=tables, max_seqlen_k=width * bs)
    static = Step(capture.q.clone(), capture.k.clone(), capture.v.clone(), capture.cache, meta)
    forward(backend, static, window, sinks)  # warm-up: compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward(backend, static, window, sinks)
    for seed, lens in ((1, [3000, 1, 64, 129, 1234, 7]), (2, [5, 2999, 128, 640, 1, 77, 3100, 900])):
        n = len(lens)
        step = make_step([(c - 1, 1) for c in lens], hq, hkv, d, bs, seed=seed, num_blocks=num_blocks, device="cuda")
        ref = forward(TorchAttention(), clone(step), window, sinks)
        for name in ("q", "k", "v"):
            getattr(static, name)[:n].copy_(getattr(step, name))
        static.cache.k.copy_(step.cache.k)
        static.cache.v.copy_(step.cache.v)
        meta.slot_mapping[:n].copy_(step.meta.slot_mapping)
        meta.slot_mapping[n:].fill_(-1)
        meta.seq_lens[:n].copy_(step.meta.seq_lens)
        meta.seq_lens[n:].fill_(1)
        meta.block_tables.zero_()
        meta.block_tables[:n, : step.meta.block_tables.shape[1]].copy_(step.meta.block_tables)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not out[:n].isnan().any() and rel_err(out[:n], ref) < 1e-5, f"replay {seed}"


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("window, sinks", [(128, False), (128, True), (None, True), (1, True)])
def test_fa4_window_and_sinks_on_gpu(block_size, window, sinks):
    pytest.importorskip("flash_attn.cute")
    backend = FlashAttention()
    sink_logits = sinks_for(64, 8).bfloat16().float() if sinks else None
    prefill = [(4 * block_size, 300), (0, 513), (2999, 1), (8 * block_size + 5, 700)]
    decode = [(n - 1, 1) for n in (1, 3000, block_size, 129, 1500)]
    for contexts in (prefill, decode):
        step = make_step(contexts, 64, 8, 64, block_size, seed=block_size, device="cuda")
        low = clone(step, torch.bfloat16)
        ref = forward(TorchAttention(), clone(low, torch.float32), window, sink_logits)
        out = forward(backend, low, window, sink_logits)
        torch.cuda.synchronize()
        assert backend.version == 4 and not out.isnan().any()
        assert rel_err(out, ref) < 1e-2, f"{contexts[0]}: relative error {rel_err(out, ref):.2e}"
