"""Engine configuration: one frozen dataclass, the single source of defaults.

``EngineConfig`` holds what the user asked for ("auto" where the engine decides).
``EngineConfig.resolve`` returns a new, concrete config once the model and the device are known;
nothing is written back into an existing instance.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "flash_attn", "triton", "torch")
LOAD_FORMATS = ("auto", "dummy")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
RUNNERS = ("auto", "generate", "pooling")


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one engine. Names follow vLLM where vLLM has the setting.

    Example::

        EngineConfig(model="/models/Qwen3-0.6B", max_num_seqs=64, kvcache_block_size=16)
    """

    model: str
    tokenizer: str | None = None
    """Tokenizer directory; defaults to the model directory."""
    max_num_seqs: int = 256
    """Most requests in one batch."""
    max_num_batched_tokens: int = 8192
    """Token budget of one engine step; longer prompts are prefilled in chunks."""
    max_model_len: int | None = None
    """Longest prompt + output, in tokens; defaults to the model's max_position_embeddings, and may not exceed it."""
    kvcache_block_size: int = 256
    """Tokens per KV-cache block."""
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory the engine may use (weights, activations and KV cache)."""
    kv_cache_memory_bytes: int | None = None
    """Bytes of KV cache (per rank, with tensor parallelism). Overrides gpu_memory_utilization; on CPU the
    default is 1 GiB."""
    num_kvcache_blocks: int | None = None
    """Exact number of KV blocks; overrides both memory settings. (A model whose sliding or chunked layers sit beside
    full ones has a block table per KV group of its layers: a block then holds one group's layers.)"""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of prompt prefixes that earlier requests computed."""
    state_snapshot_interval: int | None = None
    """Models with recurrent layers (Qwen3.5's Gated DeltaNet): the prefix cache keeps a copy of a sequence's
    state every this many tokens (a multiple of kvcache_block_size; default: 4 blocks), at its prompt's last full
    block and at the last full block it completes while decoding, so that the next turn of a conversation reuses
    its whole history; a cached prefix is reused up to its last copy."""
    max_state_snapshots: int | None = None
    """Models with recurrent layers: the most state copies the prefix cache keeps (least recently used out).
    Default: max_num_seqs, fewer on CUDA where a quarter of the memory left after the live states holds less."""
    limit_images_per_prompt: int = 16
    """A vision-language model: the most images one request may hold (more is a 400 / InvalidRequestError)."""
    dtype: str = "auto"
    """The weights' and activations' dtype; auto: bfloat16 on CUDA, float32 on CPU."""
    device: str = "auto"
    """auto: cuda when available, else cpu. Any torch device string ("cuda:1") is accepted."""
    attention_backend: str = "auto"
    """auto, flash_attn (FlashAttention-4 or -2), triton (nanostream's kernels) or torch (reference).
    auto: on CUDA, flash_attn when installed and supported, else triton; elsewhere torch."""
    enforce_eager: bool = False
    """Run every step eagerly instead of replaying CUDA graphs (of decode steps, and at one GPU of the
    model between its attention calls in steps with prompt tokens)."""
    torch_compile: bool = True
    """Compile the elementwise layers (RMSNorm, rotary, SiLU-and-mul) with torch.compile on CUDA."""
    tensor_parallel_size: int = 1
    """Split the model over this many processes (GPUs): this one and N-1 workers it starts, or torchrun's ranks."""
    worker_timeout: float = 5.0
    """Seconds a tensor-parallel worker may send no heartbeat before the engine takes it for hung and fails."""
    seed: int = 0
    """Seeds the sampling of requests that bring no seed of their own."""
    load_format: str = "auto"
    """auto: the model directory's *.safetensors weights; dummy: small random values of config.json's shapes
    (the directory needs only config.json and a tokenizer), for benchmarks of shapes without a checkpoint."""
    kv_cache_dtype: str = "auto"
    """The KV cache's dtype. auto: the model's. fp8 (fp8_e4m3): float8 e4m3, one byte an element, so twice the KV
    blocks of a bfloat16 cache at the same memory; K and V are stored divided by a per-layer scale (the
    checkpoint's k_scale/v_scale, else 1.0). The torch and triton attention backends read it, not flash_attn."""
    batch_invariant: bool = False
    """A request's tokens (greedy, or sampled with a seed) do not depend on which requests share its steps: every
    GEMM has one tile for any batch and attention splits nothing by the batch (the triton or torch backend;
    FP8 weights are dequantized). Costs throughput (BENCHMARKS.md); tensor parallelism up to 2 ranks."""
    runner: str = "auto"
    """pooling: an embedding server, whose requests may ask for their prompt's embedding (last-token pooling,
    normalised, unless the checkpoint's sentence-transformers files say otherwise; models/pooling.py);
    generate: none may; auto: pooling when the checkpoint has a sentence-transformers pooling config."""

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a model directory or hub id, got {self.model!r}")
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "kvcache_block_size",
            "tensor_parallel_size",
            "limit_images_per_prompt",
        ):
            positive(name)
        for name in ("max_model_len", "kv_cache_memory_bytes", "num_kvcache_blocks", "state_snapshot_interval"):
            if getattr(self, name) is not None:
                positive(name)
        if self.max_state_snapshots is not None and (
            isinstance(self.max_state_snapshots, bool)
            or not isinstance(self.max_state_snapshots, int)
            or self.max_state_snapshots < 0
        ):
            raise ValueError(f"max_state_snapshots must be a non-negative integer, got {self.max_state_snapshots!r}")
        interval = self.state_snapshot_interval
        if interval is not None and interval % self.kvcache_block_size:
            raise ValueError(
                f"state_snapshot_interval ({interval}) must be a multiple of kvcache_block_size "
                f"({self.kvcache_block_size}): a state copy sits at a cached block's end"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least max_num_seqs "
                f"({self.max_num_seqs}) so that every running request can decode in each step; "
                "raise max_num_batched_tokens or lower max_num_seqs"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}; got {self.attention_backend!r}"
            )
        if isinstance(self.worker_timeout, bool) or not 0 < self.worker_timeout < float("inf"):
            raise ValueError(f"worker_timeout must be a positive number of seconds, got {self.worker_timeout!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}; got {self.load_format!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}")
        if self.batch_invariant and self.tensor_parallel_size > 2:
            raise ValueError(
                f"batch_invariant runs on 1 or 2 ranks, not tensor_parallel_size={self.tensor_parallel_size}: "
                "an all-reduce of 3 or more ranks sums in an order that follows the message's size"
            )
        if self.batch_invariant and self.attention_backend == "flash_attn":
            raise ValueError(
                "batch_invariant needs attention_backend 'triton', 'torch' or 'auto': FlashAttention splits its work "
                "by the batch"
            )
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}; got {self.runner!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        """Build a config, naming the valid keys when an unknown one is given."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(
                f"unknown engine option(s) {', '.join(map(repr, unknown))}; "
                f"valid options are: {', '.join(sorted(known - {'model'}))}"
            )
        return cls(model=model, **kwargs)

    def resolve(self, *, max_position_embeddings: int, cuda_available: bool) -> EngineConfig:
        """A copy with device, dtype and max_model_len made concrete for this model and machine."""
        device = self.device
        if device == "auto":
            device = "cuda" if cuda_available else "cpu"
        if device.startswith("cuda") and not cuda_available:
            raise ValueError(f"device={self.device!r} but no CUDA GPU is available; use device='cpu'")
        dtype = self.dtype
        if dtype == "auto":
            dtype = "bfloat16" if device.startswith("cuda") else "float32"
        if self.max_model_len is not None and self.max_model_len > max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                f"({max_position_embeddings}); give at most {max_position_embeddings}, or leave it unset"
            )
        max_model_len = self.max_model_len or max_position_embeddings
        interval = self.state_snapshot_interval or 4 * self.kvcache_block_size
        return dataclasses.replace(
            self, device=device, dtype=dtype, max_model_len=max_model_len, state_snapshot_interval=interval
        )


@dataclass(frozen=True)
class ServerConfig:
    """Settings of an engine process (``nanostream serve``), beside its EngineConfig."""

    address: str | None = None
    """ipc://PATH or tcp://HOST:PORT (port 0: any free port). Default: a fresh ipc:// path."""
    auth_token: str | None = None
    """Shared secret clients present in their hello; required to bind TCP beyond loopback."""
    heartbeat_interval: float = 1.0
    """Seconds between heartbeats, each way."""
    client_timeout: float = 10.0
    """A client silent this long is gone: its requests are aborted and their KV blocks freed."""
    stream_interval: int = 1
    """Send a request's tokens every N tokens (its first and last always go at once)."""
    max_num_queued_reqs: int = 4096
    """Requests waiting to run, engine-wide; a request past this is refused with EngineBusyError (HTTP 429)."""
    max_num_queued_tokens: int = 4_194_304
    """Tokens of the waiting requests, engine-wide; a request past this is refused with EngineBusyError."""
    max_client_reqs: int = 8192
    """Open requests (running or waiting) of one client; more are refused with EngineBusyError."""
    max_client_tokens: int = 8_388_608
    """Prompt tokens of one client's open requests; a request past this is refused with EngineBusyError."""
    max_image_bytes: int = 4 * 2**30
    """Pixel rows of the open requests' images, engine-wide (a vision-language model's: ~4.8 MB a 448 x 448 image,
    held until the request ends); a request past this is refused with EngineBusyError."""
    register: bool = True
    """Record the address where local clients look when they are given none (the user's runtime
    directory), until the engine stops; ``EngineProcess`` engines, private to their program, do not."""
    exit_with_parent: bool = False
    """Stop when the process that started this one exits (``EngineProcess`` sets it: an engine that a
    program starts for itself does not outlive the program, however it ends)."""

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_interval < float("inf"):
            raise ValueError(
                f"heartbeat_interval must be a positive number of seconds, got {self.heartbeat_interval!r}"
            )
        if not self.client_timeout < float("inf"):
            raise ValueError(f"client_timeout must be a finite number of seconds, got {self.client_timeout!r}")
        if not self.client_timeout > self.heartbeat_interval:
            raise ValueError(
                f"client_timeout ({self.client_timeout}) must exceed heartbeat_interval ({self.heartbeat_interval})"
            )
        if (
            isinstance(self.stream_interval, bool)
            or not isinstance(self.stream_interval, int)
            or self.stream_interval < 1
        ):
            raise ValueError(f"stream_interval must be a positive integer, got {self.stream_interval!r}")
        for name in ("max_num_queued_reqs", "max_num_queued_tokens", "max_client_reqs", "max_client_tokens",
                     "max_image_bytes"):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.address is not None and not self.address.startswith(("ipc://", "tcp://")):
            raise ValueError(f"address must be ipc://PATH or tcp://HOST:PORT, got {self.address!r}")
