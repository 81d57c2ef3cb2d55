"""Attention through FlashAttention, reading the paged KV pool in place.

The pool's per-layer layout, [num_blocks, block_size, Hkv, D], is FlashAttention's paged layout
(num_pages, page_size, Hkv, D), so a sequence's context is read straight from its ``block_tables`` row.
Two versions, whichever is installed, imported lazily (this module imports where neither is):

- FlashAttention-4 (PyPI ``flash-attn-4``, module ``flash_attn.cute``): Hopper and Blackwell, any block size.
- FlashAttention-2 (PyPI ``flash-attn``, module ``flash_attn``): Ampere or newer, block sizes divisible by 256.

FA4 wins where both import and the GPU is one it supports. Decode (one query per sequence) reads no host
value that changes between steps (``max_seqlen_k`` is not read; the block-table width bounds the context),
so it can be captured in a CUDA graph.

A sliding window goes to either version as ``window_size=(window - 1, 0)`` (FlashAttention's window: a
query at p sees keys in [p - left, p + right]). Attention sinks go to FA4 as ``learnable_sink``, which it
takes in bfloat16 only: a bfloat16 model's (whose sinks are bfloat16 values, so the cast is exact).
FA2 has no sinks, and FA4 none in float16: those calls run nanostream's Triton kernels
(layers/triton_attention.py) over the same pool instead. An FP8 KV cache is refused: FA2 reads none, and
FA4's FP8 attention (flash_attn.cute, 2026) takes q, k and v all in FP8, on Blackwell (sm100) only, where
nanostream's queries stay in the model's dtype; the Triton backend reads it. Use::

    reason = flash_attn_unavailable_reason(torch.device("cuda"), torch.bfloat16, block_size=256, head_dim=128)
    backend = FlashAttention() if reason is None else TorchAttention()
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from nanostream.kernels.fp8_kv import FP8_KV_DTYPE, check_kv_scales
from nanostream.layers.attention_backend import AttentionBackend, AttentionMetadata, KVCache, check_window
from nanostream.layers.triton_attention import TritonAttention

FA4_ARCHS = (9, 10, 11)  # compute-capability majors where FA4 reads paged KV: Hopper, Blackwell
FA2_MIN_ARCH = 8
FA2_PAGE_MULTIPLE = 256  # FA2 rejects a paged KV block size that is not a multiple of 256
DTYPES = (torch.float16, torch.bfloat16)
NOT_INSTALLED = "flash_attn is not installed (pip install flash-attn-4 on Hopper/Blackwell, flash-attn on Ampere/Ada)"
FP8_KV_REFUSED = (
    "FlashAttention does not read an FP8 KV cache (kv_cache_dtype='fp8'): FlashAttention-2 has no FP8, and "
    "FlashAttention-4's takes FP8 queries too, on Blackwell only; use attention_backend='triton' with it"
)

# (q [T, Hq, D], this layer's pool, metadata, softmax scale, window, sinks) -> [T, Hq, D]; the new K/V are
# already stored
Kernel = Callable[[torch.Tensor, KVCache, AttentionMetadata, float, int | None, torch.Tensor | None], torch.Tensor]


def _fa4_installed() -> bool:
    try:
        from flash_attn.cute import flash_attn_varlen_func  # noqa: F401
    except ImportError:
        return False
    return True


def _fa2_installed() -> bool:
    # flash-attn-4 alone leaves `flash_attn` a namespace package without these names
    try:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache  # noqa: F401
    except ImportError:
        return False
    return True


def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _plan(
    device: torch.device, dtype: torch.dtype, block_size: int, head_dim: int, kv_cache_dtype: torch.dtype | None = None
) -> tuple[int, str | None]:
    """(FlashAttention version to use, None) or (0, why none can run)."""
    if kv_cache_dtype == FP8_KV_DTYPE:
        return 0, FP8_KV_REFUSED
    has4, has2 = _fa4_installed(), _fa2_installed()
    if not (has4 or has2):
        return 0, NOT_INSTALLED
    if device.type != "cuda":
        return 0, f"FlashAttention needs a CUDA device, got {device}"
    if dtype not in DTYPES:
        return 0, f"FlashAttention needs float16 or bfloat16, got {dtype}; set dtype='bfloat16'"
    major, minor = _capability(device)
    if has4 and major in FA4_ARCHS:
        # head dims: multiples of 16 (FA4's paged loads take no partial 16-column tiles), up to 256 on
        # Hopper, up to 128 or exactly 256 on Blackwell
        if head_dim % 16 or head_dim > 256 or (major != 9 and 128 < head_dim < 256):
            most = "256" if major == 9 else "128, or 256"
            return 0, f"FlashAttention-4 on sm{major}{minor} needs head_dim in 16, 32, ... {most}; got {head_dim}"
        return 4, None
    if not has2:
        return 0, (
            f"FlashAttention-4 needs a Hopper or Blackwell GPU, this one is sm{major}{minor}; "
            "install flash-attn (FlashAttention-2) for Ampere/Ada"
        )
    if major < FA2_MIN_ARCH:
        return 0, f"FlashAttention-2 needs an Ampere or newer GPU (sm80+), this one is sm{major}{minor}"
    if block_size % FA2_PAGE_MULTIPLE:
        return 0, (
            f"FlashAttention-2 needs kvcache_block_size divisible by {FA2_PAGE_MULTIPLE}, got {block_size}; "
            "set kvcache_block_size=256"
        )
    if head_dim % 8 or head_dim > 256:  # FA2 would pad other sizes by copying the whole pool
        return 0, f"FlashAttention-2 needs head_dim a multiple of 8 up to 256, got {head_dim}"
    return 2, None


def flash_attn_unavailable_reason(
    device: torch.device, dtype: torch.dtype, block_size: int, head_dim: int, kv_cache_dtype: torch.dtype | None = None
) -> str | None:
    """None when ``FlashAttention`` runs with these settings; else one line that says what to change.

    ``dtype`` is the model's, ``kv_cache_dtype`` the KV pool's (None: the model's; FP8 is refused),
    ``block_size`` the KV block size in tokens::

        if (reason := flash_attn_unavailable_reason(device, torch.bfloat16, 16, 128)) is not None:
            raise ValueError(f"attention_backend='flash_attn': {reason}")
    """
    return _plan(device, dtype, block_size, head_dim, kv_cache_dtype)[1]


def _first(out: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out  # FA4 returns (out, lse); lse is None unless asked


def _fa4_kernel() -> Kernel:
    from flash_attn.cute import flash_attn_varlen_func as attn

    def forward(
        q: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float,
        window: int | None, sinks: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        common = dict(seqused_k=meta.seq_lens, page_table=meta.block_tables, softmax_scale=scale, causal=True)
        if window is not None:
            common["window_size"] = (window - 1, 0)
        if sinks is not None:
            common["learnable_sink"] = sinks.to(torch.bfloat16)  # FA4 asserts bfloat16 sinks
        if meta.is_decode:
            # q as [B, 1, Hq, D]. No max_seqlen_k: FA4 then bounds it by the block-table width, which holds
            # in every replay of a CUDA graph.
            return _first(attn(q[:, None], cache.k, cache.v, **common))[:, 0]
        return _first(
            attn(
                q, cache.k, cache.v,
                cu_seqlens_q=meta.cu_seqlens_q, max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k,
                **common,
            )
        )  # fmt: skip

    return forward


def _fa2_kernel() -> Kernel:
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

    def forward(
        q: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float,
        window: int | None, sinks: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        assert sinks is None, "FlashAttention-2 has no attention sinks: the backend sends those calls to Triton"
        extra = {} if window is None else {"window_size": (window - 1, 0)}
        if meta.is_decode:
            # q as [B, 1, Hq, D]; cache_seqlens counts the new token, which is already in the pool
            out = flash_attn_with_kvcache(
                q[:, None], cache.k, cache.v,
                cache_seqlens=meta.seq_lens, block_table=meta.block_tables, softmax_scale=scale, causal=True,
                **extra,
            )  # fmt: skip
            return out[:, 0]
        cu_seqlens_k = F.pad(meta.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))  # [B+1], on the device
        return flash_attn_varlen_func(
            q, cache.k, cache.v, meta.cu_seqlens_q, cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k,
            softmax_scale=scale, causal=True, block_table=meta.block_tables, **extra,
        )  # fmt: skip

    return forward


_KERNELS: dict[int, Callable[[], Kernel]] = {4: _fa4_kernel, 2: _fa2_kernel}


class FlashAttention(AttentionBackend):
    """Stores the new K/V with ``store_kv``, then attends with FlashAttention over the paged pool.

    The version is picked on the first call, from its device, dtype, block size and head dim; settings
    it cannot run raise ``ValueError`` with the reason (``flash_attn_unavailable_reason`` tells ahead).
    Calls with sinks that the version cannot take (FA2, FA4 in float16) and chunked local attention (``chunk``) run
    the Triton backend's kernels.
    """

    name = "flash_attn"
    supports_cuda_graphs = True

    def __init__(self) -> None:
        # here, not at the top: Triton is Linux-only
        from nanostream.kernels.qkv_prologue import qkv_prologue
        from nanostream.kernels.store_kv import store_kv

        self._store, self.prologue = store_kv, qkv_prologue
        self.version: int | None = None  # 4 or 2, once picked
        self._kernel: Kernel | None = None
        self._triton = TritonAttention()  # for sinks the version cannot take

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float,
        *, window: int | None = None, chunk: int | None = None, sinks: torch.Tensor | None = None,
        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        if check_kv_scales(cache.k.dtype, k_scale, v_scale):
            raise ValueError(f"attention backend 'flash_attn' cannot run: {FP8_KV_REFUSED}")
        self._store(k, v, cache.k, cache.v, meta.slot_mapping)  # slot -1 (a CUDA-graph padding row): skipped
        return self.attend(q, cache, meta, scale, window=window, chunk=chunk, sinks=sinks)

    def attend(
        self, q: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float,
        *, window: int | None = None, chunk: int | None = None, sinks: torch.Tensor | None = None,
        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        check_window(window, chunk)
        if check_kv_scales(cache.k.dtype, k_scale, v_scale):
            raise ValueError(f"attention backend 'flash_attn' cannot run: {FP8_KV_REFUSED}")
        if self._kernel is None:
            version, reason = _plan(q.device, q.dtype, cache.block_size, q.shape[-1], cache.k.dtype)
            if reason is not None:
                raise ValueError(f"attention backend 'flash_attn' cannot run: {reason}")
            self.version, self._kernel = version, _KERNELS[version]()
        if chunk is not None or meta.limits(window) is not None:  # chunked local attention, or queries that see past
            # themselves (an image's tokens, Gemma 3's): FA2 and FA4's paged kernels take neither, ours do
            return self._triton.attend(q, cache, meta, scale, window=window, chunk=chunk, sinks=sinks)
        if sinks is not None and not (self.version == 4 and q.dtype == torch.bfloat16):
            return self._triton.attend(q, cache, meta, scale, window=window, sinks=sinks)
        if meta.is_decode or not meta.num_decodes:
            return self._kernel(q, cache, meta, scale, window, sinks)
        # A mixed step: the decode rows through the decode path, the prompt chunks through varlen prefill.
        decode, rest = meta.decode_split
        n, kernel = meta.num_decodes, self._kernel
        head = kernel(q[:n], cache, decode, scale, window, sinks)
        return torch.cat([head, kernel(q[n:], cache, rest, scale, window, sinks)])
