"""The tiny latent-attention models (multi-head latent attention and DeepSeek's router), for
``nanostream.testing.make_tiny_model``: every MLA part a real model has, at toy sizes.

DeepSeek-V3 with its q LoRA, interleaved rope dims, a dense first layer, a shared expert, the top 2 of 4 groups,
scaled weights and a correction bias; DeepSeek-V2 without q LoRA (V2-Lite), softmax scores, greedy, scaled but not
renormalised, its complex (interleaved) rotation; GLM-4.7-Flash with its layers' MLPs by name and values wider than
the nope dims; Mistral 4 with softmax scores in groups and its per-position query scale (a period short enough for
the tests' prompts to cross it).
"""

from __future__ import annotations

_MLA = dict(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
_ROUTED = dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, n_shared_experts=1)
YARN_MLA_ROPE = dict(
    rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128, beta_fast=32.0,
    beta_slow=1.0, mscale=0.8, mscale_all_dim=1.0,
)  # fmt: skip
"""DeepSeek's YaRN for a tiny MLA model: its cos/sin scaled by mscale(0.8) / mscale(1.0), its softmax scale by
mscale(1.0) squared."""
TINY_LATENT: dict[str, dict] = {
    "DeepseekV3ForCausalLM": dict(
        **_MLA, **_ROUTED, num_hidden_layers=3, q_lora_rank=32, first_k_dense_replace=1, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True,
    ),
    "DeepseekV2ForCausalLM": dict(
        **_MLA, **_ROUTED, num_hidden_layers=3, q_lora_rank=None, first_k_dense_replace=1, topk_method="greedy",
        routed_scaling_factor=1.5, norm_topk_prob=False,
    ),
    "Glm4MoeLiteForCausalLM": dict(
        **{**_MLA, "v_head_dim": 24}, **_ROUTED, num_hidden_layers=3, q_lora_rank=32, n_group=4, topk_group=2,
        routed_scaling_factor=1.8, norm_topk_prob=True, mlp_layer_types=["dense", "sparse", "sparse"],
    ),
    "Mistral4ForCausalLM": dict(
        **_MLA, **_ROUTED, num_hidden_layers=2, q_lora_rank=32, n_group=2, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=1.5,
        rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64, beta_fast=32.0,
            beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.1,
        ),
    ),
}  # fmt: skip
LATENT_ARCHITECTURES = tuple(TINY_LATENT)
LATENT_PRESETS: dict[str, dict] = {
    "deepseek_v3": dict(architecture="DeepseekV3ForCausalLM", seed=30, tie_word_embeddings=False),
    "deepseek_v2": dict(architecture="DeepseekV2ForCausalLM", seed=31, tie_word_embeddings=False),
    "glm4_moe_lite": dict(architecture="Glm4MoeLiteForCausalLM", seed=32, tie_word_embeddings=False),
    "mistral4": dict(architecture="Mistral4ForCausalLM", seed=33, tie_word_embeddings=False),
    "deepseek_v3_yarn": dict(
        architecture="DeepseekV3ForCausalLM", seed=34, tie_word_embeddings=False, rope_parameters=YARN_MLA_ROPE
    ),
}
