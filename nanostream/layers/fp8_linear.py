"""Linear layers whose weight stays in FP8 (an FP8 checkpoint's, on a GPU that multiplies float8 e4m3).

A kept weight is ``float8_e4m3fn`` [out, in] with ``weight_scale`` float32 [ceil(out / bo), ceil(in / bi)]:
one scale per ``block`` = (bo, bi) of it, its real value ``W × s``. Block-wise checkpoints keep their blocks
(128 x 128); per-channel and per-tensor ones become one scale per row, (1, in): a fused projection of
per-tensor parts (q, k, v) holds each part's scale on its rows, so nothing is requantized.

``fp8_linear`` is the layer's matmul. On CUDA one token (decode at batch 1, where a step is the weight's
streaming) multiplies the weight in the activation's own dtype (nanostream/kernels/fp8_gemv.py: no quantizer,
no tensor cores). More tokens have their activations quantized as they enter, per token and per
group of ``bi`` columns (per token for a per-row layout), and multiplied by an FP8 GEMM: the Triton
block-scaled kernel (nanostream/kernels/fp8_gemm.py) up to 64 tokens, torch's
block-scaled or row-wise scaled GEMM above. All run on the device alone, so CUDA graphs capture them.
Elsewhere (the CPU reference, tests) the weight is dequantized in the call and the activations stay as they
are: what a dequantized checkpoint computes.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from nanostream.layers.norm import RMSNorm

if TYPE_CHECKING:  # (the kernels import Triton: the layers import them where they run)
    from nanostream.kernels.fp8_gemv import PendingNorm

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
FP8_MIN_ARCH = (8, 9)  # float8 e4m3 tensor cores: Ada, Hopper, Blackwell


def fp8_gemm_available(device: torch.device) -> bool:
    """Whether ``device`` multiplies FP8 (a CUDA GPU of sm89 or newer); elsewhere FP8 weights dequantize on load."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_MIN_ARCH


def block_shape(block: tuple[int, int], out_features: int, in_features: int) -> tuple[int, int]:
    """The scales' shape of an [out, in] weight in blocks of ``block``."""
    return -(-out_features // block[0]), -(-in_features // block[1])


def expand_scale(scale: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    """Each entry of a weight of ``shape`` [..., out, in] given its block's scale (float32)."""
    rows, cols = shape[-2:]
    s = scale.float().repeat_interleave(block[0], dim=-2)[..., :rows, :]
    return s.repeat_interleave(block[1], dim=-1)[..., :cols]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The real values of an FP8 ``weight`` with its block ``scale``, float32."""
    return weight.float().mul_(expand_scale(scale, block, weight.shape))


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] in FP8 with one scale per block (its largest magnitude maps to 448): for random
    (dummy) weights and for an unquantized tensor that reaches a kept layer."""
    w = weight.float()
    rows, cols = w.shape
    bo, bi = block
    pad = (0, -cols % bi, 0, -rows % bo)
    tiles = F.pad(w, pad).reshape(-(-rows // bo), bo, -(-cols // bi), bi)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min_(1e-12)
    q = (w / expand_scale(scale, block, w.shape)).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def keep_fp8(layer: nn.Linear, block: tuple[int, int] | None) -> None:
    """Make ``layer``'s weight FP8 [out, in] with ``weight_scale`` per ``block`` (None: one per row), both
    empty until the checkpoint fills them."""
    out_features, in_features = layer.weight.shape
    block = block or (1, in_features)
    device = layer.weight.device
    layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8, device=device), requires_grad=False)
    shape = block_shape(block, out_features, in_features)
    layer.weight_scale = nn.Parameter(torch.ones(shape, dtype=torch.float32, device=device), requires_grad=False)
    layer.fp8_block = block


def gemv_runs(x: torch.Tensor | PendingNorm, block: tuple[int, int]) -> bool:
    """Whether ``fp8_linear`` multiplies ``x`` [..., in] by the weight-streaming kernel (CUDA, one token, a
    layout it reads): where it does, ``fp8_linear(..., act=)`` applies the MLP's activation in it. A
    ``PendingNorm`` only that kernel takes."""
    from nanostream.kernels.fp8_gemv_config import GEMV_ROWS, gemv_takes

    if not isinstance(x, torch.Tensor):  # a PendingNorm
        return True
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return x.is_cuda and m <= GEMV_ROWS and gemv_takes(m, block, x.shape[-1])


def norm_fuses(x: torch.Tensor, residual: torch.Tensor, block: tuple[int, int], n: int, then: tuple[int, int]) -> bool:
    """Whether a kept layer of ``n`` outputs in ``block``s can end its one-token GEMV of ``x`` in the residual add
    and RMSNorm after it (``fp8_linear_add_norm``), the next kept projection's (in ``then``'s blocks) taking the
    norm's 1 / rms: both GEMVs run (``gemv_runs``) and this one's K is not split."""
    from nanostream.kernels import fp8_gemv_config

    return (
        gemv_runs(x, block)
        and x.dim() == 2
        and residual.shape == (x.shape[0], n)
        and residual.dtype == x.dtype
        and gemv_runs(residual, then)
        and fp8_gemv_config.norm_fuses(n, x.shape[1], x.device)
    )


def fp8_linear_add_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    norm: RMSNorm,
) -> tuple[PendingNorm, torch.Tensor]:
    """``norm(fp8_linear(x, ...) + residual)`` but for the norm's 1 / rms, which the next GEMV applies (a
    ``PendingNorm`` it takes as its x), and the new residual: one kernel (only where ``norm_fuses``)."""
    from nanostream.kernels.fp8_gemv import fp8_gemv_add_norm

    return fp8_gemv_add_norm(x, weight, scale, block, bias, residual, norm.weight, norm.eps, norm.weight_offset)


def fp8_linear(
    x: torch.Tensor | PendingNorm,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None,
    act: str | None = None,
) -> torch.Tensor:
    """x [..., in] @ (weight × scale)ᵀ + bias, in x's dtype; with ``act`` ("silu", "gelu_tanh"; only where
    ``gemv_runs``) the weight is a fused [gate | up] projection and the result act(gate) * up. x may be a
    ``PendingNorm`` (``fp8_linear_add_norm``'s), its norm finished here."""
    if not isinstance(x, torch.Tensor):  # a PendingNorm
        from nanostream.kernels.fp8_gemv import fp8_gemv

        return fp8_gemv(x, weight, scale, block, bias, act=act)
    if not x.is_cuda:
        return F.linear(x, dequantize(weight, scale, block).to(x.dtype), bias)
    from nanostream.kernels.fp8_gemm import fp8_scaled_matmul, quantize_per_token_group
    from nanostream.kernels.fp8_gemv import fp8_gemv

    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    per_row = block[1] >= k
    m = x2.shape[0]
    assert act is None or gemv_runs(x, block), f"{m} tokens: the activation is fused into the one-token GEMV only"
    if gemv_runs(x, block):  # one token: the weight streamed against x as it is
        y = fp8_gemv(x2, weight, scale, block, bias, act=act)
    elif per_row and block[0] == 1 and m > TRITON_MAX_ROWS["row"] and _scaled_mm_takes(weight.shape, x.dtype):
        xq, xs = quantize_per_token_group(x2, k)
        y = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=scale.t(), bias=bias, out_dtype=x.dtype)
    elif block == (128, 128) and m > TRITON_MAX_ROWS["block"] and _block_scaled_mm_takes(weight.shape, x.dtype):
        # cuBLASLt's block-scaled GEMM takes whole groups of 16 rows: the activations padded
        xq, xs = quantize_per_token_group(x2, 128, pad_rows_to=16)
        y = _block_scaled_mm(xq, xs, weight, scale, x.dtype)[:m]
        if bias is not None:
            y += bias
    else:  # few tokens (or a shape torch refuses): the Triton GEMM, K split where N alone leaves SMs idle
        xq, xs = quantize_per_token_group(x2, k if per_row else block[1])
        y = fp8_scaled_matmul(xq, xs, weight, scale, block, x.dtype, bias=bias)
    return y.reshape(*lead, -1)


