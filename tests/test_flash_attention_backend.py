"""The flash_attn attention backend against TorchAttention, the reference backend.

On CPU, fake ``flash_attn`` modules stand in for FlashAttention-2 and -4: each implements its library's
semantics in plain torch (paged KV through a block table, GQA, causal bottom-right, softmax scale), makes
the argument checks the library makes, and records each call, so the tests see both that the backend
computes the right thing and that it hands the real library what it accepts. On a GPU with
FlashAttention-4 installed, the real FA4 runs in bfloat16 against TorchAttention in float32.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import sys
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nanostream.layers import flash_attention as fa
from nanostream.layers.attention_backend import AttentionMetadata, KVCache, TorchAttention
from nanostream.layers.flash_attention import FlashAttention, flash_attn_unavailable_reason

SCALE = 0.3  # not head_dim ** -0.5, so a scale the backend drops (library default) shows
# The fakes run anywhere; on a GPU machine store_kv is compiled there (TRITON_INTERPRET is for CPUs only).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# ---- fake FlashAttention modules ------------------------------------------------------------------


def _attend(q, k, v, scale):
    """q [Lq, Hq, D], k/v [Lk, Hkv, D] -> [Lq, Hq, D]: causal, query j sees keys <= Lk - Lq + j."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    lq, lk = q.shape[0], k.shape[0]
    pos_k, pos_q = torch.arange(lk, device=q.device), torch.arange(lq, device=q.device)
    visible = pos_k[None, :] <= pos_q[:, None] + (lk - lq)
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)


def _context(cache, table_row, n):
    """The first n tokens of a sequence, gathered from its blocks: [n, Hkv, D]."""
    return cache[table_row[: -(-n // cache.shape[1])].long()].flatten(0, 1)[:n]


def _check_int32(t, shape, name):
    assert t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}"
    assert tuple(t.shape) == shape, f"{name} shape {tuple(t.shape)} != {shape}"
    assert t.is_contiguous(), f"{name} must be contiguous"


def _check_paged(q, k_cache, v_cache, block_table, batch, seq_lens):
    """What both libraries require of paged KV, and what a read through the table needs."""
    assert q.dtype == k_cache.dtype == v_cache.dtype, (q.dtype, k_cache.dtype)
    assert q.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "paged KV: [num_blocks, block_size, Hkv, D]"
    assert q.shape[-2] % k_cache.shape[2] == 0 and q.shape[-1] == k_cache.shape[3]
    assert block_table.dim() == 2
    _check_int32(block_table, (batch, block_table.shape[1]), "block_table")
    assert block_table.shape[1] * k_cache.shape[1] >= int(seq_lens.max()), "block table too narrow"


class _Fake:
    """A fake library: records each call, and pauses the host-sync guard (if any) while it computes."""

    def __init__(self):
        self.calls = []
        self.guard: NoHostSync | None = None

    def _record(self, **kw):
        self.calls.append(kw)
        return self.guard.paused() if self.guard else contextlib.nullcontext()


class FakeFA2(_Fake):
    """flash_attn 2.x: ``flash_attn_varlen_func`` and ``flash_attn_with_kvcache``, with their checks."""

    def flash_attn_varlen_func(
        self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
        softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
        deterministic=False, return_attn_probs=False, block_table=None,
    ):  # fmt: skip
        with self._record(fn="varlen", q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                          max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, scale=softmax_scale,
                          causal=causal, block_table=block_table):  # fmt: skip
            batch = cu_seqlens_q.numel() - 1
            _check_int32(cu_seqlens_q, (batch + 1,), "cu_seqlens_q")
            _check_int32(cu_seqlens_k, (batch + 1,), "cu_seqlens_k")
            q_lens, k_lens = cu_seqlens_q.diff(), cu_seqlens_k.diff()
            assert block_table is not None, "the pool is paged: pass block_table"
            assert k.shape[1] % 256 == 0, "Paged KV cache block size must be divisible by 256"
            _check_paged(q, k, v, block_table, batch, k_lens)
            assert q.dim() == 3 and int(cu_seqlens_q[-1]) == q.shape[0]
            assert int(cu_seqlens_q[0]) == int(cu_seqlens_k[0]) == 0
            assert int(q_lens.max()) <= max_seqlen_q and int(k_lens.max()) <= max_seqlen_k
            assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int)
            out = torch.full_like(q, float("nan"))  # poisoned: a row left unwritten shows
            for i in range(batch):
                rows = slice(int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]))
                n = int(k_lens[i])
                kc, vc = _context(k, block_table[i], n), _context(v, block_table[i], n)
                out[rows] = _attend(q[rows], kc, vc, softmax_scale or q.shape[-1] ** -0.5) if causal else 0
            return out

    def flash_attn_with_kvcache(
        self, q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
        cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
        window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
        return_softmax_lse=False,
    ):  # fmt: skip
        with self._record(fn="kvcache", q=q, k=k_cache, v=v_cache, new_k=k, new_v=v, cache_seqlens=cache_seqlens,
                          scale=softmax_scale, causal=causal, block_table=block_table):  # fmt: skip
            assert q.dim() == 4, "q: [B, Sq, Hq, D]"
            batch = q.shape[0]
            assert isinstance(cache_seqlens, torch.Tensor), "cache_seqlens from a tensor (CUDA graphs)"
            _check_int32(cache_seqlens, (batch,), "cache_seqlens")
            assert block_table is not None, "the pool is paged: pass block_table"
            assert k_cache.shape[1] % 256 == 0, "Paged KV cache block size must be divisible by 256"
            _check_paged(q, k_cache, v_cache, block_table, batch, cache_seqlens)
            out = torch.full_like(q, float("nan"))
            for i in range(batch):
                n = int(cache_seqlens[i])
                kc, vc = _context(k_cache, block_table[i], n), _context(v_cache, block_table[i], n)
                out[i] = _attend(q[i], kc, vc, softmax_scale or q.shape[-1] ** -0.5)  # seqlen_q 1: causal moot
            return out


