"""The Triton kernels against a float64 torch reference on fresh random inputs.

On CPU they run under Triton's interpreter (small shapes, float32); on a GPU the same tests run the
compiled kernels, plus gpu-marked ones at realistic sizes in bfloat16 and float32. Outputs are
poisoned with NaN first, so an element the kernel never wrote fails.
"""

import pytest
import torch
import torch.nn.functional as F

from nanostream.kernels.decode_attention import paged_decode_attention
from nanostream.kernels.norm_act import rms_norm, silu_and_mul
from nanostream.kernels.prefill_attention import paged_prefill_attention
from nanostream.kernels.qkv_prologue import qkv_prologue
from nanostream.kernels.store_kv import store_kv
from nanostream.layers.activation import SiluAndMul
from nanostream.layers.norm import RMSNorm
from nanostream.layers.rotary import RopeSpec, RotaryEmbedding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(out, ref):
    assert not out.isnan().any(), "an output element was never written (or is NaN)"
    return ((out.double() - ref).norm() / ref.norm()).item()


def randn(shape, dtype, gen):
    """Normal values made on DEVICE (a GPU case holds ~10^9 of them), seeded from the host generator ``gen``."""
    device_gen = torch.Generator(DEVICE).manual_seed(int(torch.randint(2**62, (1,), generator=gen)))
    return torch.randn(shape, generator=device_gen, device=DEVICE).to(dtype)


def paged_pool(context_lens, block_size, num_kv_heads, head_dim, dtype, gen):
    """A pool holding each sequence's context at randomly permuted blocks, and their block tables."""
    blocks = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks) + 3  # spare blocks that no table uses
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = randn(shape, dtype, gen)
    v = randn(shape, dtype, gen)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(context_lens), max(blocks) + 2, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[used : used + n]
        used += n
    return k, v, tables.to(DEVICE)


