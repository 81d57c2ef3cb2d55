"""Model shapes the benchmarks build with random weights, and the build itself (reused when built alike).

    python apps/bench.py --preset qwen3-0.6b --build-dir /tmp/qwen3-0.6b-random
    with random_model(QWEN3_0_6B, {}, "/tmp/qwen3-0.6b-random") as path: ...

The mixture-of-experts shapes (Qwen3-30B-A3B, Mixtral-8x7B, gpt-oss-20b, and the latent-attention Moonlight-16B-A3B
and DeepSeek-V2-Lite) and Gemma-3-4B are written as
config.json and a tokenizer alone, and run with ``load_format="dummy"`` (``engine_defaults``): random
weights made on the device, no 8-90 GB file on disk.

This module imports nothing of nanostream until a model is built, so that apps/bench_kernels.py's
kernel sections can read the attention shape on a machine where nanostream does not import.
"""

from __future__ import annotations

import contextlib
import copy
import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

QWEN3_0_6B = "qwen3-0.6b"
QWEN3_8B = "qwen3-8b"
QWEN3_8B_FP8 = "qwen3-8b-fp8"
QWEN3_30B_A3B = "qwen3-30b-a3b"
MIXTRAL_8X7B = "mixtral-8x7b"
GEMMA3_4B = "gemma-3-4b"
GPT_OSS_20B = "gpt-oss-20b"
QWEN3_5_9B = "qwen3.5-9b"
QWEN3_5_9B_VL = "qwen3.5-9b-vl"
QWEN3_6_35B_A3B = "qwen3.6-35b-a3b"
QWEN3_6_35B_A3B_FP8 = "qwen3.6-35b-a3b-fp8"
MOONLIGHT_16B_A3B = "moonlight-16b-a3b"
DEEPSEEK_V2_LITE = "deepseek-v2-lite"
LLAMA4_SCOUT_FP8 = "llama4-scout-fp8"
GEMMA4_TEXT = "gemma-4-text"

# make_tiny_model overrides, one preset a model: a base (what the Qwen3 shapes share, and what every
# preset has unless it says otherwise) and each model's departures from it.
BASE: dict = dict(
    head_dim=128,
    vocab_size=151936,
    tie_word_embeddings=False,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)
# The large shapes are built in bfloat16 (never whole in float32); those too large for a file are written
# as config.json and a tokenizer alone and run with load_format="dummy" (engine_defaults).
BF16 = dict(weights_dtype="bfloat16")
DUMMY = dict(weights_dtype="bfloat16", weights=False)


def preset(*parts: dict, **overrides) -> dict:
    """BASE, then each of ``parts``, then ``overrides``: later keys win."""
    out = copy.deepcopy(BASE)
    for part in (*parts, overrides):
        out.update(copy.deepcopy(part))
    return out