class FakeFA4(_Fake):
    """flash_attn.cute (FA4): one ``flash_attn_varlen_func`` for paged decode and prefill; returns (out, lse)."""

    def flash_attn_varlen_func(
        self, q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
        min_seqlen_k=None, seqused_q=None, seqused_k=None, gather_kv_indices=None, page_table=None,
        softmax_scale=None, causal=False, window_size=(None, None), learnable_sink=None, softcap=0.0,
        num_splits=1, pack_gqa=None, deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None,
        block_sparse_tensors=None, aux_tensors=None, aux_scalars=None, return_lse=False, scheduler_metadata=None,
        seqlen_k_per_split=None, disable_scheduler_metadata=False, gather_bwd_recompute_p=False,
        gather_bwd_token_chunk=None,
    ):  # fmt: skip
        with self._record(fn="batched" if cu_seqlens_q is None else "varlen", q=q, k=k, v=v,
                          cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k, max_seqlen_q=max_seqlen_q,
                          max_seqlen_k=max_seqlen_k, scale=softmax_scale, causal=causal,
                          block_table=page_table):  # fmt: skip
            assert page_table is not None, "the pool is paged: pass page_table"
            assert cu_seqlens_k is None, "page_table is not supported with cu_seqlens_k"
            assert seqused_k is not None, "paged KV needs seqused_k (the context lengths)"
            batch = q.shape[0] if cu_seqlens_q is None else cu_seqlens_q.numel() - 1
            _check_int32(seqused_k, (batch,), "seqused_k")
            _check_paged(q, k, v, page_table, batch, seqused_k)
            out = torch.full_like(q, float("nan"))
            scale = softmax_scale or q.shape[-1] ** -0.5
            for i in range(batch):
                if cu_seqlens_q is None:
                    assert q.dim() == 4, "q: [B, Sq, Hq, D] or packed [T, Hq, D] with cu_seqlens_q"
                    rows = i
                else:
                    _check_int32(cu_seqlens_q, (batch + 1,), "cu_seqlens_q")
                    assert q.dim() == 3 and isinstance(max_seqlen_q, int)
                    rows = slice(int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]))
                    assert rows.stop - rows.start <= max_seqlen_q
                n = int(seqused_k[i])
                assert max_seqlen_k is None or n <= max_seqlen_k
                kc, vc = _context(k, page_table[i], n), _context(v, page_table[i], n)
                out[rows] = _attend(q[rows], kc, vc, scale) if causal else 0
            return out, None


