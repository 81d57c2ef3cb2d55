"""The shared decoder: what each architecture's declaration reads from config.json, what it refuses, and
the kernels its layers get at construction (token parity with transformers: test_hf_parity.py)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoConfig,
    Gemma3TextConfig,
    Glm4Config,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    SmolLM3Config,
)

from nanostream import LLM, ModelLoadError
from nanostream.engine.runner.kv_pool import WarmupChunk, allocate_kv_pool
from nanostream.engine.runner.step_inputs import pack_step
from nanostream.engine.sequence import Sequence
from nanostream.layers import layer_kernels, norm, rope_scaling, rotary
from nanostream.layers.activation import SiluAndMul, silu_and_mul
from nanostream.layers.attention import Attention, ForwardContext
from nanostream.layers.attention_backend import TorchAttention
from nanostream.layers.layer_kernels import LayerKernels
from nanostream.layers.norm import RMSNorm
from nanostream.models import SUPPORTED_ARCHITECTURES, decoder_spec, load_model
from nanostream.sampling_params import SamplingParams

ALL = (
    "Qwen3ForCausalLM, Qwen2ForCausalLM, LlamaForCausalLM, MistralForCausalLM, "
    "Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, Gemma3ForCausalLM, Phi3ForCausalLM, Olmo2ForCausalLM, "
    "GraniteForCausalLM, SmolLM3ForCausalLM, Glm4ForCausalLM, GptOssForCausalLM, MixtralForCausalLM, "
    "Qwen3NextForCausalLM, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Glm4MoeForCausalLM, MiniMaxM2ForCausalLM, "
    "Olmo3ForCausalLM, Exaone4ForCausalLM, ApertusForCausalLM, SeedOssForCausalLM, HunYuanDenseV1ForCausalLM, "
    "Ernie4_5ForCausalLM, Ernie4_5_MoeForCausalLM, Ministral3ForCausalLM, Llama4ForCausalLM, Lfm2ForCausalLM, "
    "DeepseekV3ForCausalLM, Glm4MoeLiteForCausalLM, DeepseekV2ForCausalLM, Mistral4ForCausalLM, Gemma4ForCausalLM"
)
SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def spec_of(config_cls, arch, max_model_len=1024, **kwargs):
    return decoder_spec(config_cls(architectures=[arch], **SMALL, **kwargs), max_model_len=max_model_len)


def test_each_declaration_reads_its_config():
    qwen3 = spec_of(Qwen3Config, "Qwen3ForCausalLM", head_dim=16, attention_bias=True)
    assert (qwen3.qk_norm, qwen3.qkv_bias, qwen3.o_bias, qwen3.head_dim) == (True, True, True, 16)
    qwen2 = spec_of(Qwen2Config, "Qwen2ForCausalLM", tie_word_embeddings=True)
    assert (qwen2.qk_norm, qwen2.qkv_bias, qwen2.o_bias, qwen2.tie_word_embeddings) == (False, True, False, True)
    llama = spec_of(LlamaConfig, "LlamaForCausalLM", mlp_bias=True, rope_theta=500000.0)
    assert (llama.qkv_bias, llama.o_bias, llama.mlp_bias, llama.rope) == (False, False, True, rotary.RopeSpec(5e5))
    scaled = spec_of(LlamaConfig, "LlamaForCausalLM", rope_scaling=dict(rope_type="llama3", factor=32.0,
                     low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192))  # fmt: skip
    assert scaled.rope.scaling == rope_scaling.Llama3RopeScaling(32.0, 1.0, 4.0, 8192)
    mistral = spec_of(MistralConfig, "MistralForCausalLM", sliding_window=None)
    assert (mistral.qk_norm, mistral.qkv_bias, mistral.o_bias, mistral.mlp_bias) == (False,) * 4


def test_the_dense_families_declare_how_they_depart():
    gemma = spec_of(Gemma3TextConfig, "Gemma3ForCausalLM", head_dim=16, query_pre_attn_scalar=64, sliding_window=32,
                    final_logit_softcapping=30.0, layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    assert (gemma.norms.mlp_out, gemma.norm_weight_offset, gemma.activation, gemma.scale_embeddings) == (
        "post_feedforward_layernorm", 1.0, "gelu_tanh", True,
    )  # fmt: skip
    assert (gemma.attention_scale, gemma.final_logit_softcap, gemma.layer_windows) == (0.125, 30.0, (32, None))
    assert (gemma.rope.theta, gemma.sliding_rope.theta) == (1e6, 1e4)  # the local base on the sliding layers
    granite = spec_of(GraniteConfig, "GraniteForCausalLM", embedding_multiplier=12.0, residual_multiplier=0.22,
                      attention_multiplier=0.0078125, logits_scaling=8.0)  # fmt: skip
    assert (granite.embedding_multiplier, granite.residual_multiplier, granite.attention_scale) == (12.0, 0.22, 2**-7)
    assert granite.logits_divisor == 8.0
    olmo = spec_of(Olmo2Config, "Olmo2ForCausalLM")
    assert (olmo.norms.attn_in, olmo.norms.mlp_in, olmo.qk_norm_whole, olmo.norm_weight_offset) == (None, None, True, 0)
    smol = spec_of(SmolLM3Config, "SmolLM3ForCausalLM", no_rope_layers=[1, 0])
    assert smol.rope_layers == (True, False)
    glm = spec_of(Glm4Config, "Glm4ForCausalLM", head_dim=16)
    assert (glm.rope.rotary_dim, glm.rope.interleaved, glm.qkv_bias, glm.o_bias) == (8, True, True, False)
    phi = spec_of(Phi3Config, "Phi3ForCausalLM", sliding_window=64, max_model_len=512)
    assert phi.layer_windows == (64, 64)  # every layer slides


def test_sliding_windows_per_layer_and_only_where_they_hide_tokens():
    assert spec_of(MistralConfig, "MistralForCausalLM", max_model_len=32768, sliding_window=4096).layer_windows == (
        4096, 4096,
    )  # fmt: skip
    assert spec_of(MistralConfig, "MistralForCausalLM", max_model_len=4096, sliding_window=4096).layer_windows == ()
    # Qwen's window counts only where use_sliding_window turns it on, and from max_window_layers up
    assert spec_of(Qwen2Config, "Qwen2ForCausalLM", max_model_len=32768, sliding_window=4096).layer_windows == ()
    qwen2 = spec_of(Qwen2Config, "Qwen2ForCausalLM", max_model_len=32768, sliding_window=4096,
                    use_sliding_window=True, max_window_layers=1)  # fmt: skip
    assert qwen2.layer_windows == (None, 4096)
    with pytest.raises(ModelLoadError, match="sliding_window=0"):
        spec_of(MistralConfig, "MistralForCausalLM", sliding_window=0)


@pytest.mark.parametrize(
    "config_cls, arch, kwargs, expected",
    [
        (
            LlamaConfig,
            "LlamaForCausalLM",
            dict(quantization_config={"quant_method": "mxfp4"}),
            "quantized with 'mxfp4'",
        ),
        (Gemma3TextConfig, "Gemma3ForCausalLM", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
        (Gemma3TextConfig, "Gemma3ForCausalLM", dict(use_bidirectional_attention=True), "bidirectional"),
        (Gemma3TextConfig, "Gemma3ForCausalLM", dict(hidden_activation="relu"), "hidden_activation='relu'"),
        (LlamaConfig, "LlamaForCausalLM", dict(hidden_act="gelu"), "hidden_act='gelu'.*runs silu, swish"),
        (Gemma3TextConfig, "Gemma3ForCausalLM", dict(query_pre_attn_scalar=0), "query_pre_attn_scalar=0"),
        (Gemma3TextConfig, "Gemma3ForCausalLM", dict(final_logit_softcapping=float("nan")), "softcapping=nan"),
        (GraniteConfig, "GraniteForCausalLM", dict(logits_scaling=-1.0), "logits_scaling=-1.0"),
        (
            Qwen3Config,
            "Qwen3ForCausalLM",
            dict(layer_types=["chunked_attention"] * 2, sliding_window=8, use_sliding_window=True),
            "chunked_attention",
        ),
    ],
)
def test_what_the_decoder_does_not_run_is_refused_by_name(config_cls, arch, kwargs, expected):
    with pytest.raises(ModelLoadError, match=expected):
        spec_of(config_cls, arch, **kwargs)


def test_unsupported_architecture_lists_the_supported_ones():
    assert ", ".join(SUPPORTED_ARCHITECTURES) == ALL
    with pytest.raises(ModelLoadError, match=f"unsupported architecture.*GPT2LMHeadModel.*nanostream runs {ALL}"):
        spec_of(LlamaConfig, "GPT2LMHeadModel")


@pytest.mark.parametrize(
    "config_cls, arch, rope, expected",
    [
        (LlamaConfig, "LlamaForCausalLM", dict(rope_type="dynamic", factor=4.0), "runs default, linear, yarn, llama3"),
        (
            Qwen3Config,
            "Qwen3ForCausalLM",
            dict(rope_type="llama3", factor=8.0),
            "runs default, linear, yarn$",
        ),
        (LlamaConfig, "LlamaForCausalLM", dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
        (LlamaConfig, "LlamaForCausalLM", dict(rope_type="llama3", factor=8.0), "lack low_freq_factor"),
    ],
)
def test_unsupported_rope_is_refused(config_cls, arch, rope, expected):
    config = config_cls(architectures=[arch], **SMALL)
    config.rope_parameters = {"rope_theta": 10000.0, **rope}  # as config.json would give it
    with pytest.raises(ModelLoadError, match=expected):
        decoder_spec(config, max_model_len=1024)


def test_checkpoint_of_another_architecture_is_refused(qwen3_dir, tmp_path):
    # Qwen3 weights labelled Llama: the QK-norm weights have no place, and dropping them would be silent garbage.
    model = tmp_path / "mislabelled"
    shutil.copytree(qwen3_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=f"LlamaForCausalLM has no place for.*q_norm.weight.*runs {ALL}"):
        LLM(str(model), device="cpu")


def build(model_dir, kernels):
    spec = decoder_spec(AutoConfig.from_pretrained(model_dir), max_model_len=2048)
    return load_model(spec, kernels, Path(model_dir), dtype=torch.float32, device=torch.device("cpu"))


def test_layers_get_their_kernels_at_construction(qwen3_dir):
    from nanostream.kernels import norm_act
    from nanostream.kernels.qkv_prologue import qkv_prologue
    from nanostream.layers.triton_attention import TritonAttention

    for backend, norm_fn, act_fn, prologue in [
        (TorchAttention(), norm.rms_norm, silu_and_mul, None),
        (TritonAttention(), norm_act.rms_norm, norm_act.silu_and_mul, qkv_prologue),
    ]:
        model = build(qwen3_dir, LayerKernels.for_backend(backend))
        norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
        assert len(norms) == 2 * 2 + 1 + 2 * 2  # per layer: two norms and the QK-norms; the final norm
        assert all(m.kernel is norm_fn for m in norms)
        assert all(m.kernel is act_fn for m in model.modules() if isinstance(m, SiluAndMul))
        attns = [m for m in model.modules() if isinstance(m, Attention)]
        assert len(attns) == 2 and all(a.backend is backend and a.prologue is prologue for a in attns)
        assert model.model.rotary.kernel is rotary.apply_rotary and all(a.rotary is model.model.rotary for a in attns)


def run_steps(model, spec, steps):
    """Hidden states of ``steps`` (each a list of (new tokens, cached tokens) per sequence) on a fresh pool."""
    outs = []
    for step in steps:
        kv = allocate_kv_pool(spec, 64, 16, torch.float32, torch.device("cpu"))
        chunks = []
        for i, (new, cached) in enumerate(step):
            seq = Sequence(f"s{i}", list(range(3, 3 + new + cached)), SamplingParams(), max_tokens=1,
                           sampling_seed=0, stop_token_ids=frozenset())  # fmt: skip
            seq.block_table = list(range(8 * i, 8 * i + 8))
            chunks.append(WarmupChunk(seq, cached, new))
        inputs = pack_step(chunks, 16, torch.device("cpu"))
        with torch.inference_mode():
            outs.append(model(inputs.input_ids, inputs.positions, ForwardContext(inputs.meta, kv)))
    return outs


def test_compiled_layers_stay_within_dynamo_defaults_and_leave_its_config_alone(tmp_path, monkeypatch):
    # Compiled with a counting backend (dynamo traces and guards as for inductor, without its compile time):
    # every variant the engine's steps make (rank, a residual or not, a batch of one, one KV head) stays
    # within dynamo's default limit of 8 per compiled function, so nothing needs the process-wide setting.
    from nanostream.testing import make_tiny_model

    compiles: dict[str, int] = {}

    def counting(fn):
        def backend(graph, example_inputs):
            compiles[fn.__name__] = compiles.get(fn.__name__, 0) + 1
            return graph.forward

        return torch.compile(fn, dynamic=True, backend=backend)

    monkeypatch.setattr(layer_kernels, "compile_elementwise", counting)
    path = make_tiny_model(tmp_path, num_key_value_heads=1, head_dim=16)
    before = torch._dynamo.config.get_config_copy()
    eager = build(path, LayerKernels.for_backend(TorchAttention()))
    compiled = build(path, LayerKernels.for_backend(TorchAttention(), compile=True))
    steps = [[(7, 0), (5, 0)], [(1, 0)], [(1, 5), (1, 9)], [(1, 3), (30, 0)], [(33, 0)], [(1, 40)]]
    for ours, ref in zip(run_steps(compiled, compiled.spec, steps), run_steps(eager, eager.spec, steps)):
        assert torch.equal(ours, ref)
    assert set(compiles) == {"_norm", "_add_norm", "silu_and_mul", "apply_rotary"}
    assert max(compiles.values()) <= 8, compiles
    assert torch._dynamo.config.get_config_copy() == before


def test_a_model_built_in_bfloat16_has_the_float32_builds_weights_rounded(tmp_path):
    # What the benchmarks build large shapes with (apps/presets.py): never whole in float32.
    from safetensors import safe_open

    from nanostream.testing import make_tiny_model

    full = make_tiny_model(tmp_path / "f32", seed=3)
    half = make_tiny_model(tmp_path / "bf16", seed=3, weights_dtype="bfloat16")
    assert torch.get_default_dtype() == torch.float32
    with safe_open(full / "model.safetensors", "pt") as f, safe_open(half / "model.safetensors", "pt") as h:
        names = sorted(f.keys())
        assert names == sorted(h.keys())
        for name in names:
            assert h.get_tensor(name).dtype == torch.bfloat16
            assert torch.equal(f.get_tensor(name).to(torch.bfloat16), h.get_tensor(name)), name
    out = LLM(str(half), kvcache_block_size=16).generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(out[0].token_ids) == 4


def test_olmo2_splits_over_ranks_as_its_heads_do():
    # Its whole-projection QK-norms take their statistics over the ranks (test_deepseek_routing.py runs it at tp=2).
    from nanostream.models.sharding import check_split

    check_split(spec_of(Olmo2Config, "Olmo2ForCausalLM"), 2)
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible.*divides the model: 1, 2, 4$"):
        check_split(spec_of(Olmo2Config, "Olmo2ForCausalLM"), 3)
