"""RMSNorm (with the residual add before it) and the gated activations (SiLU, tanh GELU), one Triton kernel each.

They do what ``nanostream.layers.norm.RMSNorm`` and ``nanostream.layers.activation.SiluAndMul`` do, with
the roundings of those modules run eagerly (Hugging Face's order of operations). Each costs a kernel
launch on the host, where a call into a torch.compile'd module costs its guards and wrappers: at
prefill, where the model runs eagerly, three such calls per layer made a step wait on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._device import pdl_launch, wait_for_producer


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_r, stride_o, stride_ro, eps, weight_offset,
    SIZE: tl.constexpr, BLOCK: tl.constexpr, RESIDUAL: tl.constexpr, F32_WEIGHT: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    # One program per row: s = x (+ residual), stored as the new residual; out = w * (s / rms(s)).
    wait_for_producer(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < SIZE
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if RESIDUAL:
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)).to(dtype)
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    r = tl.rsqrt(tl.sum(xf * xf, 0) / SIZE + eps)
    w = tl.load(w_ptr + offs, mask=mask).to(tl.float32)
    if F32_WEIGHT:  # OLMo 2, gpt-oss, Gemma (offset 1): the product with the weight in float32, then cast
        tl.store(out_ptr + row * stride_o + offs, (xf * r * (w + weight_offset)).to(dtype), mask=mask)
    else:  # Llama's order: the normalised value is cast to the model dtype before the weight
        tl.store(out_ptr + row * stride_o + offs, (w * (xf * r).to(dtype).to(tl.float32)).to(dtype), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    weight_offset: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``RMSNorm.forward``: ``norm(x)``, or with ``residual`` ``(norm(x + residual), x + residual)``.

    x, residual: [..., H] with unit stride in the last dimension; weight: [H]. Results are new tensors.
    ``weight_offset``: None rounds as Llama; a number multiplies by ``weight + offset`` in float32.
    """
    size = x.shape[-1]
    assert weight.shape == (size,), (weight.shape, x.shape)
    assert residual is None or (residual.shape == x.shape and residual.dtype == x.dtype), (residual.shape, x.shape)
    x2 = x.reshape(-1, size)
    assert x2.stride(-1) == 1, f"rows must be contiguous, got strides {x.stride()}"
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res = res_out = out  # unread and unwritten without a residual
    if residual is not None:
        res = residual.reshape(-1, size)
        assert res.stride(-1) == 1, f"residual rows must be contiguous, got strides {residual.stride()}"
        res_out = torch.empty_like(out)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res, weight, out, res_out,
            x2.stride(0), res.stride(0), out.stride(0), res_out.stride(0), eps, float(weight_offset or 0.0),
            SIZE=size, BLOCK=triton.next_power_of_2(size), RESIDUAL=residual is not None,
            F32_WEIGHT=weight_offset is not None, **pdl_launch(x.device),
            num_warps=min(max(triton.next_power_of_2(size) // 256, 1), 16),
        )  # fmt: skip
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), res_out.view(x.shape)


@triton.jit
def _act_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_o,
    SIZE: tl.constexpr, BLOCK: tl.constexpr, GELU_TANH: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # Program (row, tile): out[row, tile] = act(gate) * up, gate and up the two halves of x's row.
    wait_for_producer(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < SIZE
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + SIZE + offs, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * stride_o + offs, gated_act(gate, up, dtype, GELU_TANH), mask=mask)


@triton.jit
def gated_act(gate, up, dtype: tl.constexpr, GELU_TANH: tl.constexpr):
    """act(gate) * up in ``dtype`` from float32 ``gate`` and ``up`` (values of ``dtype``), rounded as eager torch
    rounds: act(gate) to ``dtype`` before the product (the FP8 GEMV's epilogue runs it too)."""
    if GELU_TANH:  # 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), tanh(z) = 2 sigmoid(2z) - 1
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = (gate * tl.sigmoid(2.0 * z)).to(dtype).to(tl.float32)
    else:
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (act * up).to(dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``SiluAndMul.forward``: silu(gate) * up of x = [gate | up], [T, 2 I] with contiguous rows; [T, I]."""
    return act_and_mul(x, gelu_tanh=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU (tanh GELU) of x = [gate | up], [T, 2 I] with contiguous rows; [T, I]."""
    return act_and_mul(x, gelu_tanh=True)


def act_and_mul(x: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    """act(gate) * up of x = [gate | up], [T, 2 I] with contiguous rows: tanh GELU with ``gelu_tanh``, else SiLU."""
    assert x.dim() == 2 and x.shape[1] % 2 == 0 and x.stride(1) == 1, (x.shape, x.stride())
    size = x.shape[1] // 2
    out = torch.empty(x.shape[0], size, dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(size), 1024)
    if x.shape[0]:
        _act_and_mul_kernel[(x.shape[0], triton.cdiv(size, block))](
            x, out, x.stride(0), out.stride(0), SIZE=size, BLOCK=block, GELU_TANH=gelu_tanh, **pdl_launch(x.device)
        )  # fmt: skip
    return out
