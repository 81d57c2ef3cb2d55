"""What rank 0 sends its tensor-parallel workers crosses the control channel whole: the ``DecoderSpec`` of every
declared family, with every rope type the family accepts (partial and interleaved rotary too), decodes on a worker
to the spec rank 0 built. And the scaled-rope models that once failed to start at tp=2 (a ``RopeScaling`` typed as
a Protocol, which msgspec cannot decode) are token-identical to transformers there."""

from __future__ import annotations

import pytest
from test_hf_parity import GREEDY, assert_matches_hf, random_prompts

from nanostream import LLM
from nanostream.config import EngineConfig
from nanostream.engine.tp.control import Setup, decode_setup, encode
from nanostream.models import decoder_spec
from nanostream.models.architectures import ARCHITECTURES
from nanostream.testing import LLAMA3_ROPE_SCALING, TINY_ARCHITECTURES, make_tiny_model, tiny_config

THETA = 10000.0


def rope_parameters(rope_type: str, rotary_dim: int) -> dict:
    """A rope-parameters dict of ``rope_type`` for a head rotating ``rotary_dim`` dims, every optional key set."""
    if rope_type == "default":
        return {"rope_type": "default", "rope_theta": THETA}
    if rope_type == "linear":
        return {"rope_type": "linear", "rope_theta": THETA, "factor": 4.0}
    if rope_type == "llama3":
        return {**LLAMA3_ROPE_SCALING, "rope_theta": THETA}
    if rope_type == "yarn":
        return {"rope_type": "yarn", "rope_theta": THETA, "factor": 4.0, "original_max_position_embeddings": 256,
                "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False}  # fmt: skip
    if rope_type == "dynamic":  # HunYuan's fixed NTK alpha: a larger base, the default rope
        return {"rope_type": "dynamic", "rope_theta": THETA, "factor": 1.0, "alpha": 2.0}
    if rope_type == "proportional":  # Gemma 4's full layers: a quarter of the head's pairs turning
        return {"rope_type": "proportional", "rope_theta": THETA, "partial_rotary_factor": 0.25}
    assert rope_type == "longrope", rope_type
    half = rotary_dim // 2
    short, long = [1.0 + i / half for i in range(half)], [2.0 + i for i in range(half)]
    return {"rope_type": "longrope", "rope_theta": THETA, "original_max_position_embeddings": 256,
            "short_factor": short, "long_factor": long}  # fmt: skip


def variants() -> list[tuple[str, str, float | None]]:
    """(architecture, rope type, partial_rotary_factor or None) for every declared family and rope type."""
    out = []
    for name, arch in ARCHITECTURES.items():
        assert name in TINY_ARCHITECTURES, f"{name} has no tiny model to build its spec from"
        for rope_type in arch.rope_types:
            out.append((name, rope_type, None))
            if arch.partial_rotary:
                out.append((name, rope_type, 0.5))
    return out


def config_of(name: str, rope_type: str, partial: float | None):
    head_dim = 16  # every tiny model's
    params = rope_parameters(rope_type, int(head_dim * (partial or 1.0)))
    if partial is not None:
        params["partial_rotary_factor"] = partial
    if name in ("Gemma3ForCausalLM", "Gemma4ForCausalLM", "Olmo3ForCausalLM"):  # a rope per layer kind
        params = {"full_attention": params, "sliding_attention": rope_parameters("default", head_dim)}
    return tiny_config(name, rope_parameters=params)


@pytest.mark.parametrize(("name", "rope_type", "partial"), variants())
def test_every_family_and_rope_type_crosses_the_control_channel(name, rope_type, partial):
    config = config_of(name, rope_type, partial)
    spec = decoder_spec(config, max_model_len=256)
    assert spec.rope.rope_type == ("default" if rope_type == "dynamic" else rope_type)
    # the config's own default where none is given (Qwen3-Next's and Qwen3.5's: a quarter of each head)
    partial = config.rope_parameters.get("partial_rotary_factor", 1.0) if partial is None else partial
    # (latent attention rotates its own qk_rope_head_dim dims whole, whatever share of the head they are)
    assert (spec.rope.rotary_dim is not None) == (partial != 1.0) or spec.rope.interleaved or spec.latent_attention
    setup = Setup(EngineConfig(model="m", device="cpu"), spec)
    got = decode_setup(encode(setup))
    assert got == setup
    assert type(got.spec.rope.scaling) is type(spec.rope.scaling)


def test_every_rope_type_the_engine_runs_is_declared_by_some_family():
    from nanostream.layers.rope_config import ROPE_TYPES

    declared = {rope_type for _, rope_type, _ in variants()}
    assert declared == set(ROPE_TYPES)


@pytest.fixture(scope="module")
def scaled_rope_models(tmp_path_factory):
    yarn = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 512}
    return {
        "llama3": make_tiny_model(
            tmp_path_factory.mktemp("llama3"), architecture="LlamaForCausalLM", seed=21,
            rope_parameters={**LLAMA3_ROPE_SCALING, "rope_theta": 5e5}, tie_word_embeddings=False,
        ),
        "qwen3_yarn": make_tiny_model(
            tmp_path_factory.mktemp("qwen3_yarn"), architecture="Qwen3ForCausalLM", seed=22, rope_parameters=yarn
        ),
    }  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama3", "qwen3_yarn"])
def test_scaled_rope_models_at_tp2_match_transformers(model, scaled_rope_models, hf_model_cache):
    path = scaled_rope_models[model]
    prompts = random_prompts([1, 9, 70, 130], seed=23)  # past llama3's original_max_position_embeddings
    with LLM(str(path), tensor_parallel_size=2, device="cpu", dtype="float32", kvcache_block_size=8,
             max_num_batched_tokens=48, max_num_seqs=4) as llm:  # fmt: skip
        assert llm.engine.runner.model.model.rotary.spec.rope_type in ("llama3", "yarn")
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_hf(hf_model_cache(path), prompts, outputs, GREEDY.max_tokens)
