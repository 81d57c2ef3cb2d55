"""The vision side of the tiny vision-language models (testing/tiny_model.py): their vision tower's config, their
image placeholder tokens, and transformers' own image processor at the tiny tower's patch size.

Gemma 3's (``gemma3_vl``): a SigLIP tower of 4 x 4 patches (56 px, 14 px patches) pooled to 4 tokens, a tokenizer
with Gemma 3's image tokens whose chat template writes ``<start_of_image>`` for an image part, and whose BPE merges
blank lines (so that the new lines Gemma3Processor writes around an image merge with the text beside them).
Gemma 4's (``gemma4_vl``, testing/tiny_families.py): a tower of 4-pixel patches pooled 2 x 2, images resized to at most
70 tokens; a tokenizer with Gemma 4's image and audio tokens whose chat template writes ``<|image|>`` for an image
part."""

from __future__ import annotations

TINY_QWEN_VISION = dict(
    depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4, num_position_embeddings=16
)
"""The Qwen3.5 vision tower of a tiny model: one block; its merger's width is set to the language model's."""
VL_MULTIMODAL = {
    "Qwen3VLForConditionalGeneration": (
        "Qwen3VLForCausalLM", "Qwen3VLConfig", dict(TINY_QWEN_VISION, depth=2, deepstack_visual_indexes=[0, 1]),
    ),
    "Qwen3VLMoeForConditionalGeneration": (
        "Qwen3VLMoeForCausalLM", "Qwen3VLMoeConfig", dict(TINY_QWEN_VISION, depth=2, deepstack_visual_indexes=[0, 1]),
    ),
    "Gemma3ForConditionalGeneration": (
        "Gemma3ForCausalLM", "Gemma3Config",
        dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=56,
             patch_size=14, vision_use_head=False),
    ),
    "Qwen2_5_VLForConditionalGeneration": (  # windows of 16 pixels (2 x 2 merged patches); block 1 attends whole
        "Qwen2_5_VLForCausalLM", "Qwen2_5_VLConfig",
        dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4, window_size=16,
             fullatt_block_indexes=[1]),
    ),
}  # fmt: skip
"""Qwen3-VL: its language model (a Qwen3 decoder with M-RoPE), a two-block tower whose both blocks feed DeepStack;
Qwen2.5-VL: a Qwen2 decoder with M-RoPE in three runs, a windowed tower."""
VL_ARCHITECTURES = ("Qwen3VLForCausalLM", "Qwen3VLMoeForCausalLM", "Qwen2_5_VLForCausalLM", *VL_MULTIMODAL)
VL_PRESETS = {
    "qwen3_vl": dict(architecture="Qwen3VLForConditionalGeneration", seed=25, tie_word_embeddings=False),
    "qwen3_vl_moe": dict(architecture="Qwen3VLMoeForConditionalGeneration", seed=27, tie_word_embeddings=False),
    "qwen25_vl": dict(architecture="Qwen2_5_VLForConditionalGeneration", seed=26, tie_word_embeddings=False),
    # untied: a tied tiny Gemma 3 repeats its last token whatever it sees, which no parity test could tell apart; no
    # final soft cap, as Gemma 3's configs (transformers' multimodal Gemma 3 ignores one)
    "gemma3_vl": dict(
        architecture="Gemma3ForConditionalGeneration", seed=28, tie_word_embeddings=False, final_logit_softcapping=None
    ),
}
VL_CONFIG_CLASSES = {
    "Qwen3VLForCausalLM": "Qwen3VLTextConfig", "Qwen3VLMoeForCausalLM": "Qwen3VLMoeTextConfig",
    "Qwen2_5_VLForCausalLM": "Qwen2_5_VLTextConfig",
}  # fmt: skip
VL_CONFIGS = {  # head_dim 16: 8 rotary pairs, split (4, 2, 2) between time, height and width
    "Qwen3VLForCausalLM": dict(head_dim=16, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                                  mrope_section=[4, 2, 2], mrope_interleaved=True)),
    "Qwen3VLMoeForCausalLM": dict(  # 8 experts of 24 (not square: the stacked layouts differ), 2 a token; a dense layer
        head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, num_hidden_layers=3,
        mlp_only_layers=[1], rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 2, 2],
                                                  mrope_interleaved=True),
    ),
    "Qwen2_5_VLForCausalLM": dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                        mrope_section=[2, 3, 3])),  # 8 pairs: 2, then 3, then 3
}  # fmt: skip
PLAIN_NORMS = frozenset(VL_MULTIMODAL) - {"Gemma3ForConditionalGeneration"} | {"Gemma4ForConditionalGeneration"}
"""Multimodal models whose norms multiply by w (Qwen3's), not by 1 + w (a tower's LayerNorms always by w)."""
_QWEN_TOKENS = dict(
    vision_start_token_id="<|vision_start|>", vision_end_token_id="<|vision_end|>", image_token_id="<|image_pad|>",
    video_token_id="<|video_pad|>",
)  # fmt: skip
VISION_TOKENS = dict.fromkeys(
    ("Qwen3_5ForConditionalGeneration", "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration",
     "Qwen2_5_VLForConditionalGeneration"), _QWEN_TOKENS,
)  # fmt: skip
OUT_WIDTH = frozenset(VISION_TOKENS)
"""Towers whose merger's output width is set to the text model's (Qwen's: Gemma 3's projector reads the text config)."""
_GEMMA_TOKENS = dict(boi_token="<start_of_image>", eoi_token="<end_of_image>", image_token="<image_soft_token>")
VISION_TOKENS["Gemma3ForConditionalGeneration"] = dict(
    zip(("boi_token_index", "eoi_token_index", "image_token_index"), _GEMMA_TOKENS.values())
)
"""The tiny vision-language models whose images run: their placeholder tokens, added to the tiny tokenizer."""
MM_TOKENS_PER_IMAGE = 4  # Gemma 3's tiny tower: 4 x 4 patches, averaged 2 x 2
GEMMA4_TOKENS = dict(
    boi_token="<|image>", image_token="<|image|>", eoi_token="<image|>", boa_token="<|audio>", audio_token="<|audio|>",
    eoa_token="<audio|>", video_token="<|video|>",
)  # fmt: skip
VISION_TOKENS["Gemma4ForConditionalGeneration"] = dict(
    zip(("boi_token_id", "image_token_id", "eoi_token_id", "boa_token_id", "audio_token_id", "eoa_token_index",
         "video_token_id"), GEMMA4_TOKENS.values())
)  # fmt: skip
GEMMA4_SOFT_TOKENS = 70  # at most an image (the fewest Gemma 4's image processor offers)
_EXTRA_TOKENS = {"Gemma3ForConditionalGeneration": _GEMMA_TOKENS, "Gemma4ForConditionalGeneration": GEMMA4_TOKENS}


