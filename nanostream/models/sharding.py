"""How the shared decoder splits over tensor-parallel ranks (Megatron's layout), and the error when it cannot.

Rank ``r`` of ``n`` holds whole attention heads: query heads ``[r * Hq/n, (r+1) * Hq/n)`` and the KV heads
they read. With fewer KV heads than ranks each KV head is replicated on ``n / Hkv`` neighbouring ranks
(rank ``r`` holds KV head ``r * Hkv // n``, the one its query heads share). The MLP's intermediate size
and the vocabulary split into ``n`` equal ranges. Norms, rotary tables and biases of row-parallel
projections are whole on every rank.

A QK-norm over the whole q and k projections (OLMo 2, MiniMax-M2) holds this rank's heads' rows of its weight, and
takes its statistics over every rank's (one all-reduce a layer, layers/norm.py).

In a mixture-of-experts layer every rank holds every expert, ``[r * I/n, (r+1) * I/n)`` of each one's
intermediate dimension (and of the shared expert's); the router is whole on every rank (DeepSeek's correction
bias too).

A Gated DeltaNet layer splits by key heads: rank ``r`` holds key heads ``[r * Hk/n, (r+1) * Hk/n)``, the value
heads that read them, their conv channels and states, and their columns of out_proj (row parallel, one all-reduce).
A short convolution layer splits by channels: rank ``r`` holds ``[r * H/n, (r+1) * H/n)`` of each gate, of the conv
and its state, and those columns of out_proj.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanostream.models.spec import DecoderSpec


@dataclass(frozen=True)
class DecoderShard:
    """The rows (heads, features, token ids) of each split dimension that one rank holds."""

    rank: int
    size: int
    heads: range  # query heads
    kv_heads: range  # KV heads (one, shared with neighbouring ranks, when Hkv < size)
    intermediate: range  # rows of gate and up, columns of down
    vocab: range  # rows of the embedding and the LM head
    expert_intermediate: range = range(0)  # of every expert (MoE layers)
    shared_intermediate: range = range(0)  # of Qwen2-MoE's shared expert
    linear_k_heads: range = range(0)  # the Gated DeltaNet layers' key heads (and the value heads that read them)
    conv_channels: range = range(0)  # the short convolution layers' channels (of the hidden size)

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_heads)


def _split(total: int, rank: int, size: int) -> range:
    part = total // size
    return range(rank * part, (rank + 1) * part)


def split_problems(spec: DecoderSpec, size: int) -> list[str]:
    """Why ``size`` ranks cannot split ``spec`` (empty: they can)."""
    problems = []
    if spec.num_heads % size:
        problems.append(f"num_attention_heads ({spec.num_heads}) is not divisible by it")
    for hkv in sorted({spec.kv_shape(i)[0] for i in range(spec.num_layers)}):  # (Gemma 4's full layers: their own)
        if hkv >= size and hkv % size:
            problems.append(f"num_key_value_heads ({hkv}) is not divisible by it")
        if hkv < size and size % hkv:
            problems.append(
                f"it is not a multiple of num_key_value_heads ({hkv}), so the KV heads cannot be replicated"
            )
    moe = spec.moe
    dense_layers = spec.num_layers - (len(moe.layers) if moe and not moe.beside_dense else 0)
    if dense_layers and spec.intermediate_size % size:
        problems.append(f"intermediate_size ({spec.intermediate_size}) is not divisible by it")
    if moe and moe.intermediate_size % size:
        problems.append(f"the experts' intermediate size ({moe.intermediate_size}) is not divisible by it")
    if moe and moe.shared_expert_intermediate_size % size:
        problems.append(
            f"shared_expert_intermediate_size ({moe.shared_expert_intermediate_size}) is not divisible by it"
        )
    if spec.vocab_size % size:
        problems.append(f"vocab_size ({spec.vocab_size}) is not divisible by it")
    gdn = spec.gated_deltanet
    if gdn is not None and gdn.num_k_heads % size:
        problems.append(
            f"linear_num_key_heads ({gdn.num_k_heads}) is not divisible by it (a Gated DeltaNet layer splits by key "
            "heads)"
        )
    if spec.short_conv is not None and spec.hidden_size % size:
        problems.append(
            f"hidden_size ({spec.hidden_size}) is not divisible by it (a short convolution splits by channels)"
        )
    return problems


def check_split(spec: DecoderSpec, size: int) -> None:
    """Raise ``ValueError`` naming the numbers (and the sizes that work) if ``size`` ranks cannot split ``spec``."""
    problems = split_problems(spec, size)
    if problems:
        works = [n for n in range(1, spec.num_heads + 1) if not split_problems(spec, n)]
        raise ValueError(
            f"tensor_parallel_size={size} cannot split {spec.architecture}: {'; '.join(problems)}. "
            f"Use a tensor_parallel_size that divides the model: {', '.join(map(str, works))}"
        )


def kv_split(num_kv_heads: int, rank: int, size: int) -> range:
    """The KV heads rank ``rank`` holds: its share, or the one it replicates where there are fewer than ranks."""
    if num_kv_heads >= size:
        return _split(num_kv_heads, rank, size)
    head = rank * num_kv_heads // size
    return range(head, head + 1)


def shard_decoder(spec: DecoderSpec, rank: int, size: int) -> DecoderShard:
    """Rank ``rank``'s part of ``spec`` (``check_split`` first: this assumes the split is exact)."""
    kv_heads = kv_split(spec.num_kv_heads, rank, size)
    return DecoderShard(
        rank=rank,
        size=size,
        heads=_split(spec.num_heads, rank, size),
        kv_heads=kv_heads,
        intermediate=_split(spec.intermediate_size, rank, size),
        vocab=_split(spec.vocab_size, rank, size),
        expert_intermediate=_split(spec.moe.intermediate_size, rank, size) if spec.moe else range(0),
        shared_intermediate=_split(spec.moe.shared_expert_intermediate_size, rank, size) if spec.moe else range(0),
        linear_k_heads=_split(spec.gated_deltanet.num_k_heads, rank, size) if spec.gated_deltanet else range(0),
        conv_channels=_split(spec.hidden_size, rank, size) if spec.short_conv else range(0),
    )
