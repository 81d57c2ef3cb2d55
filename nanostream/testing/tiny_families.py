"""The tiny models of the families of 2025-2026 (make_tiny_model's, tiny_model.py): each config's departures,
exercised at a tiny size. Windows and chunks are shorter than the tests' prompts; every layer kind appears
between two others.
"""

from __future__ import annotations

_SLIDING, _FULL = "sliding_attention", "full_attention"
_WINDOWED = dict(sliding_window=24, num_hidden_layers=3, layer_types=[_SLIDING, _FULL, _SLIDING])
FAMILY_CONFIGS: dict[str, dict] = {
    "Olmo3ForCausalLM": dict(_WINDOWED),
    "Exaone4ForCausalLM": dict(_WINDOWED, head_dim=16),  # its full layer without rotary embedding
    "ApertusForCausalLM": dict(head_dim=16),  # Llama 3 rope, xIELU's scalars as transformers initialises them
    "SeedOssForCausalLM": dict(head_dim=16, attention_bias=True, attention_out_bias=True, mlp_bias=True),
    "HunYuanDenseV1ForCausalLM": dict(
        head_dim=16, attention_bias=True,
        rope_parameters=dict(rope_type="dynamic", alpha=1000.0, factor=1.0, rope_theta=10000.0),
    ),
    "Ernie4_5ForCausalLM": dict(head_dim=16, use_bias=True),
    "Ernie4_5_MoeForCausalLM": dict(  # a dense first layer, then experts with two shared ones, a correction bias
        head_dim=16, num_hidden_layers=3, moe_num_experts=8, moe_k=2, moe_intermediate_size=32,
        moe_num_shared_experts=2, moe_layer_start_index=1, moe_layer_end_index=-1, moe_layer_interval=1,
    ),
    "Ministral3ForCausalLM": dict(  # yarn and the queries' temperature past 64 positions
        head_dim=16,
        rope_parameters=dict(
            rope_type="yarn", rope_theta=1e6, factor=16.0, original_max_position_embeddings=64, beta_fast=32.0,
            beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.5,
        ),
    ),
    # Llama 4: chunks of 32 in three layers of four, the fourth without rotary embedding and with the queries'
    # temperature stepping every 16 positions; the MoE layers 1 and 3 (top 1 of 4 experts and a shared one)
    "Llama4ForCausalLM": dict(
        head_dim=16, num_hidden_layers=4, intermediate_size=32, intermediate_size_mlp=128, num_local_experts=4,
        interleave_moe_layer_step=2, attention_chunk_size=32, floor_scale=16, attn_scale=0.5,
        rope_parameters=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=256, rope_theta=500000.0),
    ),
    # LFM2: short convolutions (kernel 3) around two attention layers; its MLP shrunk to 2/3, rounded up to 32s
    "Lfm2ForCausalLM": dict(
        head_dim=16, num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "full_attention"],
        conv_L_cache=3, intermediate_size=192, block_multiple_of=32, block_ffn_dim_multiplier=1.0,
    ),
    # Gemma 4: sliding layers (window 24, head 16, two KV heads) and full ones (head 32, one KV head whose V is its K,
    # a quarter of its pairs turning); the last two layers read layers 2's and 3's KV with double-wide MLPs;
    # per-layer inputs of 8; the logits capped
    "Gemma4ForCausalLM": dict(
        head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, num_hidden_layers=6,
        layer_types=[_SLIDING, _FULL] * 3, sliding_window=24, num_kv_shared_layers=2, use_double_wide_mlp=True,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=512, final_logit_softcapping=8.0,
    ),
}  # fmt: skip
FAMILY_CONFIG_CLASSES: dict[str, str] = {
    "Llama4ForCausalLM": "Llama4TextConfig",
    "Gemma4ForCausalLM": "Gemma4TextConfig",
}
"""Architectures whose config class is not ``<prefix>Config`` (the text model's, not the multimodal one)."""
FAMILY_MULTIMODAL: dict[str, tuple[str, str, dict]] = {
    "Mistral3ForConditionalGeneration": (
        "Ministral3ForCausalLM", "Mistral3Config",
        dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
             num_attention_heads=2, head_dim=16, image_size=32, patch_size=16),
    ),
    "Llama4ForConditionalGeneration": (
        "Llama4ForCausalLM", "Llama4Config",
        dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
             patch_size=16, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32),
    ),
    "Gemma4ForConditionalGeneration": (
        "Gemma4ForCausalLM", "Gemma4Config",
        # two layers of four heads over two KV heads; 4-pixel patches pooled 2 x 2; images of at most 70 tokens; a
        # position table of 256 a side (start-up encodes a square of 4 x max_num_batched_tokens patches)
        dict(model_type="gemma4_vision", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=2,
             position_embedding_size=256),
    ),
}  # fmt: skip
"""A multimodal checkpoint's tiny model: its language model's architecture, its config class, its vision config."""
FAMILY_PRESETS: dict[str, dict] = {
    "olmo3": dict(architecture="Olmo3ForCausalLM", seed=30, tie_word_embeddings=False),
    "exaone4": dict(architecture="Exaone4ForCausalLM", seed=31, tie_word_embeddings=False),
    "apertus": dict(architecture="ApertusForCausalLM", seed=32, tie_word_embeddings=False),
    "seed_oss": dict(architecture="SeedOssForCausalLM", seed=33, tie_word_embeddings=False),
    "hunyuan": dict(architecture="HunYuanDenseV1ForCausalLM", seed=34, tie_word_embeddings=False),
    "ernie4_5": dict(architecture="Ernie4_5ForCausalLM", seed=35),  # tied, as published
    "ernie4_5_moe": dict(architecture="Ernie4_5_MoeForCausalLM", seed=36, tie_word_embeddings=False),
    "ministral3": dict(architecture="Ministral3ForCausalLM", seed=37, tie_word_embeddings=False),
    "mistral3_vl": dict(architecture="Mistral3ForConditionalGeneration", seed=38, tie_word_embeddings=False),
    "llama4": dict(architecture="Llama4ForCausalLM", seed=39, tie_word_embeddings=False),
    "llama4_vl": dict(architecture="Llama4ForConditionalGeneration", seed=40, tie_word_embeddings=False),
    "lfm2": dict(architecture="Lfm2ForCausalLM", seed=41),  # tied, as published
    "gemma4": dict(architecture="Gemma4ForCausalLM", seed=42),  # tied, as published
    # untied: a tied tiny Gemma repeats its last token whatever it sees (tiny_vision.py's gemma3_vl). Its images'
    # tokens attend causally (use_bidirectional_attention unset, as the small Gemma 4s; "vision" in the tests that
    # ask for it); its per-layer inputs cover every token id (the image tokens' too), as the published ones do
    "gemma4_vl": dict(architecture="Gemma4ForConditionalGeneration", seed=43, tie_word_embeddings=False,
                      vocab_size_per_layer_input=520),
    # Gemma 4's MoE block (enable_moe_block): the top 2 of 8 GeGLU experts beside every layer's dense MLP
    "gemma4_moe": dict(
        architecture="Gemma4ForCausalLM", seed=44, enable_moe_block=True, num_experts=8, top_k_experts=2,
        moe_intermediate_size=32,
    ),
}  # fmt: skip
FAMILY_ARCHITECTURES = (*FAMILY_CONFIGS, *FAMILY_MULTIMODAL)