def tokenizer_of(architecture: str):
    """The tiny tokenizer of ``architecture``: with its images' placeholder tokens where its images run."""
    from nanostream.testing.tokenizer import CHAT_TEMPLATE, CORPUS, build_tokenizer

    if architecture not in _EXTRA_TOKENS:
        return with_vision_tokens(build_tokenizer(), architecture)
    tokens = _EXTRA_TOKENS[architecture]
    blank_lines = ["user\n\n", "\n\n", "\n\n\n", "\n\n\n\n", ".\n\n"] * 20  # merges of new lines
    base = build_tokenizer(texts=[*CORPUS.splitlines(), *blank_lines])
    base.add_special_tokens({"additional_special_tokens": list(tokens.values())})
    tokenizer = type(base)(
        tokenizer_object=base.backend_tokenizer, eos_token=base.eos_token, pad_token=base.pad_token,
        clean_up_tokenization_spaces=False, extra_special_tokens=tokens,
    )  # fmt: skip
    part = tokens["boi_token"] if architecture == "Gemma3ForConditionalGeneration" else tokens["image_token"]
    tokenizer.chat_template = CHAT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", part)
    return tokenizer


def with_vision_tokens(tokenizer, architecture: str):
    """``tokenizer`` with the placeholder tokens of ``architecture``'s images, where its images run."""
    if architecture in VISION_TOKENS:
        tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS[architecture].values())})
    return tokenizer


def image_processor(config):
    """transformers' image processor of a tiny vision-language model (its PIL backend). Qwen's: images resized to
    multiples of patch x merge pixels, between 16x16 and 64x64 pixels' worth; Gemma 3's: to the tower's size."""
    from transformers import Gemma3ImageProcessorPil, Gemma4ImageProcessorPil, Qwen2VLImageProcessorPil

    vision = config.vision_config
    if vision.model_type == "gemma4_vision":
        return Gemma4ImageProcessorPil(
            patch_size=vision.patch_size, pooling_kernel_size=vision.pooling_kernel_size,
            max_soft_tokens=GEMMA4_SOFT_TOKENS,
        )  # fmt: skip
    if vision.model_type == "siglip_vision_model":
        return Gemma3ImageProcessorPil(size={"height": vision.image_size, "width": vision.image_size})
    unit = vision.patch_size * vision.spatial_merge_size
    return Qwen2VLImageProcessorPil(
        patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
        merge_size=vision.spatial_merge_size, size={"shortest_edge": 4 * unit**2, "longest_edge": 64 * unit**2},
    )  # fmt: skip


def vision_token_ids(architecture: str) -> tuple[dict[str, int], int] | None:
    """The config's placeholder token ids (``image_token_id``, ...) of a tiny model whose images run, and its
    vocabulary's size with them; None for any other architecture."""
    if architecture not in VISION_TOKENS:
        return None
    tokenizer = tokenizer_of(architecture)
    ids = {key: tokenizer.convert_tokens_to_ids(token) for key, token in VISION_TOKENS[architecture].items()}
    if architecture == "Gemma3ForConditionalGeneration":
        ids["mm_tokens_per_image"] = MM_TOKENS_PER_IMAGE
    if architecture in _EXTRA_TOKENS:  # its vocabulary a multiple of 8, as published ones are (so tensor-parallel
        return ids, -(-len(tokenizer) // 8) * 8  # ranks split it)
    return ids, len(tokenizer)


def save_image_processor(config, architecture: str, path) -> None:
    """Write transformers' image processor of a tiny model whose images run into its directory (else nothing)."""
    if architecture in VISION_TOKENS:
        image_processor(config).save_pretrained(path)
