"""The hybrid families (Qwen3.5 dense and MoE, Qwen3-Next, and the published multimodal Qwen3.5's language model): three
Gated DeltaNet layers to one of gated attention. nanostream's model, driven by hand on a KV pool and a state pool
made from its ``cache_specs()``, gives transformers' logits on a whole prompt; the same prompt in chunks, each
continuing from the states and KV the last left, then decoded token by token, gives the same logits; a state snapshot
taken mid-chunk, restored into another sequence's slot, continues as if that sequence had run the prefix itself; and
two tensor-parallel ranks (gloo, as threads) together give one rank's logits.
"""

from __future__ import annotations

import itertools
import logging
import shutil
from dataclasses import dataclass, field

import pytest
import torch
import transformers
from safetensors.torch import save_file
from test_hf_parity import random_prompts
from test_tp import in_threads

from nanostream import ModelLoadError
from nanostream.distributed import SINGLE, TensorParallel
from nanostream.layers.attention import ForwardContext
from nanostream.layers.attention_backend import AttentionMetadata, KVCache, TorchAttention
from nanostream.layers.cache_spec import PagedKV, RecurrentState, StateCache, StateMetadata
from nanostream.layers.layer_kernels import LayerKernels
from nanostream.models import decoder_spec, load_model
from nanostream.models.model_config import read_model_config
from nanostream.models.sharding import check_split
from nanostream.testing import TINY_PRESETS, make_tiny_model, tiny_config

CPU = torch.device("cpu")
BLOCK, BLOCKS, SLOTS = 8, 32, 6
HYBRIDS = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3_5_vl"]
SAME = dict(rtol=1e-5, atol=3e-5)  # one model, the same tokens split otherwise: float32 rounding apart (1.1e-5 seen)


@pytest.fixture(scope="module")
def hybrid_dirs(tmp_path_factory):
    return {name: make_tiny_model(tmp_path_factory.mktemp(name), **TINY_PRESETS[name]) for name in HYBRIDS}


def build(path, tp: TensorParallel = SINGLE):
    spec = decoder_spec(read_model_config(path).hf_config, max_model_len=256)
    return load_model(spec, LayerKernels(TorchAttention()), path, dtype=torch.float32, device=CPU, tp=tp)


def allocate(model) -> list[KVCache | StateCache]:
    """A KV pool of BLOCKS blocks and a state pool of SLOTS slots, zeroed, each layer's views as its spec says."""
    caches = []
    for spec in model.cache_specs():
        if isinstance(spec, PagedKV):
            shape = (BLOCKS, BLOCK, spec.num_kv_heads, spec.head_dim)
            caches.append(KVCache(torch.zeros(shape), torch.zeros(shape)))
        else:
            caches.append(StateCache(tuple(torch.zeros(SLOTS, *t.shape, dtype=t.dtype) for t in spec.tensors)))
    return caches


@dataclass
class Chunk:
    """A sequence's new tokens in a step: ``start`` tokens before them (in its KV blocks and its state)."""

    tokens: list[int]
    start: int
    blocks: list[int]
    slot: int  # its live state slot
    snapshots: list[tuple[int, int]] = field(default_factory=list)  # (n, slot): its state after n of the tokens


@torch.inference_mode()
def run_step(model, caches, chunks: list[Chunk]) -> torch.Tensor | None:
    """One step of ``chunks``, packed as the engine packs them: the logits of every new token [T, V] (None on a
    rank other than 0)."""
    ids, positions, kv_slots = [], [], []
    for c in chunks:
        for p, token in enumerate(c.tokens, c.start):
            ids.append(token)
            positions.append(p)
            kv_slots.append(c.blocks[p // BLOCK] * BLOCK + p % BLOCK)
    cu = [0, *itertools.accumulate(len(c.tokens) for c in chunks)]
    seq_lens = [c.start + len(c.tokens) for c in chunks]
    width = max(len(c.blocks) for c in chunks)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(kv_slots), cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([c.blocks + [0] * (width - len(c.blocks)) for c in chunks], dtype=torch.int32),
        max_seqlen_q=max(len(c.tokens) for c in chunks), max_seqlen_k=max(seq_lens), cu_seqlens_q_host=cu,
        seq_lens_host=seq_lens,
    )  # fmt: skip
    slots = [c.slot for c in chunks]
    snapshots = [(b, n, slot) for b, c in enumerate(chunks) for n, slot in c.snapshots]
    states = StateMetadata(torch.tensor(slots), slots, snapshots)
    hidden = model(torch.tensor(ids), torch.tensor(positions), ForwardContext(meta, caches, states))
    return model.compute_logits(hidden)


def in_pieces(model, prompt: list[int], pieces: list[int], blocks: list[int], slot: int) -> torch.Tensor | None:
    """``prompt`` run as one sequence in steps of ``pieces`` tokens each; every token's logits (None off rank 0)."""
    caches, out, start = allocate(model), [], 0
    for n in pieces:
        out.append(run_step(model, caches, [Chunk(prompt[start : start + n], start, blocks, slot)]))
        start += n
    assert start == len(prompt)
    return None if out[0] is None else torch.cat(out)


def transformers_logits(path, prompt: list[int]) -> torch.Tensor:
    architecture = read_model_config(path).architecture  # Qwen3_5ForConditionalGeneration: the whole model
    hf = getattr(transformers, architecture).from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0]


