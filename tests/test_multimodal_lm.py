"""Images in, text out, at the model level (issue 58): Qwen3.5's language model with M-RoPE positions and image
embeddings written over the prompt's placeholder tokens, against transformers' own Qwen3_5ForConditionalGeneration
on a tiny random checkpoint (every tensor drawn, norms included) and images made by its image processor.

nanostream's side is its own pieces, driven by hand on one sequence (no engine): the vision encoder's embeddings,
``mrope_positions``, and ``DecoderForCausalLM`` on a KV pool and a state pool from its ``cache_specs()``.

- The M-RoPE rotation equals transformers' Qwen3.5 rotary embedding and ``apply_rotary_pos_emb`` bit for bit
  (``torch.equal``): every angle is read from a table row that holds the same float32 product transformers takes.
- The prompt's logits equal transformers' to a relative 1e-5 a token (about 2e-6 here, as on a text prompt, which
  is not bit-equal either): nanostream's fused projections and chunked Gated DeltaNet sum in float32 in another
  order than transformers. Without the images' rows, or with 1-D positions, they are 1e4 to 1e5 times further off.
- A text prompt through [3, T] positions gives the [T] path's logits exactly; the prompt in chunks (one cut inside
  an image) with each chunk's positions and rows continues from the cached KV and states to the whole's logits.

Qwen3-VL's language model (a Qwen3 decoder with M-RoPE and DeepStack) is not a nanostream architecture yet, so
neither its rotary nor DeepStack is here.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from test_hybrid_model import BLOCK, allocate
from test_vision_encoder import IMAGE, TOKENS, VISION, _images, _prompt
from transformers import AutoConfig, AutoImageProcessor, Qwen2VLImageProcessorPil, Qwen3_5Config, Qwen3_5TextConfig
from transformers import Qwen3_5ForConditionalGeneration as HFModel
from transformers.models.qwen3_5 import modeling_qwen3_5

from nanostream import ModelLoadError
from nanostream.layers.attention import ForwardContext
from nanostream.layers.attention_backend import AttentionMetadata, TorchAttention
from nanostream.layers.cache_spec import StateMetadata
from nanostream.layers.layer_kernels import LayerKernels
from nanostream.layers.rope_config import rope_spec
from nanostream.layers.rotary import RotaryEmbedding
from nanostream.models import ARCHITECTURES, PlaceholderEmbeds, decoder_spec, load_model
from nanostream.models.model_config import read_model_config
from nanostream.models.vision import QwenVisionEncoder, QwenVisionSpec, load_vision_weights, mrope_positions

# head_dim 32, half of it rotating: 8 pairs split (4, 2, 2), so the section's bounds cut the interleave short
ROPE = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5, mrope_section=[4, 2, 2])
TEXT = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=300,
    max_position_embeddings=1024,
    rope_parameters=ROPE,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
)
VISION = dict(VISION, depth=2, out_hidden_size=64)  # the encoder of test_vision_encoder.py, two blocks
REL = 1e-5  # per token, nanostream against transformers (see the module docstring)
SAME = dict(rtol=1e-5, atol=1e-5)  # one model, the same tokens in chunks: float32 rounding apart
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory, transformers model) of a tiny Qwen3.5 vision-language checkpoint, every tensor random."""
    torch.manual_seed(0)
    model = HFModel(Qwen3_5Config(vision_config=VISION, text_config=TEXT, **TOKENS)).eval()
    gen = torch.Generator().manual_seed(58)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith(("A_log", "dt_bias")):  # a DeltaNet decay of about 0.9 a token
                param.copy_((-2.0 if name.endswith("A_log") else -1.0) + 0.5 * torch.randn(param.shape, generator=gen))
            elif "norm" in name and name.endswith("weight"):  # (1 + w) norms near 1, plain ones (w) too
                centred = "language_model" in name and "linear_attn" not in name
                param.copy_((0.0 if centred else 1.0) + 0.2 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.15 * torch.randn(param.shape, generator=gen))
    path = tmp_path_factory.mktemp("qwen3_5_vl")
    model.save_pretrained(path)
    Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2).save_pretrained(path)
    return path, model


def _nanostream(path):
    spec = decoder_spec(read_model_config(path).hf_config, max_model_len=512)
    model = load_model(spec, LayerKernels(TorchAttention()), path, dtype=torch.float32, device=CPU)
    encoder = QwenVisionEncoder(QwenVisionSpec.from_config(AutoConfig.from_pretrained(path).vision_config))
    load_vision_weights(encoder, path)
    return model, encoder.eval()