def reference(q, k_cache, v_cache, tables, cu_q, seq_lens, scale, window=None, sinks=None, chunk=None):
    """float64 causal attention of each sequence's last queries over its context; [T, Hq, D].

    ``window``: a query at position p sees only the keys at (p - window, p]; ``chunk``: only those of its chunk,
    [p - p % chunk, p]. ``sinks`` [Hq]: each query
    head's logit joins its softmax denominator, out = sum e^s v / (sum e^s + e^sink)."""
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    bs = k_cache.shape[1]
    for i, n in enumerate(seq_lens.tolist()):
        s, e = cu_q[i], cu_q[i + 1]
        rows = tables[i, : -(-n // bs)].long()
        k = k_cache[rows].flatten(0, 1)[:n].double().transpose(0, 1)  # [Hkv, n, D]
        v = v_cache[rows].flatten(0, 1)[:n].double().transpose(0, 1)
        q_pos = torch.arange(n - (e - s), n, device=q.device)
        mask = torch.arange(n, device=q.device)[None, :] <= q_pos[:, None]
        if window is not None:
            mask &= torch.arange(n, device=q.device)[None, :] > q_pos[:, None] - window
        if chunk is not None:
            mask &= torch.arange(n, device=q.device)[None, :] >= (q_pos - q_pos % chunk)[:, None]
        qi = q[s:e].double().transpose(0, 1)  # [Hq, Lq, D]
        if sinks is None:
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        else:
            group = qi.shape[0] // k.shape[0]
            k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
            logits = (qi @ k.transpose(1, 2) * scale).masked_fill(~mask, float("-inf"))  # [Hq, Lq, n]
            sink = sinks.double()[:, None, None]
            top = torch.maximum(logits.amax(-1, keepdim=True), sink)
            weights = (logits - top).exp()
            o = weights @ v / (weights.sum(-1, keepdim=True) + (sink - top).exp())
        out[s:e] = o.transpose(0, 1)
    return out


def make_sinks(hq, gen):
    """Sink logits [Hq] float32 around the attention logits' size; the last head's is -inf (no sink)."""
    sinks = 2 * torch.randn(hq, generator=gen)
    sinks[-1] = float("-inf")
    return sinks.to(DEVICE)


def run_decode(
    seq_lens, heads, head_dim, block_size, dtype, seed, max_seq_len=None, window=None, sinks=False, chunk=None
):
    gen = torch.Generator().manual_seed(seed)
    hq, hkv = heads
    k, v, tables = paged_pool(seq_lens, block_size, hkv, head_dim, dtype, gen)
    q = randn((len(seq_lens), hq, head_dim), dtype, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5
    extra = dict(window=window, sinks=make_sinks(hq, gen) if sinks else None, chunk=chunk)
    paged_decode_attention(q, k, v, tables, lens, scale, max_seq_len or max(seq_lens), out=out, **extra)
    return rel_err(out, reference(q, k, v, tables, list(range(len(seq_lens) + 1)), lens, scale, **extra))


def run_prefill(
    q_lens, prefix_lens, heads, head_dim, block_size, dtype, seed, config=None, window=None, sinks=False, chunk=None
):
    gen = torch.Generator().manual_seed(seed)
    hq, hkv = heads
    seq_lens = [a + b for a, b in zip(q_lens, prefix_lens)]
    k, v, tables = paged_pool(seq_lens, block_size, hkv, head_dim, dtype, gen)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    q = randn((cu[-1], hq, head_dim), dtype, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5
    extra = dict(window=window, sinks=make_sinks(hq, gen) if sinks else None, chunk=chunk)
    paged_prefill_attention(q, k, v, cu_t, lens, tables, max(q_lens), scale, out=out, config=config, **extra)
    return rel_err(out, reference(q, k, v, tables, cu, lens, scale, **extra))


def run_prologue(num_tokens, heads, head_dim, norm, dtype, seed, padding=(0,)):
    """The fused prologue against nanostream's RMSNorm and rotary modules in float64, and a plain store.
    Returns the relative errors of q and of the stored k, and checks v and the untouched slots exactly."""
    gen = torch.Generator().manual_seed(seed)
    hq, hkv = heads
    qkv = randn((num_tokens, (hq + 2 * hkv) * head_dim), dtype, gen)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen).to(DEVICE)
    rotary = RotaryEmbedding(head_dim, 4096, RopeSpec(1e6)).to(DEVICE)
    norms = [RMSNorm(head_dim, 1e-6).to(DEVICE) for _ in range(2)]
    for n in norms:
        n.weight.data = (1 + 0.3 * randn((head_dim,), torch.float32, gen)).to(dtype)
    num_slots = num_tokens + 5
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[[p for p in padding if p < num_tokens]] = -1
    slots = slots.to(DEVICE)
    k_cache = torch.full((num_slots, 1, hkv, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    v_cache = k_cache.clone()
    out = torch.full((num_tokens, hq, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    weights = (norms[0].weight, norms[1].weight, 1e-6) if norm else (None, None, 0.0)
    q = qkv_prologue(qkv, positions, rotary.cos, rotary.sin, *weights, k_cache, v_cache, slots, hq, hkv, out=out)
    assert q is out

    ref_q, ref_k, ref_v = qkv.double().split([hq * head_dim, hkv * head_dim, hkv * head_dim], -1)
    ref_q, ref_k = ref_q.view(-1, hq, head_dim), ref_k.view(-1, hkv, head_dim)
    if norm:
        ref_q, ref_k = (n.double()(x) for n, x in zip(norms, (ref_q, ref_k)))
    ref_q, ref_k = rotary(positions, ref_q, ref_k)
    stored = slots >= 0
    flat_k, flat_v = k_cache.view(num_slots, hkv, head_dim), v_cache.view(num_slots, hkv, head_dim)
    assert torch.equal(flat_v[slots[stored]], ref_v.view(-1, hkv, head_dim)[stored].to(dtype))
    untouched = torch.ones(num_slots, dtype=torch.bool, device=DEVICE)
    untouched[slots[stored]] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()
    return rel_err(q, ref_q), rel_err(flat_k[slots[stored]], ref_k[stored])


def run_norm_act(num_tokens, hidden, intermediate, dtype, seed):
    """rms_norm (with and without the residual) and silu_and_mul against the modules in float64;
    relative errors of (norm, norm with residual, new residual, SiLU-and-mul)."""
    gen = torch.Generator().manual_seed(seed)
    x, residual = randn((num_tokens, hidden), dtype, gen), randn((num_tokens, hidden), dtype, gen)
    norm = RMSNorm(hidden, 1e-6).to(DEVICE)
    norm.weight.data = (1 + 0.3 * randn((hidden,), torch.float32, gen)).to(dtype)
    ref = norm.double()
    plain = rms_norm(x, norm.weight.to(dtype), 1e-6)
    fused, new_residual = rms_norm(x, norm.weight.to(dtype), 1e-6, residual)
    ref_fused, ref_residual = ref(x.double(), residual.double())
    gate_up = randn((num_tokens, 2 * intermediate), dtype, gen)
    return (
        rel_err(plain, ref(x.double())),
        rel_err(fused, ref_fused),
        rel_err(new_residual, ref_residual),
        rel_err(silu_and_mul(gate_up), SiluAndMul()(gate_up.double())),
    )


# ---- small shapes: the interpreter on CPU, compiled kernels on a GPU ------------------------------


@pytest.mark.parametrize("num_tokens, hidden, intermediate", [(5, 64, 96), (3, 48, 1500)])
def test_norm_and_silu_kernels_match_modules(num_tokens, hidden, intermediate):
    # 48: a row narrower than its power-of-two tile; 1500: SiLU rows over two tiles, the last partial
    assert max(run_norm_act(num_tokens, hidden, intermediate, torch.float32, 5)) < 1e-5


@pytest.mark.parametrize(
    "num_tokens, heads, head_dim, norm",
    [
        (7, (4, 2), 16, True),  # Qwen3: QK-norm
        (5, (6, 6), 24, False),  # Qwen2: no norm; half a head (12) is not a power of two
        (3, (8, 1), 32, True),
    ],
)
def test_qkv_prologue_matches_modules(num_tokens, heads, head_dim, norm):
    q_err, k_err = run_prologue(num_tokens, heads, head_dim, norm, torch.float32, 4, padding=(1,))
    assert q_err < 1e-5 and k_err < 1e-5


@pytest.mark.parametrize(
    "seq_lens, heads, head_dim, block_size, max_seq_len",
    [
        ([1, 37, 200], (4, 2), 16, 16, None),  # several splits per sequence
        ([70, 5], (8, 1), 32, 5, None),  # block size not a power of two, GQA 8
        ([3, 30, 1, 9], (6, 6), 16, 1, None),  # one token per block, no grouping
        ([600], (4, 2), 64, 256, 4096),  # a loose upper bound, as under CUDA graphs
    ],
)
def test_decode_attention_matches_reference(seq_lens, heads, head_dim, block_size, max_seq_len):
    assert run_decode(seq_lens, heads, head_dim, block_size, torch.float32, 0, max_seq_len) < 1e-5


@pytest.mark.parametrize(
    "q_lens, prefix_lens, heads, head_dim, block_size",
    [
        ([5, 70, 1], [0, 30, 100], (4, 2), 16, 16),  # fresh, chunked/prefix-hit, and a decode row
        ([33, 2], [7, 0], (8, 1), 32, 5),
        ([20], [3], (2, 2), 16, 1),
        ([130], [300], (4, 2), 64, 256),  # several query tiles after a long cached prefix
    ],
)
def test_prefill_attention_matches_reference(q_lens, prefix_lens, heads, head_dim, block_size):
    assert run_prefill(q_lens, prefix_lens, heads, head_dim, block_size, torch.float32, 1) < 1e-5


@pytest.mark.parametrize("config", [(16, 16, 4, 1), (32, 64, 4, 2)])
def test_prefill_attention_tile_shapes(config):
    # Tiles smaller and larger than the prompts, so queries straddle tiles and key tiles end mid-block.
    assert run_prefill([40, 3], [25, 9], (4, 2), 16, 8, torch.float32, 2, config) < 1e-5


@pytest.mark.parametrize(
    "seq_lens, heads, head_dim, block_size, window, sinks",
    [
        ([1, 37, 200], (4, 2), 16, 16, 16, False),  # one split: the window is the whole range
        ([70, 5, 300], (8, 1), 32, 5, 100, False),  # two splits over a window that starts mid-block
        ([3, 30, 1, 9], (6, 6), 16, 1, 3, True),  # a window shorter than most contexts, with sinks
        ([1500, 700], (4, 2), 16, 16, 1000, True),  # 16 splits over the window: the sink counted once
        ([1, 37, 200], (4, 2), 16, 16, None, True),  # sinks over several splits of the whole context
        ([600, 2], (4, 2), 64, 256, 1, False),  # each query sees itself only; a loose bound, as under graphs
    ],
)
def test_decode_attention_window_and_sinks(seq_lens, heads, head_dim, block_size, window, sinks):
    max_seq_len = 4096 if window == 1 else None
    assert run_decode(seq_lens, heads, head_dim, block_size, torch.float32, 3, max_seq_len, window, sinks) < 1e-5


@pytest.mark.parametrize(
    "q_lens, prefix_lens, heads, head_dim, block_size, window, sinks, config",
    [
        ([5, 70, 1], [0, 30, 100], (4, 2), 16, 16, 16, True, None),  # fresh, chunk and a decode row
        ([33, 2], [7, 0], (8, 1), 32, 5, 3, False, None),
        ([20], [3], (2, 2), 16, 1, 1, True, None),
        ([130], [300], (4, 2), 64, 256, 100, False, None),  # query tiles after a long prefix, masked both ends
        ([40, 3], [25, 9], (4, 2), 16, 8, 3, True, (16, 16, 4, 1)),  # windows inside one key tile
        ([70, 3], [60, 200], (4, 2), 16, 8, 37, False, (32, 16, 4, 1)),  # unmasked tiles between masked ones
        ([40, 3], [25, 9], (4, 2), 16, 8, 1000, True, (32, 64, 4, 2)),  # a window past every context
    ],
)
def test_prefill_attention_window_and_sinks(q_lens, prefix_lens, heads, head_dim, block_size, window, sinks, config):
    err = run_prefill(q_lens, prefix_lens, heads, head_dim, block_size, torch.float32, 4, config, window, sinks)
    assert err < 1e-5


@pytest.mark.parametrize(
    "seq_lens, block_size, chunk, window",
    [
        ([1, 37, 200, 64, 65], 16, 32, None),  # a context at, just past and well past a chunk edge
        ([1500, 700, 129], 16, 128, None),  # several splits over a long context, the last chunk partial
        (
            [70, 5, 300],
            5,
            48,
            20,
        ),  # a window inside the chunk: the later start wins
        ([600, 2], 256, 1, None),  # each query sees itself only
    ],
)
def test_decode_attention_chunks(seq_lens, block_size, chunk, window):
    # Llama 4's chunked local attention: the query sees only its own chunk's keys
    assert run_decode(seq_lens, (4, 2), 16, block_size, torch.float32, 5, 4096, window, True, chunk) < 1e-5


@pytest.mark.parametrize(
    "q_lens, prefix_lens, block_size, chunk, config",
    [
        ([5, 70, 1], [0, 30, 100], 16, 32, None),  # a chunk edge inside a prompt, a prefix and a decode row
        ([130], [300], 8, 64, (32, 16, 4, 1)),  # query tiles straddling chunk edges, unmasked tiles between
        ([40, 3], [25, 9], 8, 7, (16, 16, 4, 1)),  # chunks smaller than a tile
        ([200], [0], 16, 1000, (32, 64, 4, 2)),  # a chunk past the context: causal attention
    ],
)
def test_prefill_attention_chunks(q_lens, prefix_lens, block_size, chunk, config):
    err = run_prefill(q_lens, prefix_lens, (4, 2), 16, block_size, torch.float32, 6, config, None, False, chunk)
    assert err < 1e-5


def test_store_kv_writes_each_slot_and_skips_padding():
    gen = torch.Generator().manual_seed(2)
    tokens, hkv, d, blocks, bs = 9, 2, 16, 6, 4
    qkv = torch.randn(tokens, (4 + 2 * hkv) * d, generator=gen).to(DEVICE)  # k, v are strided views
    k, v = qkv[:, 4 * d : (4 + hkv) * d].view(tokens, hkv, d), qkv[:, (4 + hkv) * d :].view(tokens, hkv, d)
    k_cache = torch.full((blocks, bs, hkv, d), float("nan"), device=DEVICE)
    v_cache = k_cache.clone()
    slots = torch.randperm(blocks * bs, generator=gen)[:tokens]
    slots[3] = -1
    store_kv(k, v, k_cache, v_cache, slots.to(DEVICE))
    flat_k, flat_v = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat_k[s], k[t]) and torch.equal(flat_v[s], v[t])
    written = {s for s in slots.tolist() if s >= 0}
    untouched = [s for s in range(blocks * bs) if s not in written]
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()


def test_launchers_reject_bad_layouts():
    q = torch.randn(2, 4, 16, device=DEVICE)
    cache = torch.randn(4, 16, 2, 16, device=DEVICE)
    tables = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(AssertionError):  # int64 block tables
        paged_decode_attention(q, cache, cache, tables.long(), lens, 0.25, 16)
    with pytest.raises(AssertionError):  # 3 query heads over 2 KV heads
        paged_decode_attention(q[:, :3], cache, cache, tables, lens, 0.25, 16)
    strided = cache.transpose(2, 3).contiguous().transpose(2, 3)  # the same shape, head_dim not unit-stride
    with pytest.raises(AssertionError):  # K must have unit stride in head_dim
        paged_decode_attention(q, strided, cache, tables, lens, 0.25, 16)
    with pytest.raises(AssertionError):  # V there or in the block's rows
        paged_prefill_attention(q, cache, strided, lens[:1].new_tensor([0, 1, 2]), lens, tables, 1, 0.25)
    with pytest.raises(AssertionError):  # cu_seqlens of the wrong length
        paged_prefill_attention(q, cache, cache, lens, lens, tables, 1, 0.25)
    qkv, pos = torch.randn(2, 8 * 16, device=DEVICE), torch.zeros(2, dtype=torch.int64, device=DEVICE)
    slots = pos
    cos = torch.randn(8, 8, device=DEVICE)
    with pytest.raises(AssertionError):  # qkv holds 4 + 2 * 2 heads, not 3 + 2 * 2
        qkv_prologue(qkv, pos, cos, cos, None, None, 0.0, cache, cache, slots, 3, 2)
    with pytest.raises(AssertionError):  # int32 positions
        qkv_prologue(qkv, pos.int(), cos, cos, None, None, 0.0, cache, cache, slots, 4, 2)


# ---- realistic sizes on a GPU ---------------------------------------------------------------------

gpu = pytest.mark.gpu
BF16_BOUND = 1e-2  # bf16 operands land between 1e-3 and 1e-2


@gpu
@pytest.mark.parametrize("dtype, bound", [(torch.bfloat16, BF16_BOUND), (torch.float32, 1e-5)])
@pytest.mark.parametrize("block_size", [16, 64, 256])
@pytest.mark.parametrize("heads", [(16, 8), (32, 4), (14, 2)])
def test_decode_attention_gpu(dtype, bound, block_size, heads):
    gen = torch.Generator().manual_seed(block_size + heads[0])
    for batch in (1, 8, 64, 256):
        lens = torch.randint(1, 3000, (batch,), generator=gen).tolist()
        assert run_decode(lens, heads, 128, block_size, dtype, batch) < bound
    assert run_decode([1, 5000, 7], heads, 128, block_size, dtype, 3, max_seq_len=32768) < bound


@gpu
@pytest.mark.parametrize("dtype, bound", [(torch.bfloat16, BF16_BOUND), (torch.float32, 1e-5)])
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("heads", [(16, 8), (32, 4)])
def test_prefill_attention_gpu(dtype, bound, block_size, heads):
    gen = torch.Generator().manual_seed(block_size)
    for batch in (1, 4, 16):
        q_lens = torch.randint(1, 2048, (batch,), generator=gen).tolist()
        prefixes = [0 if i % 3 == 0 else int(x) for i, x in enumerate(torch.randint(0, 3000, (batch,), generator=gen))]
        assert run_prefill(q_lens, prefixes, heads, 128, block_size, dtype, batch) < bound


@gpu
@pytest.mark.parametrize("dtype, bound", [(torch.bfloat16, BF16_BOUND), (torch.float32, 1e-5)])
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("window", [1, 128, 1000])
def test_window_and_sinks_gpu(dtype, bound, block_size, window):
    # gpt-oss's attention shape (64 query heads over 8 KV heads, head dim 64), with and without sinks
    gen = torch.Generator().manual_seed(window + block_size)
    for sinks in (False, True):
        for batch in (1, 64):
            lens = torch.randint(1, 5000, (batch,), generator=gen).tolist()
            assert run_decode(lens, (64, 8), 64, block_size, dtype, batch, 32768, window, sinks) < bound
        q_lens = torch.randint(1, 1500, (4,), generator=gen).tolist()
        prefixes = [0, 0, 700, 3000]
        assert run_prefill(q_lens, prefixes, (64, 8), 64, block_size, dtype, 5, None, window, sinks) < bound


@gpu
@pytest.mark.parametrize("dtype, bound", [(torch.bfloat16, BF16_BOUND), (torch.float32, 1e-5)])
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("chunk", [128, 8192])
def test_chunks_gpu(dtype, bound, block_size, chunk):
    # Llama 4 Scout's attention shape (40 query heads over 8 KV heads, head dim 128), contexts past chunk edges
    gen = torch.Generator().manual_seed(chunk + block_size)
    for batch in (1, 64):
        lens = torch.randint(1, 20000, (batch,), generator=gen).tolist()
        assert run_decode(lens, (40, 8), 128, block_size, dtype, batch, 32768, None, False, chunk) < bound
    q_lens = torch.randint(1, 3000, (4,), generator=gen).tolist()
    prefixes = [0, 0, 700, 9000]
    assert run_prefill(q_lens, prefixes, (40, 8), 128, block_size, dtype, 7, None, None, False, chunk) < bound


@gpu
@pytest.mark.parametrize("dtype, bound", [(torch.bfloat16, BF16_BOUND), (torch.float32, 1e-5)])
@pytest.mark.parametrize("heads, head_dim", [((16, 8), 128), ((32, 4), 128), ((14, 2), 64)])
@pytest.mark.parametrize("norm", [True, False])
def test_qkv_prologue_gpu(dtype, bound, heads, head_dim, norm):
    for num_tokens in (1, 256, 8192):
        q_err, k_err = run_prologue(num_tokens, heads, head_dim, norm, dtype, num_tokens, padding=(1, 100))
        assert q_err < bound and k_err < bound


@gpu
@pytest.mark.parametrize("dtype, bound", [(torch.bfloat16, BF16_BOUND), (torch.float32, 1e-5)])
@pytest.mark.parametrize("hidden, intermediate", [(1024, 3072), (4096, 12288), (2560, 9728)])
def test_norm_and_silu_kernels_gpu(dtype, bound, hidden, intermediate):
    for num_tokens in (1, 256, 8192):
        assert max(run_norm_act(num_tokens, hidden, intermediate, dtype, num_tokens)) < bound