PRESETS: dict[str, dict] = {
    # init_std is a real model's: the tiny default (0.15) over 28 layers lets activations grow into bf16 overflow.
    QWEN3_0_6B: preset(
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        intermediate_size=3072,
        tie_word_embeddings=True,
        init_std=0.02,
    ),
    # Issue 17's larger shape (two GPUs): 16 GB in bfloat16.
    QWEN3_8B: preset(
        BF16,
        hidden_size=4096,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=12288,
        init_std=0.02,
    ),
    # Qwen3-30B-A3B's config.json: 128 experts of 768, 8 per token (renormalised), every layer MoE.
    QWEN3_30B_A3B: preset(
        DUMMY,
        architecture="Qwen3MoeForCausalLM",
        hidden_size=2048,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
    # Mixtral-8x7B-v0.1's config.json: 8 experts of 14336, 2 per token.
    MIXTRAL_8X7B: preset(
        DUMMY,
        architecture="MixtralForCausalLM",
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=32000,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
        sliding_window=None,
    ),
    # google/gemma-3-4b-it's text_config: five sliding layers (1,024 tokens, base 10k) to one full (base 1M,
    # linear scaling 8), head_dim 256.
    GEMMA3_4B: preset(
        DUMMY,
        architecture="Gemma3ForCausalLM",
        hidden_size=2560,
        num_hidden_layers=34,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        query_pre_attn_scalar=256,
        intermediate_size=10240,
        vocab_size=262208,
        sliding_window=1024,
        layer_types=[("full_attention" if (i + 1) % 6 == 0 else "sliding_attention") for i in range(34)],
        final_logit_softcapping=None,
        tie_word_embeddings=True,
        max_position_embeddings=131072,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    # openai/gpt-oss-20b's config.json (its bf16 form): 32 experts of 2,880, 4 per token; sliding (128 tokens)
    # and full layers alternating, attention sinks, YaRN (factor 32 over 4,096).
    GPT_OSS_20B: preset(
        DUMMY,
        architecture="GptOssForCausalLM",
        hidden_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=2880,
        num_local_experts=32,
        num_experts_per_tok=4,
        swiglu_limit=7.0,
        vocab_size=201088,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 12,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
            "rope_theta": 150000.0,
        },
    ),
}
# Qwen/Qwen3.5-9B's text_config (and Qwen3.6-35B-A3B's, the Qwen3.5-35B-A3B architecture): three Gated DeltaNet
# layers (16 key heads read by 32 value heads of 128) to each gated full-attention layer (head_dim 256, rotary on a
# quarter of it), vocabulary 248,320.
HYBRID = dict(
    DUMMY,
    head_dim=256,
    vocab_size=248320,
    max_position_embeddings=262144,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
)
PRESETS[QWEN3_5_9B] = preset(
    HYBRID,
    architecture="Qwen3_5ForCausalLM",
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=16,
    num_key_value_heads=4,
    intermediate_size=12288,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
)
PRESETS[QWEN3_5_9B]["layer_types"] *= 8
# 256 experts of 512, 8 per token, and a gated shared expert of 512 in every layer.
PRESETS[QWEN3_6_35B_A3B] = preset(
    HYBRID,
    architecture="Qwen3_5MoeForCausalLM",
    hidden_size=2048,
    num_hidden_layers=40,
    num_attention_heads=16,
    num_key_value_heads=2,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    num_experts=256,
    num_experts_per_tok=8,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 10,
)
# Multi-head latent attention (kv_lora_rank 512 + qk_rope_head_dim 64 a token a layer) and DeepSeek's router, both
# 27 layers of 16 heads of 128 + 64 query/key dims and 128 value dims, no q LoRA, 64 experts of 1,408 (6 a token) and
# 2 shared, the first layer dense. moonshotai/Moonlight-16B-A3B's config.json (DeepseekV3ForCausalLM: sigmoid scores,
# a correction bias, renormalised and scaled by 2.446); deepseek-ai/DeepSeek-V2-Lite's (softmax, greedy, DeepSeek's
# YaRN: factor 40 over 4,096, mscale 0.707).
_MLA_16B = dict(
    DUMMY, hidden_size=2048, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, head_dim=64,
    q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    n_routed_experts=64, num_experts_per_tok=6, moe_intermediate_size=1408, n_shared_experts=2,
    first_k_dense_replace=1, n_group=1, topk_group=1,
)  # fmt: skip
PRESETS[MOONLIGHT_16B_A3B] = preset(
    _MLA_16B, architecture="DeepseekV3ForCausalLM", intermediate_size=11264, vocab_size=163840,
    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
    topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.446,
    rope_interleave=True, bos_token_id=163584, eos_token_id=163586,
)  # fmt: skip
PRESETS[DEEPSEEK_V2_LITE] = preset(
    _MLA_16B, architecture="DeepseekV2ForCausalLM", intermediate_size=10944, vocab_size=102400,
    max_position_embeddings=163840, rms_norm_eps=1e-6, topk_method="greedy", norm_topk_prob=False,
    routed_scaling_factor=1.0, bos_token_id=100000, eos_token_id=100001,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "mscale": 0.707, "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096},
)  # fmt: skip
# Qwen/Qwen3-8B-FP8's quantization_config over the 8B shape: block-wise FP8 (128 x 128, dynamic activations),
# dummy FP8 weights with their scales made on the device. Its bf16 twin on the same random values:
# --preset qwen3-8b --tiny-config '{"weights": false}' --load-format dummy.
PRESETS[QWEN3_8B_FP8] = preset(
    PRESETS[QWEN3_8B],
    DUMMY,
    quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                         "weight_block_size": [128, 128]},
)  # fmt: skip


# Qwen3.6-35B-A3B in FP8 (its published -FP8 release's block-wise format), 35 GB: one H100 holds it with room for KV.
PRESETS[QWEN3_6_35B_A3B_FP8] = preset(
    PRESETS[QWEN3_6_35B_A3B], quantization_config=PRESETS[QWEN3_8B_FP8]["quantization_config"]
)

