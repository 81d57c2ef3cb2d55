"""The few-token FP8 kernel (nanostream.kernels.fp8_gemv): x in its own dtype times an e4m3 weight with its
scales, against float64 matmuls of x and the dequantized weight, in the layouts FP8 checkpoints use (block-wise
128-column groups, per-channel, per-tensor), 1 to 4 rows, shapes no tile divides, K split (empty splits too),
a bias, and the same bits from call to call; with the MLP's activation in its epilogue, the bits of the GEMV
and then norm_act's kernel. On the CPU under Triton's interpreter; gpu-marked cases compiled at Qwen3-8B's
shapes, eager and in a CUDA graph (a split K too), and through the layer (fp8_linear) against torch."""

import pytest
import torch
import torch.nn.functional as F

from nanostream.kernels.fp8_gemv import fp8_gemv
from nanostream.kernels.fp8_gemv_config import GemvConfig, gemv_config, gemv_takes
from nanostream.kernels.norm_act import act_and_mul
from tests.test_fp8_gemm import dequantized, quantize_weight

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("layout", ["block", "channel", "tensor"])
@pytest.mark.parametrize("m", [1, 3, 4])
def test_gemv_matches_the_dequantized_product(layout, m):
    # N = 80: tiles of 32 leave a partial one; K = 600: 4 groups and a partial fifth; steps of 1 or 2 groups
    # split 1, 2, 3 and 7 ways (7 > the 3 steps of 256: empty splits); a bias with the odd counts
    n, k = 80, 600
    gen = torch.Generator().manual_seed(m + len(layout))
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) * 0.05
    bias = torch.randn(n, generator=gen)
    block = {"block": (128, 128), "channel": (1, k), "tensor": (n, k)}[layout]
    wq, ws = quantize_weight(w, block)
    ref = x.double() @ dequantized(wq, ws, block).T
    for groups, splits in [(1, 1), (2, 2), (1, 3), (2, 7)]:
        b = bias.to(DEVICE) if splits % 2 else None
        cfg = GemvConfig(32, groups, 4, 2, splits)
        out = fp8_gemv(x.to(DEVICE), wq.to(DEVICE), ws.to(DEVICE), block, bias=b, config=cfg)
        want = ref if b is None else ref + bias.double()
        assert out.shape == (m, n) and out.dtype == torch.float32
        torch.testing.assert_close(out.cpu().double(), want, rtol=1e-5, atol=1e-5, msg=f"{cfg}")


def test_gemv_in_bfloat16_is_bit_identical_run_to_run_and_near_the_float64_product():
    m, n, k = 2, 256, 8192  # the default config: 8 tiles, K (16 steps of 512) split 4 ways
    cfg = gemv_config(n, k, 132)
    assert cfg.split_k > 1
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(m, k, generator=gen).bfloat16()
    wq, ws = quantize_weight(torch.randn(n, k, generator=gen) * 0.05, (128, 128))
    bias = torch.randn(n, generator=gen).bfloat16()
    args = x.to(DEVICE), wq.to(DEVICE), ws.to(DEVICE), (128, 128)
    out = fp8_gemv(*args, bias=bias.to(DEVICE))
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, fp8_gemv(*args, bias=bias.to(DEVICE)))
    ref = x.double() @ dequantized(wq, ws, (128, 128)).T + bias.double()
    torch.testing.assert_close(out.cpu(), ref.bfloat16())