def _install(monkeypatch, version: int) -> _Fake:
    """Puts a fake FlashAttention-``version`` in sys.modules (and hides the other version)."""
    if version == 2:
        fake = FakeFA2()
        module = types.ModuleType("flash_attn")
        module.flash_attn_varlen_func = fake.flash_attn_varlen_func
        module.flash_attn_with_kvcache = fake.flash_attn_with_kvcache
        monkeypatch.setitem(sys.modules, "flash_attn", module)
        monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # `import flash_attn.cute` fails
    else:
        fake = FakeFA4()
        package = types.ModuleType("flash_attn")  # what flash-attn-4 alone installs: a bare namespace
        package.__path__ = []
        cute = types.ModuleType("flash_attn.cute")
        cute.flash_attn_varlen_func = fake.flash_attn_varlen_func
        package.cute = cute
        monkeypatch.setitem(sys.modules, "flash_attn", package)
        monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    return fake


class NoHostSync(TorchDispatchMode):
    """Records the ops that would make the host wait for the GPU (item, tolist, bool, nonzero...)."""

    SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "equal", "is_nonzero"}

    def __init__(self):
        super().__init__()
        self.syncs, self._paused = [], 0

    @contextlib.contextmanager
    def paused(self):
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._paused and func.__name__.split(".")[0] in self.SYNCING:
            self.syncs.append(func.__name__)
        return func(*args, **(kwargs or {}))


# ---- a step's packed batch ------------------------------------------------------------------------


@dataclasses.dataclass
class Step:
    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor
    cache: KVCache
    meta: AttentionMetadata


def make_step(contexts, hq, hkv, head_dim, block_size, *, seed, share_first_block=False, num_blocks=None, device="cpu"):
    """One step: sequence i has ``contexts[i] = (cached, new)``: ``cached`` tokens already in the pool,
    ``new`` tokens computed now. Blocks are scattered over a pool full of unrelated values; with
    ``share_first_block`` the last sequence reads the first one's first block (a prefix-cache hit)."""
    gen, dev_gen = torch.Generator().manual_seed(seed), torch.Generator(device).manual_seed(seed)
    blocks_per_seq = [-(-(c + n) // block_size) for c, n in contexts]
    num_blocks = num_blocks or sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots, cu_q, seq_lens, used = [], [], [0], [], 0
    for (cached, new), nb in zip(contexts, blocks_per_seq):
        table = perm[used : used + nb]
        used += nb
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(cached, cached + new)]
        cu_q.append(cu_q[-1] + new)
        seq_lens.append(cached + new)
    if share_first_block:
        assert contexts[0][0] >= block_size and contexts[-1][0] >= block_size, "both must have a cached block"
        tables[-1][0] = tables[0][0]
    width = max(blocks_per_seq)
    padded = [t + [0] * (width - len(t)) for t in tables]

    def randn(*shape):
        return torch.randn(*shape, generator=dev_gen, device=device)

    total = cu_q[-1]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        max_seqlen_q=max(n for _, n in contexts),
        max_seqlen_k=max(seq_lens),
        cu_seqlens_q_host=cu_q,
        seq_lens_host=seq_lens,
    )
    pool = (num_blocks, block_size, hkv, head_dim)
    cache = KVCache(randn(*pool), randn(*pool))
    return Step(randn(total, hq, head_dim), randn(total, hkv, head_dim), randn(total, hkv, head_dim), cache, meta)


def as_graph_replay(meta: AttentionMetadata) -> AttentionMetadata:
    """What a decode step inside a CUDA graph offers: no host lists, max_seqlen_k only an upper bound."""
    bound = meta.block_tables.shape[1] * 1024
    return dataclasses.replace(meta, max_seqlen_k=bound, cu_seqlens_q_host=None, seq_lens_host=None)


def run_both(step: Step, backend, meta=None, guard=None):
    """(backend's output, reference output), each on its own copy of the pool; asserts the pools agree.

    ``meta`` is what the backend gets (the reference gets ``step.meta``); ``guard`` watches the backend."""
    ref_cache = KVCache(step.cache.k.clone(), step.cache.v.clone())
    ref = TorchAttention().forward(step.q, step.k, step.v, ref_cache, step.meta, SCALE)
    with guard or contextlib.nullcontext():
        out = backend.forward(step.q, step.k, step.v, step.cache, meta or step.meta, SCALE)
    assert torch.equal(step.cache.k, ref_cache.k) and torch.equal(step.cache.v, ref_cache.v), "KV pools differ"
    return out, ref


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def cpu_backend(version: int) -> FlashAttention:
    """The backend with FlashAttention-``version`` picked, skipping the CUDA check of its first call."""
    backend = FlashAttention()
    backend.version, backend._kernel = version, fa._KERNELS[version]()
    return backend


