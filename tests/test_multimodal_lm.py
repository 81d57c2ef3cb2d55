"""Images in, text out, at the model level (issue 58): Qwen3.5's language model with M-RoPE positions, against
transformers' own Qwen3.5 rotary embedding.

- The M-RoPE rotation equals transformers' Qwen3.5 rotary embedding and ``apply_rotary_pos_emb`` bit for bit
  (``torch.equal``): every angle is read from a table row that holds the same float32 product transformers takes.

Qwen3-VL's language model (a Qwen3 decoder with M-RoPE and DeepStack) is not a nanostream architecture yet, so
neither its rotary nor DeepStack is here.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3_5TextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5

from nanostream import ModelLoadError
from nanostream.layers.rope_config import rope_spec
from nanostream.layers.rotary import RotaryEmbedding
from nanostream.models import ARCHITECTURES

# head_dim 32, half of it rotating: 8 pairs split (4, 2, 2), so the section's bounds cut the interleave short
ROPE = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5, mrope_section=[4, 2, 2])


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