def test_gemv_takes_few_rows_of_the_layouts_it_reads():
    assert gemv_takes(1, (128, 128), 4096) and gemv_takes(4, (1, 4096), 4096) and gemv_takes(2, (96, 96), 64)
    assert not gemv_takes(5, (128, 128), 4096)  # more tokens: the tensor-core GEMMs
    assert not gemv_takes(0, (128, 128), 4096)
    assert not gemv_takes(1, (64, 64), 4096)  # a step's scale covers 128 columns
    assert not gemv_takes(1, (48, 128), 4096)  # a tile of 32 rows would straddle two scale rows
    assert gemv_takes(1, (48, 128), 4096, block_n=16)  # a fused [gate | up]'s tile of 32: 16 of each
    with pytest.raises(AssertionError, match="does not take"):
        fp8_gemv(torch.zeros(5, 128), torch.zeros(32, 128).to(torch.float8_e4m3fn), torch.ones(1, 1), (128, 128))


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("layout", ["block", "channel"])
def test_gated_gemv_is_the_gemv_then_the_activation_kernel_bit_for_bit(act, layout):
    # A fused [gate | up] of 2 x I rows (I whole blocks of the scales' rows; per-channel: I = 88, a partial tile
    # of pairs), K = 600; one split (the fused epilogue) in tiles of 32 and 16 rows, with and without a bias,
    # and a split K (the sum, then norm_act's kernel); in bfloat16, whose roundings (each projection's, then
    # act(gate)'s) the epilogue must repeat.
    k = 600
    m, (block, inter) = 2, {"block": ((128, 128), 128), "channel": ((1, k), 88)}[layout]
    gen = torch.Generator().manual_seed(len(act) + len(layout))
    x = torch.randn(m, k, generator=gen).bfloat16().to(DEVICE)
    w = torch.randn(2 * inter, k, generator=gen) * 0.05
    wq, ws = (t.to(DEVICE) for t in quantize_weight(w, block))
    bias = torch.randn(2 * inter, generator=gen).bfloat16().to(DEVICE)
    torch_act = {"silu": F.silu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh")}[act]
    for cfg, b in [((32, 2, 4, 2, 1), None), ((16, 1, 4, 2, 1), bias), ((32, 1, 4, 2, 3), bias)]:
        got = fp8_gemv(x, wq, ws, block, bias=b, config=cfg, act=act)
        y = fp8_gemv(x, wq, ws, block, bias=b, config=cfg)
        assert got.shape == (m, inter) and got.dtype == torch.bfloat16
        assert torch.equal(got, act_and_mul(y, act == "gelu_tanh")), cfg
        gate, up = y.float().chunk(2, -1)  # torch's activation of the same projection: within two bf16 roundings
        torch.testing.assert_close(got.float(), (torch_act(gate).bfloat16().float() * up), rtol=2e-2, atol=1e-2)


@pytest.mark.parametrize("sms", [132, 78])
def test_gemv_config_splits_k_only_for_narrow_layers(sms):
    for n, k in [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]:  # Qwen3-8B's projections
        assert gemv_config(n, k, sms).split_k == 1, (n, k)  # 128 tiles of 32 or more: every SM streams
    narrow = gemv_config(256, 16384, sms)  # 8 tiles: K splits until the SMs are busy, 4 steps a split at least
    assert narrow.split_k == min(-(-sms // 8), 16384 // 512 // 4) > 1
    assert gemv_config(256, 1024, sms).split_k == 1  # 2 steps: too few to split


@pytest.mark.parametrize(
    "n, sms, block_n",
    [
        (6144, 132, 16),  # Qwen3-8B's qkv_proj, H100/H200: 192 tiles of 32 (1.45 waves), 384 of 16 (2.91)
        (4096, 132, 32),  # its o_proj and down_proj: 128 tiles of 32, one wave nearly whole (16 rows: the same share)
        (6144, 78, 16),  # 192 tiles of 32 on 78 SMs: 2.46 waves; 384 of 16: 4.92
        (4096, 78, 32),  # 128 tiles: 1.64 waves either way
        (2048, 132, 16),  # 64 tiles, K too short to split: 128 programs of 16 rows
    ],
)
def test_gemv_config_takes_16_row_tiles_where_they_fill_the_last_wave(n, sms, block_n):
    cfg = gemv_config(n, 2048, sms)
    assert (cfg.block_n, cfg.split_k) == (block_n, 1), cfg


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("n, k", [(6144, 4096), (24576, 4096), (4096, 12288)])
@pytest.mark.parametrize("layout", ["block", "channel"])
def test_gemv_at_qwen3_8b_shapes_eager_and_in_a_cuda_graph_gpu(m, n, k, layout):
    gen = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, k, generator=gen).bfloat16()
    block = (128, 128) if layout == "block" else (1, k)
    wq, ws = quantize_weight(torch.randn(n, k, generator=gen) * 0.02, block)
    ref = x.double() @ dequantized(wq, ws, block).T
    args = x.cuda(), wq.cuda(), ws.cuda(), block
    out = fp8_gemv(*args)
    assert ((out.cpu().double() - ref).norm() / ref.norm()).item() < 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fp8_gemv(*args)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, captured)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("inter, k", [(12288, 4096), (3072, 1024)])  # Qwen3-8B's and 0.6B's gate_up_proj
@pytest.mark.parametrize("layout", ["block", "channel"])
def test_gated_gemv_at_qwen3_shapes_is_the_two_kernels_within_a_rounding_eager_and_in_a_graph_gpu(inter, k, layout):
    gen = torch.Generator().manual_seed(inter)
    x = torch.randn(1, k, generator=gen).bfloat16().cuda()
    block = (128, 128) if layout == "block" else (1, k)
    wq, ws = (t.cuda() for t in quantize_weight(torch.randn(2 * inter, k, generator=gen) * 0.02, block))
    want = act_and_mul(fp8_gemv(x, wq, ws, block), False)
    got = fp8_gemv(x, wq, ws, block, act="silu")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fp8_gemv(x, wq, ws, block, act="silu")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, got)
    # compiled, a row's group sums may be multiply-added in another order than the plain tile's: a last-bit
    # difference in a few outputs (a gate's or an up's rounding, then the product's), never more
    differ = got != want
    assert differ.float().mean().item() < 0.01, differ.float().mean().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("splits", [2, 3, 8])