def check_call(call, step: Step, decode: bool):
    """The arguments a real library needs: the pool itself, the scale, the tables and lengths as given."""
    cache, meta = step.cache, step.meta
    assert call["k"].data_ptr() == cache.k.data_ptr() and call["v"].data_ptr() == cache.v.data_ptr(), "pool copied"
    assert call["k"].shape == cache.k.shape
    assert call["scale"] == SCALE and call["causal"] is True
    assert call["block_table"].data_ptr() == meta.block_tables.data_ptr(), "block table copied"
    assert call["block_table"].shape == meta.block_tables.shape
    assert call["q"].shape[-2:] == step.q.shape[-2:]
    if decode:
        assert call["q"].shape[:2] == (len(meta.seq_lens_host), 1), "decode q: [B, 1, Hq, D]"
    else:
        assert call["q"].shape == step.q.shape
    if "cu_seqlens_k" in call:  # FA2 varlen: built on the device from seq_lens
        cu_k = torch.tensor([0, *torch.cumsum(meta.seq_lens, 0).tolist()], dtype=torch.int32, device=DEVICE)
        assert torch.equal(call["cu_seqlens_k"], cu_k)
    for name in ("cache_seqlens", "seqused_k"):
        if call.get(name) is not None:
            assert torch.equal(call[name], meta.seq_lens)


# ---- CPU: the backend's FA2 and FA4 paths through the fakes ---------------------------------------

# (cached, new) per sequence, for block size 256. A fresh prompt; prefix hits (cached = whole blocks),
# one sharing the first sequence's block; a chunk continuing mid-block across a boundary; a decode token
# riding in the same step; contexts of up to 3 blocks.
PREFILL = [(256, 20), (0, 37), (200, 70), (300, 1), (512, 9)]
CHUNKED = [(0, 260), (250, 12)]


