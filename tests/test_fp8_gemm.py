"""The FP8 GEMM kernels (nanostream.kernels.fp8_gemm) against float64 matmuls of the dequantized operands, in
the three layouts FP8 checkpoints use: block-wise weights with per-token-group activations, per-channel and
per-tensor weights with per-token activations. Shapes no block divides, so every edge tile is partial.

On the CPU they run under Triton's interpreter (whose float -> e4m3 cast can round a value differently from
torch's: the quantizer is checked against its own dequantized output, not torch's cast); gpu-marked
cases run them compiled at Qwen3-8B's projection shapes."""

import pytest
import torch

from nanostream.kernels.fp8_gemm import FP8, FP8_MAX, fp8_scaled_matmul, quantize_per_token_group

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


def test_launcher_rejects_mismatched_scales():
    xq, xs = quantize_per_token_group(torch.randn(4, 64, device=DEVICE), 32)
    wq = torch.zeros(16, 64, dtype=FP8, device=DEVICE)
    with pytest.raises(AssertionError):
        fp8_scaled_matmul(xq, xs, wq, torch.ones(1, 1, device=DEVICE), (16, 32), torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 64, 256, 4096])
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
