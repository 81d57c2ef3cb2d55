"""Which implementation each layer of a model runs, chosen once and handed to the layers as they are built.

- A backend that runs Triton (``triton``, ``flash_attn``: its ``prologue`` is set): the attention layers
  norm, rotate and store K/V in the fused prologue, and the norms and SiLU-and-mul are Triton kernels
  too (``nanostream.kernels.norm_act``): one launch each, where a compiled function's call costs its
  guards on the host (the model runs eagerly at prefill). Nothing is left for torch.compile. The MoE
  layers' experts run the fused MoE kernel (``nanostream.kernels.fused_moe``: sorted tokens, grouped
  GEMMs, no host sync, so CUDA graphs capture it). The latent attention layers store and decode with the Triton
  MLA kernels (``nanostream.kernels.mla_decode``).
- Otherwise, with ``compile`` (the ``torch`` backend on CUDA with ``torch_compile``): the torch code of the
  elementwise layers (norms, rotary, SiLU-and-mul), torch.compile'd, fuses into one kernel each.
- Otherwise the torch code, eagerly. The MoE experts' reference (``layers.moe_reference.moe_experts``) is never
  compiled; where ``grouped_mm`` runs (CPU, bf16 on CUDA) it has no host sync either.
- ``batch_invariant``: every GEMM (linear layers, LM head, router, experts) is the mode's
  (``layers.batch_invariant``), whose rows do not depend on the batch; nothing is torch.compile'd.

Compiling leaves dynamo's process-wide settings as they were. Each compiled function is one form
(a norm with a residual add is another function than one without), so its variants (rank, a batch
of one, a head count of one) stay within dynamo's default recompile limit of 8; past it calls would
run uncompiled, not wrongly. Where ``torch.compile`` takes them (torch 2.13+), each call also gets its
own limit and its own cache (``recompile_limit``, ``isolate_recompiles``), so two engines in one
process do not share one.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanostream.layers.activation import gelu_tanh_and_mul, silu_and_mul
from nanostream.layers.attention_backend import AttentionBackend
from nanostream.layers.batch_invariant import invariant_linear, invariant_moe
from nanostream.layers.delta_rule_fla import DecodeRule, VarlenRule
from nanostream.layers.latent_ops import LatentKernels
from nanostream.layers.linear import Gemm
from nanostream.layers.moe_reference import moe_experts
from nanostream.layers.moe_spec import MoEFn
from nanostream.layers.norm import RMSNormFn, compiled_rms_norm, rms_norm
from nanostream.layers.rotary import RotaryFn, apply_rotary
from nanostream.layers.short_conv import ConvDecode

REFERENCE_LATENT = LatentKernels()
RECOMPILE_LIMIT = 16  # per compiled function, where torch.compile takes one


@dataclass(frozen=True)
class LayerKernels:
    """The attention backend and the elementwise implementations a model's layers are built with."""

    attention: AttentionBackend
    rms_norm: RMSNormFn = rms_norm
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul
    gelu_tanh_and_mul: Callable[[torch.Tensor], torch.Tensor] = gelu_tanh_and_mul
    rotary: RotaryFn = apply_rotary  # unused where the attention backend's prologue rotates
    moe: MoEFn = moe_experts  # the routed experts of the MoE layers
    linear: Gemm = F.linear  # the linear layers' and the LM head's GEMM
    delta_rule: VarlenRule | None = None  # Gated DeltaNet's conv and rule, a step at once; None: the reference
    delta_decode: DecodeRule | None = None  # the same for a decode step, in place at the state slots
    conv_decode: ConvDecode | None = None  # a short convolution's decode step, in place at the state slots
    latent: LatentKernels = REFERENCE_LATENT  # the latent attention layers' store and absorbed decode

    @classmethod
    def for_backend(
        cls, backend: AttentionBackend, *, compile: bool = False, batch_invariant: bool = False
    ) -> LayerKernels:
        """Triton kernels where the backend runs Triton; else the torch code, compiled if ``compile``; the
        batch-invariant GEMMs with ``batch_invariant``::

        kernels = LayerKernels.for_backend(get_backend("auto", device, ...), compile=device.type == "cuda")
        """
        if batch_invariant:
            plain = cls.for_backend(backend)
            moe = invariant_moe(backend.prologue is not None)
            return dataclasses.replace(plain, linear=invariant_linear, moe=moe)
        if backend.prologue is not None:
            from nanostream.kernels import norm_act
            from nanostream.kernels.fused_moe import fused_moe
            from nanostream.kernels.mla_decode import paged_mla_decode, store_latent_entries

            return cls(
                backend,
                rms_norm=norm_act.rms_norm,
                silu_and_mul=norm_act.silu_and_mul,
                gelu_tanh_and_mul=norm_act.gelu_tanh_and_mul,
                moe=fused_moe,
                latent=LatentKernels(store_latent_entries, paged_mla_decode),
            )
        if compile:
            return cls(
                backend,
                rms_norm=compiled_rms_norm(compile_elementwise),
                silu_and_mul=compile_elementwise(silu_and_mul),
                gelu_tanh_and_mul=compile_elementwise(gelu_tanh_and_mul),
                rotary=compile_elementwise(apply_rotary),
            )
        return cls(backend)

    def gated(self, activation: str) -> Callable[[torch.Tensor], torch.Tensor]:
        """The gated activation named as ``layers.activation.ACTIVATIONS`` names them ("silu", "gelu_tanh")."""
        return {"silu": self.silu_and_mul, "gelu_tanh": self.gelu_tanh_and_mul}[activation]


@functools.cache
def _compile_options() -> dict[str, object]:
    params = inspect.signature(torch.compile).parameters
    if "recompile_limit" in params and "isolate_recompiles" in params:
        return {"recompile_limit": RECOMPILE_LIMIT, "isolate_recompiles": True}
    return {}


def compile_elementwise(fn: Callable) -> Callable:
    """``torch.compile(fn, dynamic=True)`` with its own recompile limit where torch has one; no global setting."""
    return torch.compile(fn, dynamic=True, **_compile_options())
