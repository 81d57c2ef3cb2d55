"""Rotary embeddings against transformers' own, family by family: the config read by ``rope_spec``, the tables
built from it, and nanostream's rotation of the head-permuted q and k equal to transformers' rotation, permuted
(``torch.equal``: both take the same float32 ops on the same values). Rope types and shapes nanostream cannot
run exactly raise ModelLoadError naming them."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import (
    Gemma3TextConfig,
    Gemma4TextConfig,
    Glm4Config,
    GptOssConfig,
    LlamaConfig,
    Phi3Config,
    Qwen3Config,
)
from transformers.models.gemma3 import modeling_gemma3
from transformers.models.gemma4 import modeling_gemma4
from transformers.models.glm4 import modeling_glm4
from transformers.models.gpt_oss import modeling_gpt_oss
from transformers.models.llama import modeling_llama
from transformers.models.phi3 import modeling_phi3
from transformers.models.qwen3 import modeling_qwen3

from nanostream import ModelLoadError
from nanostream.layers.rope_config import rope_spec
from nanostream.layers.rope_scaling import LongRopeScaling, YarnRopeScaling
from nanostream.layers.rotary import RopeSpec, RotaryEmbedding, permute_heads

ALL_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# Near 0, both sides of 2048 (the original length of the scaled configs below) and up to the table's end.
POSITIONS = [0, 1, 2, 3, 17, 100, 511, 1000, 1500, 2046, 2047, 2048, 2049, 3000, 4095, 4096, 6000, 8191]
ORIGINAL = 2048
MAX_POSITION = 8192


def _hf_rotation(module, rotary, q, k, positions, **forward_kwargs):
    """transformers' rotation of q [T, Hq, D], k [T, Hkv, D] at ``positions``, back in nanostream's layout."""
    q_hf, k_hf = q.transpose(0, 1)[None], k.transpose(0, 1)[None]  # [1, H, T, D]
    cos, sin = rotary(q_hf, torch.tensor(positions)[None], **forward_kwargs)
    q_out, k_out = module.apply_rotary_pos_emb(q_hf, k_hf, cos, sin)
    return q_out[0].transpose(0, 1), k_out[0].transpose(0, 1)


def _assert_same_rotation(spec, head_dim, module, rotary, positions, **forward_kwargs):
    gen = torch.Generator().manual_seed(len(positions) + head_dim)
    q = torch.randn(len(positions), 4, head_dim, generator=gen)
    k = torch.randn(len(positions), 2, head_dim, generator=gen)
    expected_q, expected_k = _hf_rotation(module, rotary, q, k, positions, **forward_kwargs)
    order = spec.head_order(head_dim)
    if order is None:
        order = torch.arange(head_dim)
    ours = RotaryEmbedding(head_dim, MAX_POSITION, spec)
    got_q, got_k = ours(torch.tensor(positions), q[..., order], k[..., order])
    assert torch.equal(got_q, expected_q[..., order])
    assert torch.equal(got_k, expected_k[..., order])


def _spec(params, head_dim, config, **kwargs):
    return rope_spec(
        params,
        head_dim=head_dim,
        max_position_embeddings=config.max_position_embeddings,
        allowed=ALL_TYPES,
        model="TestForCausalLM",
        **kwargs,
    )


LLAMA = dict(hidden_size=256, num_attention_heads=4, max_position_embeddings=MAX_POSITION)  # head_dim 64
SCALED = {
    "llama linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": ORIGINAL,
        "rope_theta": 500000.0,
    },
    "yarn, mscale and mscale_all_dim": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": ORIGINAL,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
        "beta_fast": 16,
        "rope_theta": 10000.0,
    },
    "yarn, attention_factor given": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": ORIGINAL,
        "attention_factor": 1.25,
        "rope_theta": 10000.0,
    },
}


@pytest.mark.parametrize("params", SCALED.values(), ids=SCALED.keys())
def test_llama_rotary_with_its_scalings(params):
    config = LlamaConfig(**LLAMA, rope_parameters=dict(params))
    spec = _spec(config.rope_parameters, 64, config)
    assert spec.rope_type == params["rope_type"] and spec.head_order(64) is None
    _assert_same_rotation(spec, 64, modeling_llama, modeling_llama.LlamaRotaryEmbedding(config), POSITIONS)


def test_qwen3_yarn():
    params = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL, "rope_theta": 1e6}
    config = Qwen3Config(**LLAMA, head_dim=64, rope_parameters=params)
    spec = _spec(config.rope_parameters, 64, config)
    assert spec.scaling == YarnRopeScaling(4.0, ORIGINAL, 0.1 * math.log(4.0) + 1.0)
    _assert_same_rotation(spec, 64, modeling_qwen3, modeling_qwen3.Qwen3RotaryEmbedding(config), POSITIONS)


@pytest.mark.parametrize("truncate", [False, True])
def test_gpt_oss_yarn(truncate):
    # gpt-oss's own rope (yarn, factor 32 over 4096, beta 32/1, truncate false) at this test's table length.
    config = GptOssConfig(max_position_embeddings=MAX_POSITION)
    config.rope_parameters["truncate"] = truncate
    spec = _spec(config.rope_parameters, config.head_dim, config)
    assert spec.scaling.truncate is truncate and spec.scaling.table_scale > 1
    rotary = modeling_gpt_oss.GptOssRotaryEmbedding(config)
    _assert_same_rotation(spec, config.head_dim, modeling_gpt_oss, rotary, [*POSITIONS, 4097, 8000])


def _phi3_longrope(partial_rotary_factor):
    head_dim = 64
    pairs = int(head_dim * partial_rotary_factor) // 2
    params = {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.05 * i for i in range(pairs)],
        "long_factor": [1.0 + 0.9 * i for i in range(pairs)],
        "partial_rotary_factor": partial_rotary_factor,
    }
    config = Phi3Config(**LLAMA, original_max_position_embeddings=ORIGINAL, rope_parameters=params)
    return config, head_dim


@pytest.mark.parametrize("partial", [0.75, 1.0])
def test_phi3_longrope_short_below_the_original_length_long_past_it(partial):
    config, head_dim = _phi3_longrope(partial)
    spec = _spec(config.rope_parameters, head_dim, config, partial_rotary=True)
    assert isinstance(spec.scaling, LongRopeScaling) and spec.scaling.table_scale > 1
    assert spec.rotary_dim == (48 if partial < 1 else None)
    assert (spec.head_order(head_dim) is None) == (partial == 1.0)
    # transformers picks the factors per forward call: calls within the original length take the short ones,
    # calls past it the long ones (a prompt within it, then decode steps past it).
    for positions in ([p for p in POSITIONS if p < ORIGINAL], [p for p in POSITIONS if p >= ORIGINAL]):
        rotary = modeling_phi3.Phi3RotaryEmbedding(config)
        _assert_same_rotation(spec, head_dim, modeling_phi3, rotary, positions)


def test_phi3_longrope_differs_from_transformers_on_a_call_across_the_original_length():
    # The documented difference: one transformers call reaching past the original length rotates its early
    # positions with the long factors; nanostream keeps the short ones there (decided per position).
    config, head_dim = _phi3_longrope(1.0)
    spec = _spec(config.rope_parameters, head_dim, config, partial_rotary=True)
    cos, _ = modeling_phi3.Phi3RotaryEmbedding(config)(torch.zeros(1), torch.tensor([[5, ORIGINAL]]))
    ours = RotaryEmbedding(head_dim, MAX_POSITION, spec)
    assert torch.equal(ours.cos[ORIGINAL], cos[0, 1, : head_dim // 2])
    assert not torch.equal(ours.cos[5], cos[0, 0, : head_dim // 2])


def test_glm4_partial_interleaved():
    config = Glm4Config(**LLAMA, head_dim=64)
    assert config.rope_parameters["partial_rotary_factor"] == 0.5
    spec = _spec(config.rope_parameters, 64, config, interleaved=True, partial_rotary=True)
    assert (spec.rotary_dim, spec.interleaved) == (32, True)
    order = spec.head_order(64)
    assert order[:4].tolist() == [0, 2, 4, 6] and order[32:36].tolist() == [1, 3, 5, 7]
    assert sorted(order.tolist()) == list(range(64))
    _assert_same_rotation(spec, 64, modeling_glm4, modeling_glm4.Glm4RotaryEmbedding(config), POSITIONS)


def test_gemma3_local_and_global_rope():
    params = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
    }
    config = Gemma3TextConfig(**LLAMA, head_dim=64, rope_parameters=params)
    rotary = modeling_gemma3.Gemma3RotaryEmbedding(config)
    for layer_type, rope_type in (("sliding_attention", "default"), ("full_attention", "linear")):
        spec = _spec(config.rope_parameters[layer_type], 64, config)
        assert spec.rope_type == rope_type
        _assert_same_rotation(spec, 64, modeling_gemma3, rotary, POSITIONS, layer_type=layer_type)


@pytest.mark.parametrize(("partial", "factor"), [(0.25, 1.0), (0.5, 2.0), (1.0, 1.0)])
def test_gemma4_proportional_rope_of_its_full_layers(partial, factor):
    # The full layers' head (global_head_dim 128 here) in (i, i + 64) pairs, the first partial share of them turning
    # at the whole head's frequencies (divided by factor), the rest not at all; the sliding layers' default rope
    params = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": partial, "rope_theta": 1e6,
                           "factor": factor},
    }  # fmt: skip
    config = Gemma4TextConfig(**LLAMA, head_dim=64, global_head_dim=128, rope_parameters=params)
    rotary = modeling_gemma4.Gemma4TextRotaryEmbedding(config)
    for layer_type, head_dim in (("sliding_attention", 64), ("full_attention", 128)):
        spec = rope_spec(config.rope_parameters[layer_type], head_dim=head_dim, max_position_embeddings=MAX_POSITION,
                         allowed=(*ALL_TYPES, "proportional"), model="Gemma4ForCausalLM")  # fmt: skip
        ours = RotaryEmbedding(head_dim, MAX_POSITION, spec)
        x = torch.zeros(1, len(POSITIONS), head_dim)
        cos, sin = rotary(x, torch.tensor(POSITIONS)[None], layer_type)
        assert torch.equal(ours.cos[POSITIONS], cos[0, :, : head_dim // 2])
        assert torch.equal(ours.sin[POSITIONS], sin[0, :, : head_dim // 2])
    turning = int(partial * 128 // 2)
    assert torch.equal(ours.cos[:, turning:], torch.ones(MAX_POSITION, 64 - turning))


def test_permuted_projection_rows_leave_attention_scores():
    # What the model does with head_order: q and k projections' rows (and biases) permuted per head, once.
    config = Glm4Config(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=MAX_POSITION)
    spec = _spec(config.rope_parameters, 16, config, interleaved=True, partial_rotary=True)
    order = spec.head_order(16)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(len(POSITIONS), 64, generator=gen)
    w_q, b_q = torch.randn(4 * 16, 64, generator=gen), torch.randn(4 * 16, generator=gen)
    w_k = torch.randn(2 * 16, 64, generator=gen)
    q, k = (x @ w_q.T + b_q).view(-1, 4, 16), (x @ w_k.T).view(-1, 2, 16)
    hf_rotary = modeling_glm4.Glm4RotaryEmbedding(config)
    hf_q, hf_k = _hf_rotation(modeling_glm4, hf_rotary, q, k, POSITIONS)
    q_p = (x @ permute_heads(w_q, order, 16).T + permute_heads(b_q, order, 16)).view(-1, 4, 16)
    k_p = (x @ permute_heads(w_k, order, 16).T).view(-1, 2, 16)
    ours_q, ours_k = RotaryEmbedding(16, MAX_POSITION, spec)(torch.tensor(POSITIONS), q_p, k_p)
    assert torch.equal(ours_q, hf_q[..., order]) and torch.equal(ours_k, hf_k[..., order])
    # q·k sums the same 16 products in another order: equal to float32 rounding (twice the worst-case error
    # of a 16-term float32 sum, 15 · 2^-24 of its magnitude).
    scores = torch.einsum("thd,shd->hts", hf_q[:, :2], hf_k)
    magnitude = torch.einsum("thd,shd->hts", hf_q[:, :2].abs(), hf_k.abs())
    assert ((torch.einsum("thd,shd->hts", ours_q[:, :2], ours_k) - scores).abs() <= 2 * 15 * 2**-24 * magnitude).all()
    norm_weight = torch.randn(16, generator=gen)
    assert torch.equal(permute_heads(norm_weight, order, 16), norm_weight[order])


def test_partial_rotary_tables_pass_the_other_dims_through():
    spec = RopeSpec(10000.0, rotary_dim=16)
    rotary = RotaryEmbedding(64, 100, spec)
    assert torch.equal(rotary.cos[:, 8:], torch.ones(100, 24)) and torch.equal(rotary.sin[:, 8:], torch.zeros(100, 24))
    assert torch.equal(rotary.cos[:, :8], RotaryEmbedding(16, 100, RopeSpec(10000.0)).cos)
    assert spec.head_order(64).tolist() == [*range(8), *range(16, 40), *range(8, 16), *range(40, 64)]


@pytest.mark.parametrize("rope_type", ["dynamic", "fope", "mrope"])
def test_unsupported_rope_types_are_refused_by_name(rope_type):
    params = {"rope_type": rope_type, "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ModelLoadError, match=f"rope type '{rope_type}'"):
        rope_spec(params, head_dim=64, max_position_embeddings=4096, allowed=(*ALL_TYPES, rope_type), model="M")


def test_a_type_the_family_does_not_declare_is_refused():
    params = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 1024}
    refused = "rope type 'yarn' is not supported for Gemma3ForCausalLM; nanostream runs default, linear"
    with pytest.raises(ModelLoadError, match=refused):
        rope_spec(
            params, head_dim=64, max_position_embeddings=4096, allowed=("default", "linear"), model="Gemma3ForCausalLM"
        )


@pytest.mark.parametrize(
    ("params", "kwargs", "message"),
    [
        ({"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0}, {}, "high_freq_factor"),
        ({"rope_type": "linear", "rope_theta": 1e4}, {}, "lack factor"),
        ({"rope_type": "default"}, {}, "lack rope_theta"),
        ({"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 32}, {}, "long_factor"),
        (
            {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0], "long_factor": [1.0]},
            {},
            "list of 32 numbers",
        ),
        ({"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}, {}, "partial_rotary_factor=0.5"),
        ({"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.3}, {"partial_rotary": True}, "19"),
    ],
)
def test_missing_keys_and_unrunnable_shapes_are_refused(params, kwargs, message):
    with pytest.raises(ModelLoadError, match=message):
        rope_spec(params, head_dim=64, max_position_embeddings=4096, allowed=ALL_TYPES, model="M", **kwargs)