@pytest.mark.parametrize("name", HYBRIDS)
def test_a_prompt_in_one_chunk_in_three_and_decoded_gives_transformers_logits(name, hybrid_dirs):
    path = hybrid_dirs[name]
    model, prompt = build(path), random_prompts([50], seed=40)[0]
    kinds = [type(s) for s in model.cache_specs()]
    assert PagedKV in kinds and RecurrentState in kinds
    whole = in_pieces(model, prompt, [50], blocks=[3, 0, 5, 1, 7, 2, 4], slot=2)
    expected = transformers_logits(path, prompt)
    rel = (whole - expected).norm(dim=-1) / expected.norm(dim=-1)
    assert rel.max().item() < 1e-4
    # three chunks (one of one token), each from the states and KV the last left, then decoding one at a time
    pieces = in_pieces(model, prompt, [17, 1, 22] + [1] * 10, blocks=[6, 1, 0, 2, 5, 3, 4], slot=4)
    torch.testing.assert_close(pieces, whole, **SAME)


def test_stacked_experts_load_as_the_published_per_expert_ones(hybrid_dirs, tmp_path):
    # transformers reads Qwen3.5-MoE's experts per expert (experts.N.gate_proj) or stacked (experts.gate_up_proj)
    stacked = make_tiny_model(tmp_path, **TINY_PRESETS["qwen3_5_moe"], expert_layout="stacked")
    prompt = random_prompts([12], seed=43)[0]
    per_expert = in_pieces(build(hybrid_dirs["qwen3_5_moe"]), prompt, [12], blocks=[0, 1], slot=0)
    torch.testing.assert_close(in_pieces(build(stacked), prompt, [12], blocks=[0, 1], slot=0), per_expert)


def test_a_snapshot_taken_mid_chunk_restores_into_another_sequence(hybrid_dirs):
    # Prefix caching's contract (layers/cache_spec.py): the engine copies a snapshot into a new sequence's live
    # slot before its step, and its cached KV blocks are the prefix's. The second prompt shares 24 tokens (three
    # blocks) with the first, which runs beside a decoding sequence and takes a snapshot after them, mid-chunk.
    path = hybrid_dirs["qwen3_5_moe"]
    model = build(path)
    first, other, tail = random_prompts([40, 9, 13], seed=41)
    second = first[:24] + tail
    caches = allocate(model)
    run_step(model, caches, [Chunk(other[:8], 0, [9], slot=1)])
    run_step(model, caches, [Chunk(other[8:], 8, [9, 10], slot=1), Chunk(first, 0, [0, 1, 2, 3, 4], 0, [(24, 5)])])
    for cache in caches:  # restore: snapshot 5 -> the second sequence's live slot 3
        if isinstance(cache, StateCache):
            for t in cache.tensors:
                t[3] = t[5]
    got = run_step(model, caches, [Chunk(tail, 24, [0, 1, 2, 11, 12], slot=3)])
    expected = transformers_logits(path, second)[24:]
    rel = (got - expected).norm(dim=-1) / expected.norm(dim=-1)
    assert rel.max().item() < 1e-4