@torch.inference_mode()
def _step(model, caches, ids, positions, start, embeds=None, blocks=(3, 0, 5, 1, 7, 2, 4, 6), slot=1):
    """Tokens ``ids`` of one sequence with ``start`` tokens before them in its caches: their logits [T, V]."""
    n = len(ids)
    kv_slots = [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + n)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(kv_slots), cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([start + n], dtype=torch.int32),
        block_tables=torch.tensor([list(blocks)], dtype=torch.int32), max_seqlen_q=n, max_seqlen_k=start + n,
        cu_seqlens_q_host=[0, n], seq_lens_host=[start + n],
    )  # fmt: skip
    states = StateMetadata(torch.tensor([slot]), [slot], [])
    return model.compute_logits(model(torch.tensor(ids), positions, ForwardContext(meta, caches, states), embeds))


def _rel(got, want):
    return ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()


# the rotary layer alone


def _hf_rotation(config, q, k, positions):
    """transformers' Qwen3.5 rotation of q [T, Hq, D], k [T, Hkv, D] at positions [3, T] (or [T])."""
    q_hf, k_hf = q.transpose(0, 1)[None], k.transpose(0, 1)[None]  # [1, H, T, D]
    rotary = modeling_qwen3_5.Qwen3_5TextRotaryEmbedding(config)
    cos, sin = rotary(q_hf, positions[..., None, :])  # [3, 1, T] (or [1, T], which it expands to three rows)
    q_out, k_out = modeling_qwen3_5.apply_rotary_pos_emb(q_hf, k_hf, cos, sin)
    return q_out[0].transpose(0, 1), k_out[0].transpose(0, 1)


@pytest.mark.parametrize(
    "text", [dict(head_dim=32, rope_parameters=ROPE), dict(head_dim=256)], ids=["section 4-2-2", "default 11-11-10"]
)
def test_mrope_rotation_equals_transformers_qwen3_5(text):
    config = Qwen3_5TextConfig(**text, max_position_embeddings=4096)
    head_dim = config.head_dim
    spec = rope_spec(
        config.rope_parameters, head_dim=head_dim, max_position_embeddings=4096, allowed=("default",),
        model="Qwen3_5ForCausalLM", partial_rotary=True, mrope=ARCHITECTURES["Qwen3_5ForCausalLM"].mrope,
    )  # fmt: skip
    assert spec.mrope_section == tuple(config.rope_parameters.get("mrope_section", (11, 11, 10)))
    gen = torch.Generator().manual_seed(head_dim)
    positions = torch.randint(0, 4096, (3, 40), generator=gen)
    q, k = torch.randn(40, 4, head_dim, generator=gen), torch.randn(40, 2, head_dim, generator=gen)
    order = spec.head_order(head_dim)
    ours = RotaryEmbedding(head_dim, 4096, spec)
    got_q, got_k = ours(positions, q[..., order], k[..., order])
    want_q, want_k = _hf_rotation(config, q, k, positions)
    assert torch.equal(got_q, want_q[..., order]) and torch.equal(got_k, want_k[..., order])
    # a text token's three equal positions: the [T] path's rotation, and transformers' of 1-D positions
    text_q, text_k = ours(positions[0], q[..., order], k[..., order])
    assert torch.equal(ours(positions[0].expand(3, -1), q[..., order], k[..., order])[0], text_q)
    assert torch.equal(text_k, _hf_rotation(config, q, k, positions[0])[1][..., order])
    assert not torch.equal(got_q, text_q)  # the three rows differ: so do the rotations