@pytest.mark.parametrize("act", [None, "silu"])
def test_split_gemv_gives_the_same_bits_every_launch_and_graph_replay_gpu(splits, act):
    # Compiled at Qwen3-8B's down_proj (and a gate_up of 4,096 pairs) in 64-row tiles, K split: within a rounding
    # of one split, and the same bits in 20 eager launches and 50 replays of a CUDA graph.
    n, k = (8192, 4096) if act else (4096, 12288)
    gen = torch.Generator().manual_seed(splits)
    x = torch.randn(1, k, generator=gen).bfloat16().cuda()
    wq, ws = (t.cuda() for t in quantize_weight(torch.randn(n, k, generator=gen) * 0.02, (128, 128)))
    cfg = GemvConfig(64, 2, 4, 3, splits)
    one = fp8_gemv(x, wq, ws, (128, 128), config=cfg._replace(split_k=1), act=act).float()
    first = fp8_gemv(x, wq, ws, (128, 128), config=cfg, act=act)
    assert ((first.float() - one).norm() / one.norm()).item() < 4e-3  # another order of float32 sums
    for _ in range(20):
        assert torch.equal(fp8_gemv(x, wq, ws, (128, 128), config=cfg, act=act), first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fp8_gemv(x, wq, ws, (128, 128), config=cfg, act=act)
    for _ in range(50):
        captured.zero_()
        graph.replay()
        assert torch.equal(captured, first)


def _norm_chain_error(out: torch.Tensor, h: torch.Tensor, g: torch.Tensor, offset, w_deq, act: bool = False) -> float:
    # The relative error of ``out`` against float64 arithmetic on the same h (the residual sum) and weights
    x = h.double() * torch.rsqrt(h.double().pow(2).mean(-1, keepdim=True) + 1e-6) * (g.double() + (offset or 0.0))
    y = x @ w_deq.T
    if act:
        gate, up = y.chunk(2, -1)
        y = F.silu(gate) * up
    return ((out.cpu().double() - y).norm() / y.norm()).item()


@pytest.mark.parametrize("offset", [None, 1.0])  # Llama's norm, Gemma's (1 + weight)
@pytest.mark.parametrize("layout", ["block", "channel"])
@pytest.mark.parametrize("m", [1, 3])
def test_gemv_add_norm_leaves_the_norm_to_the_next_gemv_within_a_rounding(offset, layout, m):
    # A projection of H = 200 outputs (tiles of 32: a partial seventh; of 16 with a bias) ends in the residual
    # add and RMSNorm, its 1 / rms left to the next GEMV (a projection of 96, the gated one of 2 x 128, a split
    # K): the residual is the norm kernel's bits, and the next GEMV's result as near float64 arithmetic on that
    # residual as the norm kernel and the GEMV one after the other, or nearer (a rounding fewer).
    from nanostream.kernels.fp8_gemv import fp8_gemv_add_norm
    from nanostream.kernels.norm_act import rms_norm

    h, k = 200, 600
    gen = torch.Generator().manual_seed(m + len(layout))
    block_of = {"block": lambda k_: (128, 128), "channel": lambda k_: (1, k_)}[layout]
    x = torch.randn(m, k, generator=gen).bfloat16().to(DEVICE)
    residual = (3 * torch.randn(m, h, generator=gen)).bfloat16().to(DEVICE)
    g = (1 + 0.3 * torch.randn(h, generator=gen)).bfloat16().to(DEVICE)
    bias = torch.randn(h, generator=gen).bfloat16().to(DEVICE)
    wq, ws = (t.to(DEVICE) for t in quantize_weight(torch.randn(h, k, generator=gen) * 0.05, block_of(k)))
    nexts = []
    for n in (96, 256):
        q, s = quantize_weight(torch.randn(n, h, generator=gen) * 0.05, block_of(h))
        nexts.append((q.to(DEVICE), s.to(DEVICE), dequantized(q, s, block_of(h))))
    for cfg, b in [((32, 2, 4, 2, 1), None), ((16, 1, 4, 2, 1), bias)]:
        pending, res = fp8_gemv_add_norm(x, wq, ws, block_of(k), b, residual, g, 1e-6, offset, config=cfg)
        normed, res_ref = rms_norm(fp8_gemv(x, wq, ws, block_of(k), bias=b, config=cfg), g, 1e-6, residual, offset)
        assert res.dtype == torch.bfloat16 and torch.equal(res, res_ref), cfg
        assert pending.sumsq.shape == (m, -(-h // cfg[0]))
        cases = [(nexts[0], None, None), (nexts[1], "silu", None), (nexts[0], None, (32, 1, 4, 2, 2))]
        for (q, s, deq), act, nxt in cases:
            got = fp8_gemv(pending, q, s, block_of(h), config=nxt, act=act)
            want = fp8_gemv(normed, q, s, block_of(h), config=nxt, act=act)
            assert got.dtype == torch.bfloat16 and got.shape == want.shape
            assert torch.equal(got, fp8_gemv(pending, q, s, block_of(h), config=nxt, act=act))
            err, err_ref = (_norm_chain_error(o, res_ref, g, offset, deq, act is not None) for o in (got, want))
            # (bf16 roundings: the output's, ~2e-3; with the activation also the gate's and the up's)
            assert err < (3e-2 if act else 1e-2) and err <= err_ref * 1.1, (cfg, act, nxt, err, err_ref)


def test_gemv_add_norm_in_a_float16_model_keeps_a_product_past_float16s_range():
    # A float16 model whose residual and norm weight are large (h x weight ~ 4e5, past float16's 65,504, while
    # h / rms x weight is ~500): the pending product is kept in float32, and the next GEMV's result is finite and
    # as near float64 arithmetic as the norm kernel then the GEMV.
    from nanostream.kernels.fp8_gemv import fp8_gemv_add_norm
    from nanostream.kernels.norm_act import rms_norm

    h, k = 128, 256
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, k, generator=gen).half().to(DEVICE)
    residual = (800 + 50 * torch.randn(1, h, generator=gen)).half().to(DEVICE)
    g = (500 + 20 * torch.randn(h, generator=gen)).half().to(DEVICE)
    wq, ws = (t.to(DEVICE) for t in quantize_weight(torch.randn(h, k, generator=gen) * 0.05, (128, 128)))
    q, s = quantize_weight(torch.randn(64, h, generator=gen) * 0.05, (128, 128))
    deq = dequantized(q, s, (128, 128))
    pending, res = fp8_gemv_add_norm(x, wq, ws, (128, 128), None, residual, g, 1e-6)
    assert pending.x.dtype == torch.float32 and pending.x.abs().max().item() > 65504
    got = fp8_gemv(pending, q.to(DEVICE), s.to(DEVICE), (128, 128))
    normed, res_ref = rms_norm(fp8_gemv(x, wq, ws, (128, 128)), g, 1e-6, residual)
    want = fp8_gemv(normed, q.to(DEVICE), s.to(DEVICE), (128, 128))
    assert got.dtype == torch.float16 and torch.isfinite(got).all() and torch.equal(res, res_ref)
    err, err_ref = (_norm_chain_error(o, res_ref.float(), g.float(), None, deq) for o in (got, want))
    assert err < 1e-2 and err <= err_ref * 1.1, (err, err_ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("producer, consumer", [((4096, 4096), 24576), ((4096, 12288), 6144)])
def test_gemv_add_norm_at_qwen3_8b_shapes_eager_and_in_a_cuda_graph_gpu(producer, consumer):
    # o_proj into mlp_in's norm into gate_up_proj (its SiLU too), down_proj into the next input_layernorm into
    # qkv_proj, compiled at the tiles gemv_config picks: the residual is the norm kernel's bits, the next GEMV
    # within a rounding of the norm kernel and the GEMV one after the other, the same bits in a graph's replays.
    from nanostream.kernels.fp8_gemv import fp8_gemv_add_norm
    from nanostream.kernels.norm_act import rms_norm

    (h, k), act = producer, "silu" if consumer == 24576 else None
    gen = torch.Generator().manual_seed(h + k)
    x, residual = torch.randn(1, k, generator=gen).bfloat16().cuda(), torch.randn(1, h, generator=gen).bfloat16().cuda()
    g = (1 + 0.3 * torch.randn(h, generator=gen)).bfloat16().cuda()
    wq, ws = (t.cuda() for t in quantize_weight(torch.randn(h, k, generator=gen) * 0.02, (128, 128)))
    q, s = (t.cuda() for t in quantize_weight(torch.randn(consumer, h, generator=gen) * 0.02, (128, 128)))

    def fused():
        pending, res = fp8_gemv_add_norm(x, wq, ws, (128, 128), None, residual, g, 1e-6)
        return fp8_gemv(pending, q, s, (128, 128), act=act), res

    got, res = fused()
    normed, res_ref = rms_norm(fp8_gemv(x, wq, ws, (128, 128)), g, 1e-6, residual)
    want = fp8_gemv(normed, q, s, (128, 128), act=act)
    assert torch.equal(res, res_ref)
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, captured_res = fused()
    for _ in range(20):
        captured.zero_()
        graph.replay()
        assert torch.equal(captured, got) and torch.equal(captured_res, res)
