"""The attention layer: a step's new tokens attend over their sequences' paged KV context.

A step's tokens are packed: sequence ``i`` contributes the query tokens
``q[cu_seqlens_q[i]:cu_seqlens_q[i+1]]``, which are the last ones of its ``seq_lens[i]`` tokens of
context; the earlier context lives in the KV pool at the blocks of ``block_tables[i]``. Prefill,
chunked prefill, prefix-cache hits and decode are all this one shape (decode: one query token).

``Attention`` takes the fused qkv projection's output and does everything up to the attention
output: QK-norm (where the model has it: per head, or over the whole projection as OLMo 2's and MiniMax-M2's,
this rank's rows of it normed with the other ranks'),
rotary embedding (where the layer has it), the store of the new K/V at
``slot_mapping`` (-1: a padding token, stored nowhere), attention through its backend
(layers/attention_backend.py). How is fixed when the layer is built: with a backend that brings a
fused prologue (Triton), one kernel norms, rotates and stores; otherwise the modules do, and the
backend stores. What changes per step (``AttentionMetadata``, the KV pool) comes in ``ForwardContext``;
what is the layer's own (its softmax scale, sliding window, gpt-oss's sinks, its FP8 KV scales) is fixed
when it is built (the scales when it is loaded).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nanostream.distributed.group import SINGLE, TensorParallel
from nanostream.kernels.fp8_kv import FP8_KV_DTYPE
from nanostream.layers.attention_backend import AttentionBackend, AttentionMetadata, KVCache
from nanostream.layers.cache_spec import PagedKV, StateCache, StateMetadata
from nanostream.layers.linear import TensorSlice
from nanostream.layers.norm import RMSNorm, RMSNormFn, ShardedRMSNorm, rms_norm, sharded_qk_norms
from nanostream.layers.query_temperature import QueryTemperature
from nanostream.layers.rotary import RotaryEmbedding


@dataclass
class ForwardContext:
    """Everything a forward pass needs beyond the token ids and positions, passed down explicitly."""

    attn: AttentionMetadata
    kv_caches: list[KVCache | StateCache]  # one per layer: views of the KV pool, or of the state pool (recurrent)
    states: StateMetadata | None = None  # the recurrent layers' slots and snapshots; None: the model has none


class HeadSinks(nn.Module):
    """gpt-oss's attention sinks: one learned logit per query head (this rank's ``heads``), float32."""

    def __init__(self, heads: range) -> None:
        super().__init__()
        self.heads = heads
        self.weight = nn.Parameter(torch.zeros(len(heads), dtype=torch.float32))

    def load_weight(self, param: nn.Parameter, loaded: TensorSlice) -> None:
        part = loaded[self.heads.start : self.heads.stop]
        if tuple(part.shape) != tuple(param.shape):
            raise ValueError(f"sinks of shape {tuple(part.shape)} for this rank's {len(self.heads)} heads")
        param.data.copy_(part)


class KVScales(nn.Module):
    """A layer's scales of an FP8 KV cache (``kv_cache_dtype="fp8"``): K is stored as k / k_scale in float8
    e4m3 (saturated at +-448) and read back as stored * k_scale, V likewise; one float32 each per layer.

    They come from the checkpoint where it has them (``self_attn.k_scale`` / ``v_scale``, as llm-compressor
    and vLLM name them), else they are 1.0, as vLLM's are. A cache in the model's dtype does not read them.
    To calibrate: run the model in its own dtype on prompts like the ones it will serve, keep each
    layer's largest |k| and |v| as stored (after the QK-norm and rotary), and write
    ``k_scale = amax_k / 448`` and ``v_scale = amax_v / 448`` as float32 tensors of shape [1] under those
    names into a safetensors file of the model directory (docs/models.md: "FP8 KV cache").

    ``scales()`` gives the tensors the backends take. Random weights (``load_format="dummy"``) leave them at
    1.0: only a checkpoint's tensor replaces them.
    """

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.k_scale = nn.Parameter(torch.ones(1, dtype=torch.float32), requires_grad=False)
        self.v_scale = nn.Parameter(torch.ones(1, dtype=torch.float32), requires_grad=False)
        self.register_buffer("_unit", torch.ones(1, dtype=torch.float32), persistent=False)
        self.from_checkpoint = False

    def shards(self, param: nn.Parameter) -> tuple[str, ...]:
        """The parts of ``param`` a checkpoint must hold: none, these are optional (models/loader.py)."""
        return ()

    def load_weight(self, param: nn.Parameter, loaded: TensorSlice) -> None:
        value = loaded[:].to(torch.float32)
        name = f"layer {self.layer_idx}'s {'k_scale' if param is self.k_scale else 'v_scale'}"
        if value.numel() != 1:
            raise ValueError(
                f"{name} of shape {list(value.shape)}: nanostream takes one KV scale per layer (a per-tensor "
                "kv_cache_scheme), not one per head or channel"
            )
        if not (torch.isfinite(value).all() and value.item() > 0):
            raise ValueError(f"{name} must be a positive finite number, the checkpoint holds {value.item()}")
        param.data.copy_(value.reshape(1))
        self.from_checkpoint = True

    def scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_scale, v_scale), [1] float32 on the layer's device: the checkpoint's, else ones."""
        if self.from_checkpoint:
            return self.k_scale, self.v_scale
        return self._unit, self._unit