@pytest.mark.parametrize("version,block_size", [(2, 256), (4, 256), (4, 16)])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (6, 1)])
def test_prefill_with_prefix_hits_matches_torch(monkeypatch, version, block_size, hq, hkv):
    fake = _install(monkeypatch, version)
    backend = cpu_backend(version)
    contexts = [(c * block_size // 256, n) for c, n in PREFILL]  # the same shape in blocks of 16
    contexts[0] = (max(contexts[0][0], block_size), contexts[0][1])
    step = make_step(contexts, hq, hkv, 32, block_size, seed=hq * 10 + version, share_first_block=True, device=DEVICE)
    guard = fake.guard = NoHostSync()
    out, ref = run_both(step, backend, guard=guard)
    assert not guard.syncs, f"prefill synchronised with the host: {guard.syncs}"
    assert not out.isnan().any() and rel_err(out, ref) < 1e-5
    assert [c["fn"] for c in fake.calls] == ["varlen"]
    check_call(fake.calls[0], step, decode=False)


@pytest.mark.parametrize("version", [2, 4])
def test_chunked_prefill_matches_torch(monkeypatch, version):
    fake = _install(monkeypatch, version)
    step = make_step(CHUNKED, 8, 2, 32, 256, seed=7, device=DEVICE)
    out, ref = run_both(step, cpu_backend(version))
    assert not out.isnan().any() and rel_err(out, ref) < 1e-5
    check_call(fake.calls[0], step, decode=False)


@pytest.mark.parametrize("version,block_size", [(2, 256), (4, 256), (4, 16)])
@pytest.mark.parametrize("batch,hq,hkv", [(1, 4, 4), (3, 8, 2), (8, 6, 1)])
def test_decode_matches_torch_without_host_values(monkeypatch, version, block_size, batch, hq, hkv):
    fake = _install(monkeypatch, version)
    rng = random.Random(batch * 100 + hq)
    lens = [1, 256, 257, 700][:batch] + [rng.randrange(1, 800) for _ in range(batch - 4)]
    step = make_step([(n - 1, 1) for n in lens], hq, hkv, 32, block_size, seed=batch + version, device=DEVICE)
    guard = fake.guard = NoHostSync()  # as in a CUDA graph: no host syncs, no host lists, max_seqlen_k a bound
    out, ref = run_both(step, cpu_backend(version), as_graph_replay(step.meta), guard)
    assert not guard.syncs, f"decode synchronised with the host: {guard.syncs}"
    assert out.shape == step.q.shape and not out.isnan().any() and rel_err(out, ref) < 1e-5
    assert [c["fn"] for c in fake.calls] == ["kvcache" if version == 2 else "batched"]
    check_call(fake.calls[0], step, decode=True)


# Decode tokens first (the scheduler's order), then a fresh prompt, a prefix hit and a chunk.
MIXED = [(699, 1), (0, 1), (255, 1), (300, 1), (0, 37), (256, 20), (250, 12)]


@pytest.mark.parametrize("version,block_size", [(2, 256), (4, 256), (4, 16)])
def test_mixed_step_sends_its_decode_rows_to_the_decode_path(monkeypatch, version, block_size):
    fake = _install(monkeypatch, version)
    step = make_step(MIXED, 8, 2, 32, block_size, seed=version, device=DEVICE)
    out, ref = run_both(step, cpu_backend(version))
    assert out.shape == step.q.shape and not out.isnan().any() and rel_err(out, ref) < 1e-5
    assert [c["fn"] for c in fake.calls] == ["kvcache" if version == 2 else "batched", "varlen"]
    assert step.meta.num_decodes == 4
    decode, rest = step.meta.decode_split
    check_call(fake.calls[0], dataclasses.replace(step, q=step.q[:4], meta=decode), decode=True)
    check_call(fake.calls[1], dataclasses.replace(step, q=step.q[4:], meta=rest), decode=False)
    assert rest.cu_seqlens_q.tolist() == rest.cu_seqlens_q_host == [0, 37, 57, 69]


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter on CPU; tests/test_kernels.py covers the GPU")
def test_triton_backend_mixed_step_matches_torch():
    from nanostream.layers.triton_attention import TritonAttention

    step = make_step(MIXED, 8, 2, 32, 16, seed=3, device=DEVICE)  # 4 rows by the decode kernel, 3 by prefill
    out, ref = run_both(step, TritonAttention())
    assert not out.isnan().any() and rel_err(out, ref) < 1e-5


def test_first_call_checks_the_device(monkeypatch):
    _install(monkeypatch, 2)
    step = make_step([(0, 3)], 4, 4, 32, 256, seed=0)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        FlashAttention().forward(step.q, step.k, step.v, step.cache, step.meta, SCALE)


# ---- flash_attn_unavailable_reason ----------------------------------------------------------------

CUDA = torch.device("cuda")


def test_reason_when_flash_attn_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    reason = flash_attn_unavailable_reason(CUDA, torch.bfloat16, 256, 128)
    assert reason is not None and "not installed" in reason and "pip install flash-attn-4" in reason


def test_reason_for_cpu_and_float32(monkeypatch):
    _install(monkeypatch, 2)
    assert "needs a CUDA device" in flash_attn_unavailable_reason(torch.device("cpu"), torch.bfloat16, 256, 128)
    reason = flash_attn_unavailable_reason(CUDA, torch.float32, 256, 128)
    assert "float16 or bfloat16, got torch.float32" in reason


@pytest.mark.parametrize(
    "installed,capability,block_size,head_dim,expected",
    [
        ((2,), (8, 0), 256, 128, 2),
        ((2,), (8, 9), 16, 128, "FlashAttention-2 needs kvcache_block_size divisible by 256, got 16"),
        ((2,), (8, 0), 256, 100, "FlashAttention-2 needs head_dim a multiple of 8 up to 256, got 100"),
        ((2,), (7, 5), 256, 128, "FlashAttention-2 needs an Ampere or newer GPU (sm80+), this one is sm75"),
        ((4,), (9, 0), 16, 128, 4),
        ((4,), (10, 0), 64, 256, 4),
        ((4,), (9, 0), 16, 200, "FlashAttention-4 on sm90 needs head_dim"),
        ((4,), (10, 0), 16, 192, "FlashAttention-4 on sm100 needs head_dim"),
        ((4,), (8, 6), 256, 128, "FlashAttention-4 needs a Hopper or Blackwell GPU, this one is sm86"),
        ((2, 4), (9, 0), 16, 128, 4),  # both: FA4 on Hopper, any block size
        ((2, 4), (8, 0), 16, 128, "FlashAttention-2 needs kvcache_block_size divisible by 256"),
        ((2, 4), (8, 0), 512, 128, 2),
    ],
)
def test_version_and_reason_by_gpu(monkeypatch, installed, capability, block_size, head_dim, expected):
    monkeypatch.setattr(fa, "_fa2_installed", lambda: 2 in installed)
    monkeypatch.setattr(fa, "_fa4_installed", lambda: 4 in installed)
    monkeypatch.setattr(fa, "_capability", lambda device: capability)
    version, reason = fa._plan(CUDA, torch.bfloat16, block_size, head_dim)
    if isinstance(expected, int):
        assert (version, reason) == (expected, None)
        assert flash_attn_unavailable_reason(CUDA, torch.float16, block_size, head_dim) is None
    else:
        assert version == 0 and reason.startswith(expected), reason


def test_installed_checks_follow_the_modules(monkeypatch):
    _install(monkeypatch, 2)
    assert fa._fa2_installed() and not fa._fa4_installed()
    _install(monkeypatch, 4)  # flash-attn-4 alone: `flash_attn` is a namespace without the FA2 functions
    assert fa._fa4_installed() and not fa._fa2_installed()


# ---- GPU: the real FlashAttention-4 in bfloat16 against TorchAttention in float32 -----------------

FA4_BLOCK_SIZES = [16, 64, 128, 256]  # 128 is FA4's KV tile on Hopper: the TMA path; the others gather rows
FA4_HEADS = [(16, 8), (32, 4)]


def _fa4_or_skip(block_size: int) -> None:
    pytest.importorskip("flash_attn.cute")
    reason = flash_attn_unavailable_reason(torch.device("cuda"), torch.bfloat16, block_size, 128)
    if reason is not None:
        pytest.skip(reason)


def _to_bf16(step: Step) -> tuple[Step, Step]:
    """(bfloat16 step for FA4, the same values in float32 for the reference)."""
    lo = Step(step.q.bfloat16(), step.k.bfloat16(), step.v.bfloat16(),
              KVCache(step.cache.k.bfloat16(), step.cache.v.bfloat16()), step.meta)  # fmt: skip
    hi = Step(lo.q.float(), lo.k.float(), lo.v.float(), KVCache(lo.cache.k.float(), lo.cache.v.float()), step.meta)
    return lo, hi


def _poison_allocator(like: torch.Tensor) -> None:
    """Leave NaN-filled blocks of ``like``'s size in the caching allocator, for FA4's output to reuse."""
    blocks = [torch.full_like(like, float("nan")) for _ in range(8)]
    del blocks


def _fa4_vs_torch(step: Step, backend: FlashAttention, meta=None) -> float:
    lo, hi = _to_bf16(step)
    ref_cache = KVCache(hi.cache.k.clone(), hi.cache.v.clone())
    ref = TorchAttention().forward(hi.q, hi.k, hi.v, ref_cache, step.meta, SCALE)
    _poison_allocator(lo.q)
    out = backend.forward(lo.q, lo.k, lo.v, lo.cache, meta or step.meta, SCALE)
    torch.cuda.synchronize()
    assert backend.version == 4
    assert out.dtype == torch.bfloat16 and out.shape == lo.q.shape and not out.isnan().any()
    assert torch.equal(lo.cache.k.float(), ref_cache.k) and torch.equal(lo.cache.v.float(), ref_cache.v)
    return rel_err(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", FA4_BLOCK_SIZES)
@pytest.mark.parametrize("hq,hkv", FA4_HEADS)
def test_fa4_decode_on_gpu(block_size, hq, hkv):
    _fa4_or_skip(block_size)
    backend, rng = FlashAttention(), random.Random(block_size + hq)
    for batch in (1, 8, 64):
        lens = [1, 3000, block_size, block_size + 1][:batch] + [rng.randrange(1, 3001) for _ in range(batch - 4)]
        step = make_step([(n - 1, 1) for n in lens], hq, hkv, 128, block_size, seed=batch, device="cuda")
        err = _fa4_vs_torch(step, backend, as_graph_replay(step.meta))
        assert err < 1e-2, f"batch {batch}: relative error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", FA4_BLOCK_SIZES)
@pytest.mark.parametrize("hq,hkv", FA4_HEADS)
def test_fa4_prefill_with_prefix_hits_on_gpu(block_size, hq, hkv):
    _fa4_or_skip(block_size)
    bs = block_size
    # prefix hits (whole cached blocks, one shared), a fresh prompt, a chunk continuing mid-block,
    # a decode token in the same step, long contexts
    contexts = [(4 * bs, 300), (0, 513), (2 * bs + 5, 77), (2999, 1), (bs, 1), (8 * bs, 1000)]
    step = make_step(contexts, hq, hkv, 128, block_size, seed=bs, share_first_block=True, device="cuda")
    err = _fa4_vs_torch(step, FlashAttention())
    assert err < 1e-2, f"relative error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,hq,hkv", [(16, 4, 2), (64, 8, 1)])  # 16: the tiny test models
def test_fa4_small_head_dims_on_gpu(head_dim, hq, hkv):
    _fa4_or_skip(256)
    backend = FlashAttention()
    for block_size in (16, 256):
        step = make_step([(0, 40), (300, 1), (256, 20)], hq, hkv, head_dim, block_size, seed=head_dim, device="cuda")
        assert _fa4_vs_torch(step, backend) < 1e-2
        step = make_step([(n - 1, 1) for n in (1, 17, 600)], hq, hkv, head_dim, block_size, seed=1, device="cuda")
        assert _fa4_vs_torch(step, backend, as_graph_replay(step.meta)) < 1e-2


@pytest.mark.gpu
def test_fa4_decode_replays_in_a_cuda_graph():
    """Captured once, replayed on other contexts and tables, with padding rows (slot -1, length 1) as
    the engine's decode graphs pad a batch to its bucket."""
    _fa4_or_skip(64)
    hq, hkv, d, bs, bucket, width, num_blocks = 16, 8, 128, 64, 8, 50, 420
    backend = FlashAttention()
    capture = _to_bf16(make_step([(n - 1, 1) for n in range(1, 1600, 200)], hq, hkv, d, bs, seed=0,
                                 num_blocks=num_blocks, device="cuda"))[0]  # fmt: skip
    static = Step(capture.q.clone(), capture.k.clone(), capture.v.clone(), capture.cache, capture.meta)
    tables = torch.zeros(bucket, width, dtype=torch.int32, device="cuda")
    tables[:, : capture.meta.block_tables.shape[1]] = capture.meta.block_tables
    static.meta = as_graph_replay(dataclasses.replace(capture.meta, block_tables=tables, max_seqlen_k=width * bs))
    backend.forward(static.q, static.k, static.v, static.cache, static.meta, SCALE)  # warm-up: compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(static.q, static.k, static.v, static.cache, static.meta, SCALE)
    for seed, lens in ((1, [3000, 1, 64, 65, 1234, 7]), (2, [5, 2999, 128, 640, 1, 77, 3100, 900])):
        n = len(lens)
        step = make_step([(c - 1, 1) for c in lens], hq, hkv, d, bs, seed=seed, num_blocks=num_blocks, device="cuda")
        lo, hi = _to_bf16(step)
        ref_cache = KVCache(hi.cache.k.clone(), hi.cache.v.clone())
        ref = TorchAttention().forward(hi.q, hi.k, hi.v, ref_cache, step.meta, SCALE)
        for name in ("q", "k", "v"):
            getattr(static, name)[:n].copy_(getattr(lo, name))
        static.cache.k.copy_(lo.cache.k)
        static.cache.v.copy_(lo.cache.v)
        meta, m = static.meta, step.meta
        meta.slot_mapping[:n].copy_(m.slot_mapping)
        meta.slot_mapping[n:].fill_(-1)
        meta.seq_lens[:n].copy_(m.seq_lens)
        meta.seq_lens[n:].fill_(1)
        meta.block_tables.zero_()
        meta.block_tables[:n, : m.block_tables.shape[1]].copy_(m.block_tables)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not out[:n].isnan().any() and rel_err(out[:n], ref) < 1e-2, f"replay {seed}"
        assert torch.equal(static.cache.k.float(), ref_cache.k) and torch.equal(static.cache.v.float(), ref_cache.v)
