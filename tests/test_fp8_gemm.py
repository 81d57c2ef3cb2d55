"""The FP8 GEMM kernels (nanostream.kernels.fp8_gemm) against float64 matmuls of the dequantized operands, in
the three layouts FP8 checkpoints use: block-wise weights with per-token-group activations, per-channel and
per-tensor weights with per-token activations. Shapes no block divides, so every edge tile is partial. Split K
(the few-token form) in both kinds of scales along K: groups of 128 and one per row, with more splits than
steps (empty splits), a bias, and results bit-identical from call to call.

On the CPU they run under Triton's interpreter (whose float -> e4m3 cast can round a value differently from
torch's: the quantizer is checked against its own dequantized output, not torch's cast); gpu-marked
cases run them compiled at Qwen3-8B's projection shapes."""

import pytest
import torch

from nanostream.kernels.fp8_gemm import (
    FP8,
    FP8_MAX,
    Config,
    default_config,
    fp8_scaled_matmul,
    quantize_per_token_group,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def quantize_weight(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] as a checkpoint stores it: e4m3 values and one float32 scale per block."""
    bn, bk = block
    n, k = w.shape
    scale = torch.empty(-(-n // bn), -(-k // bk))
    q = torch.empty(w.shape, dtype=FP8)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            part = (slice(i * bn, (i + 1) * bn), slice(j * bk, (j + 1) * bk))
            scale[i, j] = w[part].abs().max() / FP8_MAX
            q[part] = (w[part] / scale[i, j]).to(FP8)
    return q, scale


def dequantized(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    bn, bk = block
    full = scale.repeat_interleave(bn, 0)[: q.shape[0]].repeat_interleave(bk, 1)[:, : q.shape[1]]
    return q.double() * full.double()


@pytest.mark.parametrize(
    "m, n, k, layout",
    [(1, 80, 72, "block"), (37, 100, 150, "block"), (5, 96, 64, "channel"), (20, 48, 200, "tensor")],
)
def test_scaled_matmul_matches_the_dequantized_product(m, n, k, layout):
    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) * 0.05
    block, group = {"block": ((32, 32), 32), "channel": ((1, k), k), "tensor": ((n, k), k)}[layout]
    wq, ws = quantize_weight(w, block)
    xq, xs = quantize_per_token_group(x.to(DEVICE), group)
    out = fp8_scaled_matmul(xq, xs, wq.to(DEVICE), ws.to(DEVICE), block, torch.float32)
    ref = dequantized(xq.cpu(), xs.cpu(), (1, group)) @ dequantized(wq, ws, block).T
    torch.testing.assert_close(out.cpu().double(), ref, rtol=1e-5, atol=1e-5)
    # and near the unquantized product: e4m3's 3 mantissa bits, some percent (the interpreter's cast, which
    # halves a few values, makes it 6-7% on the CPU)
    exact = x.double() @ w.double().T
    assert ((out.cpu().double() - exact).norm() / exact.norm()).item() < 0.1


def test_quantizer_scales_each_group_to_its_range():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 100, generator=gen) * torch.logspace(-3, 2, 6)[:, None]
    x[2, 40:80] = 0.0  # an all-zero group: zeros, not NaN
    q, scale = quantize_per_token_group(x.to(DEVICE), 40)
    q, scale = q.cpu(), scale.cpu()
    assert scale.shape == (6, 3) and q.dtype == FP8 and not q.float().isnan().any()
    assert q.float().abs().amax(1).max() <= FP8_MAX
    back = dequantized(q, scale, (1, 40))
    assert ((back - x.double()).norm() / x.double().norm()).item() < 0.05
    assert torch.equal(q[2, 40:80].float(), torch.zeros(40))


def test_quantizer_spans_programs_and_pads_rows_with_zeros():
    # 71 groups of 32 (the last one of 5 columns): more than one program's tile of groups, the second partial;
    # rows padded to 16 for cuBLASLt come back as zeros, the real rows as they are unpadded.
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(5, 32 * 70 + 5, generator=gen) * torch.logspace(-2, 1, 5)[:, None]).to(DEVICE)
    q, scale = quantize_per_token_group(x, 32)
    qp, sp = quantize_per_token_group(x, 32, pad_rows_to=16)
    assert qp.shape == (16, x.shape[1]) and sp.shape == (16, 71) and sp.stride() == (1, 16)
    assert torch.equal(qp[:5].view(torch.uint8), q.view(torch.uint8)) and torch.equal(sp[:5], scale)
    assert not qp[5:].float().any() and torch.isfinite(sp).all()
    groups = x.cpu().double().reshape(5, -1)[:, : 70 * 32].reshape(5, 70, 32)
    torch.testing.assert_close(scale[:, :70].cpu().double(), groups.abs().amax(2) / FP8_MAX, rtol=1e-6, atol=0)
    back = dequantized(q.cpu(), scale.cpu(), (1, 32))
    assert ((back - x.cpu().double()).norm(dim=1) / x.cpu().double().norm(dim=1)).max().item() < 0.05


def test_launcher_rejects_mismatched_scales():
    xq, xs = quantize_per_token_group(torch.randn(4, 64, device=DEVICE), 32)
    wq = torch.zeros(16, 64, dtype=FP8, device=DEVICE)
    with pytest.raises(AssertionError):
        fp8_scaled_matmul(xq, xs, wq, torch.ones(1, 1, device=DEVICE), (16, 32), torch.float32)


@pytest.mark.parametrize("layout", ["block", "row"])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("k", [256, 384, 1000])
def test_split_k_matches_the_dequantized_product(layout, m, k):
    # 128-column groups (K = 1000: the last one partial) or one scale per row over steps of 128 columns: 2, 3 or
    # 8 steps, so 3 and 5 splits leave some empty; a bias with splits 1, 3 and 5 (the GEMM's epilogue adds it
    # with one split, the sum with more)
    n = 48  # two N tiles of 32, the second partial
    gen = torch.Generator().manual_seed(m * k)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) * 0.05
    bias = torch.randn(n, generator=gen)
    block, group = {"block": ((128, 128), 128), "row": ((1, k), k)}[layout]
    wq, ws = quantize_weight(w, block)
    xq, xs = quantize_per_token_group(x.to(DEVICE), group)
    ref = dequantized(xq.cpu(), xs.cpu(), (1, group)) @ dequantized(wq, ws, block).T
    wq, ws = wq.to(DEVICE), ws.to(DEVICE)
    for splits in (1, 2, 3, 5):
        b = bias.to(DEVICE) if splits % 2 else None
        config = Config(16, 32, 128, 4, 4, splits)
        out = fp8_scaled_matmul(xq, xs, wq, ws, block, torch.float32, bias=b, config=config)
        want = ref if b is None else ref + bias.double()
        torch.testing.assert_close(out.cpu().double(), want, rtol=1e-5, atol=1e-5, msg=f"{splits} splits")


def test_default_split_k_in_bfloat16_with_bias_is_bit_identical_run_to_run():
    # 2 tokens, N = 128 (4 tiles), K = 2,048 (16 groups): default_config splits K 4 ways at 132 SMs, the
    # interpreter's count; the sum adds a bfloat16 bias and rounds to bfloat16
    m, n, k = 2, 128, 2048
    assert default_config(m, n, k, 132).split_k == 4
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(m, k, generator=gen)
    wq, ws = quantize_weight(torch.randn(n, k, generator=gen) * 0.05, (128, 128))
    bias = torch.randn(n, generator=gen).bfloat16()
    xq, xs = quantize_per_token_group(x.to(DEVICE), 128)
    args = xq, xs, wq.to(DEVICE), ws.to(DEVICE), (128, 128), torch.bfloat16
    out = fp8_scaled_matmul(*args, bias=bias.to(DEVICE))
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, fp8_scaled_matmul(*args, bias=bias.to(DEVICE)))
    ref = dequantized(xq.cpu(), xs.cpu(), (1, 128)) @ dequantized(wq, ws, (128, 128)).T + bias.double()
    torch.testing.assert_close(out.cpu(), ref.bfloat16())


@pytest.mark.parametrize("sms", [132, 78])
def test_default_config_splits_k_only_where_n_tiles_leave_sms_idle(sms):
    # Qwen3-8B's projections at decode: qkv, o, gate/up, down
    for n, k in [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]:
        for m in (1, 16):
            cfg = default_config(m, n, k, sms)
            tiles = -(-n // cfg.block_n)
            if tiles >= 2 * sms:
                assert cfg.split_k == 1, (n, k, m, cfg)
            else:  # ~3 programs per SM, each at least 4 groups of K
                assert 2 * sms <= tiles * cfg.split_k <= 4 * sms and k // 128 >= 4 * cfg.split_k, (n, k, m, cfg)
    assert default_config(1, 4096, 256, sms).split_k == 1  # 2 groups: too few to split
    # 17-64 tokens: one 64-row tile, K split while the programs stay within the SMs
    for n, k in [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]:
        for m in (17, 64):
            cfg = default_config(m, n, k, sms)
            programs = -(-n // cfg.block_n) * cfg.split_k
            assert cfg.block_m == 64 and (cfg.split_k == 1 or sms / 2 <= programs <= sms), (n, k, m, cfg)
    assert default_config(65, 4096, 12288, sms).split_k == 1  # past them: cuBLASLt's, or one wide tile


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 40, 64, 256, 4096])
@pytest.mark.parametrize("n, k", [(4096, 4096), (12288, 4096), (4096, 12288)])
def test_block_scaled_matmul_at_qwen3_8b_shapes_gpu(m, n, k):
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).cuda().bfloat16()
    w = (torch.randn(n, k, generator=gen) * 0.02).cuda()
    wq, ws = quantize_weight(w.cpu(), (128, 128))
    xq, xs = quantize_per_token_group(x, 128)
    out = fp8_scaled_matmul(xq, xs, wq.cuda(), ws.cuda(), (128, 128), torch.bfloat16)
    ref = dequantized(xq.cpu(), xs.cpu(), (1, 128)) @ dequantized(wq, ws, (128, 128)).T
    assert ((out.cpu().double() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 16, 48])
@pytest.mark.parametrize("layout", ["block", "row"])
def test_split_k_compiled_is_bit_identical_eager_and_in_a_cuda_graph_gpu(m, layout):
    # down_proj's shape at decode, split 1, 3 (the default at 132 SMs) and 8 ways, and the default config
    n, k = 4096, 12288
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).cuda().bfloat16()
    w = torch.randn(n, k, generator=gen) * 0.02
    block, group = {"block": ((128, 128), 128), "row": ((1, k), k)}[layout]
    wq, ws = quantize_weight(w, block)
    bias = torch.randn(n, generator=gen).cuda().bfloat16()
    xq, xs = quantize_per_token_group(x, group)
    ref = dequantized(xq.cpu(), xs.cpu(), (1, group)) @ dequantized(wq, ws, block).T + bias.cpu().double()
    args = xq, xs, wq.cuda(), ws.cuda(), block, torch.bfloat16
    for config in (*(Config(16, 32, 128, 4, 4, splits) for splits in (1, 3, 8)), None):  # None: the default's
        out = fp8_scaled_matmul(*args, bias=bias, config=config)
        assert ((out.cpu().double() - ref).norm() / ref.norm()).item() < 1e-2, config
        assert torch.equal(out, fp8_scaled_matmul(*args, bias=bias, config=config)), config
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fp8_scaled_matmul(*args, bias=bias, config=config)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, captured), config