@dataclass(frozen=True)
class WholeProjectionNorms:
    """QK-norms over the whole q and k projections (OLMo 2, MiniMax-M2): the rows of each that this rank holds (its
    heads' D rows; all of them at one rank) and the ranks' group, over which each norm's statistics are taken."""

    q_rows: range
    k_rows: range
    tp: TensorParallel = SINGLE


class Attention(nn.Module):
    """qkv [T, (Hq + 2 Hkv) D] of the step's new tokens -> attention output [T, Hq D].

    ``qk_norm_eps``: RMSNorm each head's q and k first (Qwen3's QK-norm; ``q_norm``/``k_norm`` hold the
    weights), or with ``qk_norm_whole`` the whole q and k projections (OLMo 2, MiniMax-M2). ``rotary``: the model's
    table for this layer's kind, shared by its layers; None: no rotary embedding (SmolLM3's NoPE layers).
    ``norm_kernel`` runs the QK-norm where no fused prologue does. ``scale``: the softmax scale (None:
    head_dim ** -0.5); ``window``: a sliding window of that many positions, itself included; ``sinks``:
    gpt-oss's per-head sink logits. ``kv_scales``: the scales of an FP8 KV cache (1.0 until a checkpoint's
    load), passed to the backend when the pool is FP8. ``output_gate`` (Qwen3-Next, Qwen3.5): each head's q rows
    are [query D | gate D] (qkv [T, (2 Hq + 2 Hkv) D]) and the output is times sigmoid(gate).
    ``qk_norm_after_rotary``: the per-head QK-norms run on the rotated q and k (then the modules norm and rotate,
    and the backend stores); ``qk_norm_weightless``: they have no weight. ``temperature``: the queries scaled by
    position after both. ``chunk``: chunked local attention, a query sees its chunk of that many positions only.
    """

    def __init__(
        self,
        layer_idx: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding | None,
        backend: AttentionBackend,
        qk_norm_eps: float | None = None,
        norm_kernel: RMSNormFn = rms_norm,
        *,
        norm_weight_offset: float | None = None,
        qk_norm_whole: WholeProjectionNorms | None = None,
        scale: float | None = None,
        window: int | None = None,
        sinks: HeadSinks | None = None,
        output_gate: bool = False,
        qk_norm_after_rotary: bool = False,
        temperature: QueryTemperature | None = None,
        chunk: int | None = None,
        qk_norm_weightless: bool = False,
    ) -> None:
        super().__init__()
        self.qk_norm_after_rotary, self.temperature = qk_norm_after_rotary, temperature
        self.layer_idx = layer_idx
        self.output_gate = output_gate
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.split_sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        self.scale = head_dim**-0.5 if scale is None else scale
        self.window = window
        self.sinks = sinks
        # the backend's defaults (full attention, no sinks) unless this layer departs from them
        self._options = {} if window is None else {"window": window}
        if chunk is not None:
            self._options["chunk"] = chunk
        self.kv_scales = KVScales(layer_idx)
        self.backend = backend
        self.prologue = backend.prologue  # QK-norm, rotary and the store in one kernel, or None
        self.rotary = rotary
        if rotary is None:  # the prologue rotates by an identity table: cos 1, sin 0
            self.register_buffer("_cos", torch.ones(head_dim // 2, dtype=torch.float32), persistent=False)
            self.register_buffer("_sin", torch.zeros(head_dim // 2, dtype=torch.float32), persistent=False)
        self.qk_norm = qk_norm_eps is not None
        self.qk_norm_whole = self.qk_norm and qk_norm_whole is not None
        if self.qk_norm_whole:
            self.q_norm = ShardedRMSNorm(qk_norm_whole.q_rows, qk_norm_eps, norm_kernel, norm_weight_offset)
            self.k_norm = ShardedRMSNorm(qk_norm_whole.k_rows, qk_norm_eps, norm_kernel, norm_weight_offset)
            self.tp = qk_norm_whole.tp
        elif self.qk_norm:
            learned = not qk_norm_weightless
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, norm_kernel, norm_weight_offset, learned=learned)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, norm_kernel, norm_weight_offset, learned=learned)

    def cache_spec(self) -> PagedKV:
        """What the layer keeps per token: K and V of its (this rank's) KV heads."""
        reaches = [r for r in (self.window, self._options.get("chunk")) if r is not None]
        return PagedKV(self.num_kv_heads, self.head_dim, min(reaches) if reaches else None)

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # positions: [T] (or M-RoPE's [3, T]), qkv: [T, (Hq + 2 Hkv) D] (with output_gate: [T, (2 Hq + 2 Hkv) D])
        if not self.output_gate:
            return self._attend(positions, qkv, ctx)
        q_gate, kv = qkv.split([2 * self.split_sizes[0], 2 * self.split_sizes[1]], -1)
        q, gate = q_gate.unflatten(-1, (self.num_heads, 2 * self.head_dim)).chunk(2, -1)  # [T, Hq, D] each
        out = self._attend(positions, torch.cat((q.flatten(1), kv), -1), ctx)  # q, k, v packed as every layer's
        return out * torch.sigmoid(gate.flatten(1))

    def _attend(self, positions: torch.Tensor, qkv: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        cache = ctx.kv_caches[self.layer_idx]
        meta = ctx.attn.group(cache.group)  # the block tables of the layer's KV group
        options = self._options if self.sinks is None else {**self._options, "sinks": self.sinks.weight}
        scales = {}  # an FP8 pool's K and V scales, for the store and the attention
        if cache.k.dtype == FP8_KV_DTYPE:
            scales["k_scale"], scales["v_scale"] = self.kv_scales.scales()
        if self.qk_norm_whole:
            q, k, v = qkv.split(self.split_sizes, -1)
            qkv = torch.cat((*sharded_qk_norms(q, k, self.q_norm, self.k_norm, self.tp), v), -1)
        if self.prologue is not None and not self.qk_norm_after_rotary:
            per_head = self.qk_norm and not self.qk_norm_whole
            norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if per_head else (None, None, 0.0)
            rows = positions
            if self.rotary is None:  # an identity table whose rows are one row (stride 0): any position reads it
                cos, sin = self._cos.expand(2, -1), self._sin.expand(2, -1)
            else:  # M-RoPE's [3, T] positions: tables gathered for these tokens, read at rows 0..T-1
                rows, cos, sin = self.rotary.tables_at(positions)
            q = self.prologue(
                qkv, rows, cos, sin, *norms, cache.k, cache.v, meta.slot_mapping,
                self.num_heads, self.num_kv_heads, weight_offset=self.q_norm.weight_offset if per_head else None,
                **scales,
            )  # fmt: skip
            if self.temperature is not None:
                q = self.temperature(positions, q)
            return self.backend.attend(q, cache, meta, self.scale, **options, **scales).flatten(1)
        q, k, v = qkv.split(self.split_sizes, -1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        per_head = self.qk_norm and not self.qk_norm_whole
        if per_head and not self.qk_norm_after_rotary:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        if per_head and self.qk_norm_after_rotary:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.temperature is not None:
            q = self.temperature(positions, q)
        return self.backend.forward(q, k, v, cache, meta, self.scale, **options, **scales).flatten(1)