# meta-llama/Llama-4-Scout-17B-16E's text_config: 48 layers of 40 query heads over 8 KV heads of 128, chunks of 8,192
# tokens in three layers of four (the fourth NoPE, global, with the queries' temperature), every layer MoE: 16 experts
# of 8,192 (top 1, sigmoid) beside a shared one, vocabulary 202,048. 108 B parameters: in the block-wise FP8 format
# nanostream loads (its published FP8 release is another format), ~109 GB, one H200 with ~20 GB left for KV (~100k
# tokens at 192 KiB a token); an H100 refuses it at the KV pool's sizing. max_position_embeddings as published is
# 10M tokens; 128k here, so the default max_model_len fits a pool.
PRESETS[LLAMA4_SCOUT_FP8] = preset(
    DUMMY, architecture="Llama4ForCausalLM", hidden_size=5120, num_hidden_layers=48, num_attention_heads=40,
    num_key_value_heads=8, head_dim=128, intermediate_size=8192, intermediate_size_mlp=16384, num_local_experts=16,
    num_experts_per_tok=1, interleave_moe_layer_step=1, vocab_size=202048, max_position_embeddings=131072,
    rms_norm_eps=1e-5, attention_chunk_size=8192, attn_temperature_tuning=True, floor_scale=8192, attn_scale=0.1,
    use_qk_norm=True, no_rope_layers=[int((i + 1) % 4 != 0) for i in range(48)],
    layer_types=[("full_attention" if (i + 1) % 4 == 0 else "chunked_attention") for i in range(48)],
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 1.0, "original_max_position_embeddings": 8192},
    bos_token_id=200000, eos_token_id=200001,
    quantization_config=PRESETS[QWEN3_8B_FP8]["quantization_config"],
)  # fmt: skip

# Qwen3.5-9B as published: the 9B's language model and its vision tower (27 blocks of 1152, 16-pixel patches
# merged 2 x 2 into one token of the language model's width, a 48 x 48 learned position grid).
PRESETS[QWEN3_5_9B_VL] = dict(
    PRESETS[QWEN3_5_9B], architecture="Qwen3_5ForConditionalGeneration",
    vision_config=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                       spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304),
)  # fmt: skip

# A Gemma 4 shape: transformers' Gemma4TextConfig defaults (its docstring names google/gemma-4-e2b-it; not checked
# against a published config.json): 30 layers of 8 query heads, five sliding layers (window 512, head 256, 4 KV
# heads) to one full (head 512, proportional rope over a quarter of its pairs), per-layer inputs of 256, vocabulary
# 262,144; with the last 10 layers reading earlier layers' KV through double-wide MLPs, as the E models do. ~5 B
# parameters (2 B of them the per-layer embedding table), ~10 GB in bf16: one GPU.
PRESETS[GEMMA4_TEXT] = preset(
    DUMMY, architecture="Gemma4ForCausalLM", hidden_size=2304, intermediate_size=9216, num_hidden_layers=30,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256, global_head_dim=512, num_global_key_value_heads=None,
    attention_k_eq_v=False, vocab_size=262144, vocab_size_per_layer_input=262144, hidden_size_per_layer_input=256,
    sliding_window=512, layer_types=[("full_attention" if i % 6 == 5 else "sliding_attention") for i in range(30)],
    num_kv_shared_layers=10, use_double_wide_mlp=True, final_logit_softcapping=30.0, tie_word_embeddings=True,
    max_position_embeddings=131072,
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                        "rope_theta": 1000000.0}},
)  # fmt: skip


def engine_defaults(preset: str | None) -> dict:
    """Engine options a preset needs: ``load_format="dummy"`` where it is built without weights."""
    return {"load_format": "dummy"} if PRESETS.get(preset, {}).get("weights", True) is False else {}


def attention_shape(preset: str) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of a preset."""
    p = PRESETS[preset]
    return p["num_attention_heads"], p["num_key_value_heads"], p["head_dim"]


@contextlib.contextmanager
def random_model(preset: str | None, tiny_config: dict, build_dir: str | None) -> Iterator[Path]:
    """A random model of ``preset``'s shape with ``tiny_config`` over it (both optional: make_tiny_model's
    defaults), built into ``build_dir`` and kept (reused when built alike), or into a temp dir."""
    from nanostream.testing import make_tiny_model

    overrides = {**PRESETS.get(preset, {}), **tiny_config}
    spec = json.dumps(overrides, sort_keys=True)
    with contextlib.ExitStack() as stack:
        path = Path(build_dir) if build_dir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        stamp = path / "bench_build.json"
        if stamp.is_file() and stamp.read_text() == spec:
            print(f"model: reusing {path} ({spec})")
        else:
            t = time.perf_counter()
            make_tiny_model(path, **overrides)
            stamp.write_text(spec)
            print(f"model: built {path} ({spec}) in {time.perf_counter() - t:.1f} s")
        yield path