TRITON_MAX_ROWS = {"row": 64, "block": 64}
"""Up to these many tokens the Triton GEMM runs (faster where a step streams the weight: decode, K split to
fill the SMs), above them torch's (cuBLASLt's row-wise and block-wise scaled FP8 GEMMs: 1.5x the Triton
kernel's speed at 128-256 tokens on an H200 and 2x at 1,024, BENCHMARKS.md)."""


@functools.cache
def _scaled_mm_takes(shape: torch.Size, dtype: torch.dtype) -> bool:
    # cuBLASLt's row-wise scaled FP8 GEMM: both dimensions of the weight a multiple of 16, a 16-bit output
    n, k = shape
    return n % 16 == 0 and k % 16 == 0 and dtype in (torch.bfloat16, torch.float16)


def _block_scaled_mm(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, dtype):
    # 1 x 128 activation groups (scales column-major) times 128 x 128 weight blocks; the weight's [K, N] view's
    # scales are [K / 128, N / 128], column-major: the transposed view of the stored ones.
    blockwise = F.ScalingType.BlockWise1x128, F.ScalingType.BlockWise128x128
    return F.scaled_mm(xq, weight.t(), xs, blockwise[0], scale.t(), blockwise[1], output_dtype=dtype)


_BLOCK_SCALED_MM: dict[tuple, bool] = {}


def _block_scaled_mm_takes(shape: torch.Size, dtype: torch.dtype) -> bool:
    """Whether torch's block-scaled GEMM runs this weight shape (torch 2.10+ on sm90+, dims a multiple of 128,
    a 16-bit output): probed once per shape on the first call, outside any graph capture (the warm-up step)."""
    key = (tuple(shape), dtype)
    if key not in _BLOCK_SCALED_MM:
        n, k = shape
        ok = hasattr(F, "scaled_mm") and n % 128 == 0 and k % 128 == 0 and dtype in (torch.bfloat16, torch.float16)
        if ok and torch.cuda.is_current_stream_capturing():
            return False  # not probed yet: the Triton kernel, this once
        if ok:
            from nanostream.kernels.fp8_gemm import quantize_per_token_group

            try:  # a probe against the Triton kernel on random values
                w = torch.randn(n, k, device="cuda")
                wq, ws = quantize(w, (128, 128))
                xq, xs = quantize_per_token_group(torch.randn(48, k, device="cuda", dtype=dtype), 128)
                got = _block_scaled_mm(xq, xs, wq, ws, dtype).float()
                ref = (xq.float() * xs.repeat_interleave(128, 1)[:, :k]) @ dequantize(wq, ws, (128, 128)).T
                ok = bool(((got - ref).norm() / ref.norm()) < 1e-2)
            except (RuntimeError, ValueError, AttributeError):
                ok = False
        _BLOCK_SCALED_MM[key] = ok
    return _BLOCK_SCALED_MM[key]