def test_mrope_in_three_runs_equals_transformers_qwen2_5_vl():
    # Qwen2.5-VL splits the pairs into runs (2 temporal, 3 height, 3 width of 8), not Qwen3.5's interleave
    from transformers import Qwen2_5_VLTextConfig
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as qwen25

    params = dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])
    config = Qwen2_5_VLTextConfig(hidden_size=64, num_attention_heads=4, rope_parameters=params)
    spec = rope_spec(
        params, head_dim=16, max_position_embeddings=4096, allowed=("default",), model="Qwen2_5_VLForCausalLM",
        mrope=(16, 24, 24), mrope_interleaved=False,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(25)
    positions = torch.randint(0, 4096, (3, 40), generator=gen)
    q, k = torch.randn(40, 4, 16, generator=gen), torch.randn(40, 2, 16, generator=gen)
    got_q, got_k = RotaryEmbedding(16, 4096, spec)(positions, q, k)
    q_hf, k_hf = q.transpose(0, 1)[None], k.transpose(0, 1)[None]
    cos, sin = qwen25.Qwen2_5_VLRotaryEmbedding(config)(q_hf, positions[:, None, :])
    want_q, want_k = (x[0].transpose(0, 1) for x in qwen25.apply_rotary_pos_emb(q_hf, k_hf, cos, sin))
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    interleaved = RotaryEmbedding(16, 4096, dataclasses.replace(spec, mrope_interleaved=True))
    assert not torch.equal(interleaved(positions, q, k)[0], want_q)  # the layouts differ: the test tells them apart


def test_positions_of_the_wrong_shape_and_bad_sections_are_refused():
    plain = RotaryEmbedding(16, 64, rope_spec({"rope_theta": 1e4}, **_ROPE_ARGS))
    q = torch.randn(5, 2, 16)
    with pytest.raises(ValueError, match=r"takes \[T\] positions$"):
        plain(torch.zeros(3, 5, dtype=torch.long), q, q)
    mrope = RotaryEmbedding(16, 64, rope_spec({"rope_theta": 1e4}, **_ROPE_ARGS, mrope=(4, 2, 2)))
    with pytest.raises(ValueError, match=r"or M-RoPE's \[3, T\]"):
        mrope(torch.zeros(2, 5, dtype=torch.long), q, q)
    with pytest.raises(ModelLoadError, match="mrope_section"):
        rope_spec({"rope_theta": 1e4, "mrope_section": [4, 4]}, **_ROPE_ARGS, mrope=(4, 2, 2))


_ROPE_ARGS = dict(head_dim=16, max_position_embeddings=64, allowed=("default",), model="Qwen3_5ForCausalLM")


# the language model on a prompt with images

SIZES = [(56, 84), (84, 140)]  # (height, width): two images of unlike grids


@pytest.fixture(scope="module")
def image_prompt(checkpoint):
    """(token ids, pixel values, grids [n, 3]) of a prompt with the two images amid text."""
    path, _ = checkpoint
    inputs = AutoImageProcessor.from_pretrained(path)(images=_images(SIZES), return_tensors="pt")
    grids = inputs["image_grid_thw"]
    return _prompt(grids.tolist(), [5, 3, 4]), inputs["pixel_values"], grids


def _placeholders(model_ids, encoder, pixels, grids):
    ids = torch.tensor(model_ids)
    with torch.no_grad():
        rows = encoder(pixels, grids).embeds
    return PlaceholderEmbeds((ids == IMAGE).nonzero()[:, 0], rows)


def test_a_prompt_with_images_gives_transformers_logits(checkpoint, image_prompt):
    path, hf = checkpoint
    ids, pixels, grids = image_prompt
    with torch.no_grad():
        want = hf(
            input_ids=torch.tensor([ids]), pixel_values=pixels, image_grid_thw=grids,
            mm_token_type_ids=(torch.tensor([ids]) == IMAGE).int(),
        ).logits[0]  # fmt: skip
    model, encoder = _nanostream(path)
    positions, delta = mrope_positions(ids, grids, IMAGE, spatial_merge_size=2)
    assert delta < 0
    embeds = _placeholders(ids, encoder, pixels, grids)
    got = _step(model, allocate(model), ids, positions, 0, embeds)
    assert _rel(got, want) < REL
    # the images' rows and their 2-D positions both matter: without either, the logits are far from transformers'
    assert _rel(_step(model, allocate(model), ids, positions, 0), want) > 100 * REL
    assert _rel(_step(model, allocate(model), ids, torch.arange(len(ids)), 0, embeds), want) > 100 * REL


def test_text_through_three_rows_equals_one_row(checkpoint):
    model, _ = _nanostream(checkpoint[0])
    ids = _prompt([], [37], seed=1)
    positions, delta = mrope_positions(ids, [], IMAGE, spatial_merge_size=2)
    assert delta == 0 and positions.shape == (3, 37)
    one_row = _step(model, allocate(model), ids, torch.arange(37), 0)
    assert torch.equal(_step(model, allocate(model), ids, positions, 0), one_row)


@pytest.mark.parametrize("cuts", [[7], [9, 20, 30]], ids=["two chunks", "four chunks"])
def test_a_prompt_with_images_in_chunks_gives_the_wholes_logits(checkpoint, image_prompt, cuts):
    """Chunks cut inside the first image (tokens 6-11), inside the second (17-28) and after it: each chunk's slice
    of the positions and its part of the images' rows, at its own token indices, continue from the caches the
    chunk before left."""
    ids, pixels, grids = image_prompt
    assert grids.tolist() == [[1, 4, 6], [1, 6, 8]]  # the cuts above fall where the docstring says
    model, encoder = _nanostream(checkpoint[0])
    positions, _ = mrope_positions(ids, grids, IMAGE, spatial_merge_size=2)
    embeds = _placeholders(ids, encoder, pixels, grids)
    whole = _step(model, allocate(model), ids, positions, 0, embeds)
    caches, pieces, bounds = allocate(model), [], [0, *cuts, len(ids)]
    for start, end in itertools.pairwise(bounds):
        inside = (embeds.index >= start) & (embeds.index < end)
        part = PlaceholderEmbeds(embeds.index[inside] - start, embeds.rows[inside])
        pieces.append(_step(model, caches, ids[start:end], positions[:, start:end], start, part))
    torch.testing.assert_close(torch.cat(pieces), whole, **SAME)
