"""Gemma 4's MoE block (``enable_moe_block``, the 26B-A4B model): GeGLU experts beside every layer's dense MLP, routed
on the MLP block's input RMS-normed without a weight and times a learned scale, the top-k weights renormalised and
times a learned per-expert scale, each output normed and the two added (layers/moe_beside_mlp.py).

Token-exact parity with transformers (prompts of 1 to 700 tokens, prefix hits and chunks across the window's edge,
preemption, the Triton kernels under the interpreter) runs in tests/test_families_2025.py on the ``gemma4_moe``
preset, and so do two ranks; here: what the config reads as, that every drawn router, scale and norm weight of the
block steers transformers' greedy tokens (so that parity cannot pass with one of them ignored), and the refusals
with numbers: a tensor-parallel split the experts do not divide, an FP8 KV cache with KV-shared layers.
"""

import pytest
import torch
import transformers
from test_hf_parity import greedy, random_prompts

from nanostream import LLM
from nanostream.models.config_reader import decoder_spec
from nanostream.models.sharding import check_split
from nanostream.testing import TINY_PRESETS, make_tiny_model
from nanostream.testing.tiny_model import tiny_config

PRESET = TINY_PRESETS["gemma4_moe"]


@pytest.fixture(scope="module")
def gemma4_moe(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("gemma4_moe"), **PRESET)


def test_the_config_reads_as_experts_beside_every_dense_mlp():
    spec = decoder_spec(tiny_config(**PRESET), max_model_len=4096)
    moe = spec.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.layers) == (8, 2, 32, tuple(range(6)))
    assert (moe.router, moe.activation) == ("normed_softmax", "gelu_tanh") and moe.beside_dense and moe.renormalize
    assert spec.intermediate_size == 128 and spec.layer_intermediate[-1] == 256  # the dense MLPs stay, double-wide too
    assert decoder_spec(tiny_config(**{**PRESET, "enable_moe_block": False}), max_model_len=4096).moe is None


BLOCK_WEIGHTS = {  # a part of the block -> the parameters of it, each set back to transformers' init (or zeroed)
    "the router's input scale": ("router.scale", 1.0),
    "the per-expert scales": ("router.per_expert_scale", 1.0),
    "the router's projection": ("router.proj.weight", 0.0),
    "the experts' input norm": ("pre_feedforward_layernorm_2.weight", 1.0),
    "the dense output's norm": ("post_feedforward_layernorm_1.weight", 1.0),
    "the experts' output norm": ("post_feedforward_layernorm_2.weight", 1.0),
    "the experts": ("experts.down_proj", 0.0),
}


@pytest.mark.parametrize("part", BLOCK_WEIGHTS)
def test_every_drawn_weight_of_the_block_steers_transformers_greedy_tokens(part, gemma4_moe):
    # Each part set back to its init value changes transformers' tokens: nanostream's parity on this model fails if
    # it ignores that part (reads the weight wrongly, or leaves it at its init).
    suffix, value = BLOCK_WEIGHTS[part]
    prompts = random_prompts([9, 45, 130], seed=70)

    def tokens(model):
        out = []
        for prompt in prompts:
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0)
            out.append(ids[0, len(prompt) :].tolist())
        return out

    model = transformers.Gemma4ForCausalLM.from_pretrained(gemma4_moe, dtype=torch.float32).eval()
    before = tokens(model)
    with torch.no_grad():
        changed = [p.fill_(value) for name, p in model.named_parameters() if name.endswith(suffix)]
    assert len(changed) == 6  # one a layer
    assert tokens(model) != before


def test_a_split_the_experts_do_not_divide_is_refused_with_the_numbers():
    spec = decoder_spec(tiny_config(**{**PRESET, "moe_intermediate_size": 33}), max_model_len=4096)
    check_split(spec, 1)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 .*the experts' intermediate size \(33\) is not div"):
        check_split(spec, 2)


@pytest.mark.parametrize("name", ["gemma4", "gemma4_moe"])
def test_an_fp8_kv_cache_with_kv_shared_layers_is_refused_at_construction(name, tmp_path):
    # Refused by LLM(...) itself, before any step, saying what to change; without shared layers FP8 KV loads.
    path = make_tiny_model(tmp_path / "shared", weights=False, **TINY_PRESETS[name])
    with pytest.raises(
        ValueError, match=r"kv_cache_dtype='fp8' .* KV-shared layers .*layers 4-5.*kv_cache_dtype='auto'"
    ):
        LLM(str(path), device="cpu", load_format="dummy", kv_cache_dtype="fp8")
    path = make_tiny_model(tmp_path / "own", weights=False, **TINY_PRESETS[name], num_kv_shared_layers=0)
    with LLM(str(path), device="cpu", load_format="dummy", kv_cache_dtype="fp8", kvcache_block_size=8) as llm:
        assert len(llm.generate([list(range(5, 40))], greedy(3), use_tqdm=False)[0].token_ids) == 3