def test_the_vision_tower_and_multi_token_prediction_are_skipped_with_a_line_each(hybrid_dirs, tmp_path, caplog):
    path = tmp_path / "vl"
    shutil.copytree(hybrid_dirs["qwen3_5_vl"], path)
    mtp = {"mtp.fc.weight": torch.randn(64, 128), "mtp.layers.0.input_layernorm.weight": torch.randn(64)}
    save_file(mtp, path / "mtp.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="nanostream.models.loader"):
        model = build(path)
    lines = [r.getMessage() for r in caplog.records if "not loaded" in r.getMessage()]
    assert len(lines) == 2 and "2 tensors under mtp.*" in lines[0] + lines[1]
    assert any("under model.visual.*" in line for line in lines)
    assert model.spec.checkpoint_prefixes[0] == ("model.language_model.", "model.")
    assert model.spec.tie_word_embeddings  # the wrapper's tie_word_embeddings, as transformers ties


@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_next"])
def test_two_ranks_split_the_deltanet_by_key_heads_and_give_one_ranks_logits(name, hybrid_dirs):
    path = hybrid_dirs[name]
    prompt = random_prompts([30], seed=42)[0]
    expected = in_pieces(build(path), prompt, [20, 1, 9], blocks=[0, 1, 2, 3], slot=0)

    def forward(tp: TensorParallel):
        model = build(path, tp)
        specs = model.cache_specs()
        return specs, in_pieces(model, prompt, [20, 1, 9], blocks=[0, 1, 2, 3], slot=0)

    out = in_threads(2, forward)
    whole = build(path).cache_specs()
    for rank, (specs, logits) in out.items():
        for half, full in zip(specs, whole, strict=True):
            if isinstance(full, RecurrentState):  # half the channels and value heads on each rank
                (conv, ssm), (full_conv, full_ssm) = half.tensors, full.tensors
                assert conv.shape == (full_conv.shape[0] // 2, full_conv.shape[1])
                assert ssm.shape == (full_ssm.shape[0] // 2, *full_ssm.shape[1:]) and ssm.dtype == torch.float32
            else:
                assert half == PagedKV(full.num_kv_heads // 2, full.head_dim)
        assert (logits is None) == (rank > 0)
    # the row-parallel sums add in another order: float32 rounding apart, the same greedy tokens
    torch.testing.assert_close(out[0][1], expected, rtol=1e-4, atol=5e-5)
    assert torch.equal(out[0][1].argmax(-1), expected.argmax(-1))


def test_a_split_the_deltanet_cannot_make_names_its_key_heads():
    config = tiny_config("Qwen3_5ForCausalLM", linear_num_key_heads=3, linear_num_value_heads=6)
    spec = decoder_spec(config, max_model_len=64)
    with pytest.raises(ValueError, match=r"linear_num_key_heads \(3\) is not divisible by it"):
        check_split(spec, 2)


@pytest.mark.parametrize(
    "architecture, overrides, message",
    [
        ("Qwen3_5ForCausalLM", dict(layer_types=["linear_attention", "sliding_attention"] * 2), "sliding_attention"),
        ("Qwen3NextForCausalLM", dict(attn_output_gate=False), "attn_output_gate=False"),
        ("Qwen3_5MoeForCausalLM", dict(hidden_act="gelu"), "hidden_act='gelu'"),
        ("Qwen3_5ForCausalLM", dict(linear_num_key_heads=3), "linear_num_value_heads=4 and linear_num_key_heads=3"),
    ],
)
def test_what_the_hybrid_layers_do_not_run_is_refused_by_name(architecture, overrides, message):
    with pytest.raises(ModelLoadError, match=message):
        decoder_spec(tiny_config(architecture, **overrides), max_model_len=64)


def test_the_declaration_reads_the_layer_kinds_and_the_deltanet_shape():
    spec = decoder_spec(tiny_config("Qwen3NextForCausalLM"), max_model_len=64)
    assert spec.token_mixers == ("gated_deltanet", "attention", "gated_deltanet", "attention")
    gdn = spec.gated_deltanet
    assert (gdn.num_k_heads, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim, gdn.conv_kernel) == (2, 4, 16, 8, 4)
    assert gdn.fused_projections
    assert (spec.attn_output_gate, spec.norm_weight_offset, spec.rope.rotary_dim) == (True, 1.0, 4)
    assert spec.moe.layers == (0, 1, 3) and spec.moe.shared_expert_intermediate_size == 48  # mlp_only_layers [2]
    moe = decoder_spec(tiny_config("Qwen3_5MoeForCausalLM"), max_model_len=64)
    assert moe.moe.layers == (0, 1, 2, 3) and moe.moe.renormalize and moe.intermediate_size == 0
    # Qwen3.5's M-RoPE keys: text positions are one position, the 1-D rotary embedding
    rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
            "mrope_interleaved": True}  # fmt: skip
    dense = decoder_spec(tiny_config("Qwen3_5ForCausalLM", rope_parameters=rope), max_model_len=64)
    assert (dense.rope.theta, dense.rope.rotary_dim, dense.gated_deltanet.fused_projections) == (1e7, 4, False)
