"""FP8 weight checkpoints load dequantized (models/quantization.py): a tiny random Qwen3 written by the test in
each layout, its weights quantized the way the format says and its scales under the format's names, gives
transformers' greedy ids on the dequantized twin (the same checkpoint with each FP8 weight replaced by its real
value, in float32); so does a Qwen3-MoE's per-expert checkpoint, and two gloo ranks compute what one does.

The layouts: block-wise ``quant_method: "fp8"`` (blocks of 48 x 40 that leave partial blocks at every matrix's
edge, an untied lm_head quantized too), per-tensor ``"fp8"``, and compressed-tensors' ``float-quantized`` per
channel (an ignore list: lm_head by name, layer 1's MLP by regex) and per tensor (bfloat16 scales, static input
scales, not read, and a kv_cache_scheme). What nanostream does not load is refused by name."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from test_hf_parity import greedy, hf_greedy, random_prompts
from test_tp import in_threads, spec_of
from transformers import AutoModelForCausalLM, FineGrainedFP8Config, Qwen3Config

from nanostream import LLM, ModelLoadError, SamplingParams
from nanostream.distributed import SINGLE, TensorParallel
from nanostream.engine.runner.kv_pool import WarmupChunk, allocate_kv_pool
from nanostream.engine.runner.step_inputs import pack_step
from nanostream.engine.sequence import Sequence
from nanostream.layers.attention import ForwardContext
from nanostream.layers.attention_backend import TorchAttention
from nanostream.layers.layer_kernels import LayerKernels
from nanostream.models import decoder_spec, load_model
from nanostream.models.quantization import Fp8Spec, fp8_spec
from nanostream.testing import TINY_PRESETS, make_tiny_model

CPU = torch.device("cpu")
FP8, FP8_MAX = torch.float8_e4m3fn, torch.finfo(torch.float8_e4m3fn).max
BLOCK = (48, 40)  # q [64, 96] is 2 x 3 blocks, the last row and column of them partial; k [32, 96] one row
TOKENS = 16


@dataclasses.dataclass(frozen=True)
class Layout:
    config: dict
    scale: str  # what a weight's name takes to name its scale
    strategy: str  # "block", "channel" or "tensor"
    scale_dtype: torch.dtype = torch.float32
    scalar: bool = False  # a per-tensor scale of shape [] (transformers' FineGrainedFP8), not [1]
    static_inputs: bool = False  # each linear's input_scale written too: nanostream does not read it
    ignore: tuple[str, ...] = ()  # regexes of the modules left unquantized
    block: tuple[int, int] = BLOCK  # the "block" strategy's


def _ct(strategy: str, inputs: dict, **config) -> dict:
    weights = dict(num_bits=8, type="float", symmetric=True, strategy=strategy, dynamic=False, group_size=None,
                   block_structure=None, actorder=None, observer="minmax", observer_kwargs={})  # fmt: skip
    group = dict(targets=["Linear"], weights=weights, input_activations=inputs, output_activations=None)
    return dict(quant_method="compressed-tensors", format="float-quantized", config_groups={"group_0": group},
                quantization_status="compressed", kv_cache_scheme=None, **config)  # fmt: skip


DYNAMIC_TOKENS = dict(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True)
STATIC_TENSOR = dict(num_bits=8, type="float", symmetric=True, strategy="tensor", dynamic=False)
LAYOUTS = {
    "fp8-block": Layout(
        dict(quant_method="fp8", activation_scheme="dynamic", weight_block_size=list(BLOCK), fmt="e4m3"),
        "_scale_inv",
        "block",
    ),
    "fp8-tensor": Layout(
        dict(quant_method="fp8", activation_scheme="dynamic", weight_block_size=None),
        "_scale_inv",
        "tensor",
        scalar=True,
    ),
    "ct-channel": Layout(
        _ct("channel", DYNAMIC_TOKENS, ignore=["lm_head", r"re:.*layers\.1\.mlp\."]),
        "_scale",
        "channel",
        ignore=(r"lm_head", r".*layers\.1\.mlp\."),
    ),
    "ct-tensor": Layout(
        _ct("tensor", STATIC_TENSOR, ignore=["lm_head"]) | dict(kv_cache_scheme=STATIC_TENSOR),
        "_scale",
        "tensor",
        scale_dtype=torch.bfloat16,  # as llm-compressor stores a bf16 model's scales
        static_inputs=True,
        ignore=("lm_head",),
    ),
}


def quantize(w: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w`` [out, in] as the format stores it, FP8 and its scale, and its real value ``fp8 × scale`` (float32),
    block by block."""
    rows, cols = w.shape
    bo, bi = {"block": layout.block, "channel": (1, cols), "tensor": (rows, cols)}[layout.strategy]
    q, real = torch.empty(w.shape, dtype=FP8), torch.empty(w.shape)
    scale = torch.empty(-(-rows // bo), -(-cols // bi), dtype=layout.scale_dtype)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            part = (slice(i * bo, (i + 1) * bo), slice(j * bi, (j + 1) * bi))
            scale[i, j] = w[part].abs().max() / FP8_MAX  # rounded to the scale's dtype, then used
            s = scale[i, j].float()
            q[part] = (w[part] / s).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            real[part] = q[part].float() * s
    if layout.strategy == "tensor":
        scale = scale.reshape(() if layout.scalar else (1,))
    return q, scale, real


def write_fp8(src: Path, dst: Path, twin: Path, layout: Layout) -> None:
    """``dst``: ``src`` with each linear weight (not an ignored module's, nor the MoE router's) in FP8 and its
    scales; ``twin``: ``src`` with those weights replaced by their real values."""
    tensors = load_file(src / "model.safetensors")
    stored, real = {}, {}
    for name, w in tensors.items():
        module = name.removesuffix(".weight")
        linear = name.endswith(".weight") and re.search(r"(_proj|lm_head)$", module)
        if not linear or any(re.match(p, module) for p in layout.ignore):
            stored[name] = real[name] = w
            continue
        stored[name], stored[name + layout.scale], real[name] = quantize(w, layout)
        if layout.static_inputs:
            stored[f"{module}.input_scale"] = torch.rand(1)
    for path, out in ((dst, stored), (twin, real)):
        shutil.copytree(src, path)
        save_file(out, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config | {"quantization_config": layout.config}))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """The tiny Qwen3 of hidden size 96 (so no block divides the matrices), its lm_head untied."""
    return make_tiny_model(tmp_path_factory.mktemp("qwen3"), seed=21, hidden_size=96, intermediate_size=160,
                           tie_word_embeddings=False)  # fmt: skip


def written(qwen3: Path, tmp_path_factory, layouts: dict[str, Layout]) -> dict[str, tuple[Path, Path]]:
    """Each layout's FP8 directory and its dequantized twin."""
    out = {}
    for name, layout in layouts.items():
        base = tmp_path_factory.mktemp(name)
        write_fp8(qwen3, base / "fp8", base / "twin", layout)
        out[name] = base / "fp8", base / "twin"
    return out


@pytest.fixture(scope="module")
def checkpoints(qwen3, tmp_path_factory):
    return written(qwen3, tmp_path_factory, LAYOUTS)


def assert_greedy_matches_transformers(fp8: Path, twin: Path) -> None:
    prompts = random_prompts([1, 9, 40, 70], seed=3)
    llm = LLM(str(fp8), dtype="float32", device="cpu", kvcache_block_size=16)
    outputs = llm.generate(prompts, greedy(TOKENS), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == hf_greedy(hf, prompt, TOKENS), f"prompt of {len(prompt)} tokens diverged"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_an_fp8_checkpoint_gives_transformers_greedy_ids_on_its_dequantized_weights(layout, checkpoints):
    fp8, twin = checkpoints[layout]
    stored = load_file(fp8 / "model.safetensors")
    assert stored["model.layers.0.self_attn.q_proj.weight"].dtype == FP8
    assert stored["model.layers.1.mlp.down_proj.weight"].dtype == (torch.float32 if layout == "ct-channel" else FP8)
    assert stored["lm_head.weight"].dtype == (FP8 if layout.startswith("fp8") else torch.float32)
    assert_greedy_matches_transformers(fp8, twin)


def test_a_qwen3_moe_checkpoint_of_fp8_experts(tmp_path):
    src = make_tiny_model(tmp_path / "src", **TINY_PRESETS["qwen3_moe"])  # per expert: experts.3.gate_proj.weight
    block = LAYOUTS["fp8-block"]  # the routers (mlp.gate) unquantized, as the published checkpoints leave them
    layout = dataclasses.replace(block, config=block.config | dict(modules_to_not_convert=["mlp.gate"]))
    write_fp8(src, tmp_path / "fp8", tmp_path / "twin", layout)
    stored = load_file(tmp_path / "fp8" / "model.safetensors")
    assert stored["model.layers.0.mlp.experts.5.down_proj.weight_scale_inv"].shape == (2, 1)  # [64, 32]: 48 rows
    assert stored["model.layers.0.mlp.gate.weight"].dtype == torch.float32  # the router, left unquantized
    assert_greedy_matches_transformers(tmp_path / "fp8", tmp_path / "twin")


@pytest.mark.parametrize("preset", ["qwen3_5_moe", "qwen3_next"])
def test_a_hybrid_checkpoint_of_fp8_weights(preset, tmp_path):
    # Qwen3.5's and Qwen3-Next's -FP8 releases: the DeltaNet's projections (separate or fused), the gated
    # attention's and the experts' in FP8 blocks, the routers left unquantized
    src = make_tiny_model(tmp_path / "src", **TINY_PRESETS[preset])
    block = LAYOUTS["fp8-block"]
    layout = dataclasses.replace(block, config=block.config | dict(modules_to_not_convert=["mlp.gate"]))
    write_fp8(src, tmp_path / "fp8", tmp_path / "twin", layout)
    stored = load_file(tmp_path / "fp8" / "model.safetensors")
    assert stored["model.layers.0.linear_attn.out_proj.weight"].dtype == FP8
    assert_greedy_matches_transformers(tmp_path / "fp8", tmp_path / "twin")


def test_two_ranks_split_an_fp8_checkpoint_and_compute_what_one_does(checkpoints):
    path = checkpoints["fp8-block"][0]
    _, expected = logits_of(path, keep_fp8=False)
    out = in_threads(2, lambda tp: logits_of(path, keep_fp8=False, tp=tp)[1])
    assert out[1] is None  # rank 0 gathers the vocabulary's halves
    torch.testing.assert_close(out[0], expected, rtol=1e-5, atol=1e-5)  # the row-parallel sums add in another order
    assert torch.equal(out[0].argmax(-1), expected.argmax(-1))


def test_dummy_weights_for_a_quantized_config(tmp_path):
    path = make_tiny_model(tmp_path, weights=False)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"quantization_config": LAYOUTS["fp8-block"].config}))
    out = LLM(str(path), device="cpu", load_format="dummy").generate([[5, 6, 7]], greedy(4), use_tqdm=False)
    assert len(out[0].token_ids) == 4


def _spec(**quantization_config):
    config = Qwen3Config(architectures=["Qwen3ForCausalLM"], hidden_size=64, intermediate_size=96, head_dim=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         quantization_config=quantization_config)  # fmt: skip
    return decoder_spec(config, max_model_len=256)


NVFP4 = dict(num_bits=4, type="float", symmetric=True, strategy="tensor_group", group_size=16, dynamic=False)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (dict(quant_method="gptq", bits=4), r"quantized with 'gptq'.*nanostream loads quant_method 'fp8'"),
        (dict(quant_method="bitsandbytes"), r"quantized with 'bitsandbytes'"),
        (dict(_ct("tensor", None), config_groups={"g": dict(weights=NVFP4)}),
         r"config_groups\.g\.weights\.num_bits=4"),
        (_ct("group", None), r"config_groups\.group_0\.weights\.strategy='group'"),
        (_ct("channel", None) | dict(format="pack-quantized"), r"format='pack-quantized'"),
        (_ct("channel", dict(DYNAMIC_TOKENS, dynamic=False)), r"input_activations=.*dynamic per token or static"),
        (_ct("channel", None) | dict(kv_cache_scheme=dict(num_bits=8, type="int")), r"kv_cache_scheme\.type='int'"),
        (dict(quant_method="fp8", activation_scheme="static", weight_block_size=[128, 128]),
         r"activation_scheme='static' with weight_block_size \(block-wise FP8 is dynamic\)"),
        (dict(quant_method="fp8", weight_block_size=[128]), r"weight_block_size=\[128\] \(two positive integers"),
        (dict(quant_method="fp8", weight_block_size=[128, 128], fmt="e5m2"), r"fmt='e5m2'"),
    ],
)  # fmt: skip
def test_what_does_not_load_is_refused_by_name(config, message):
    with pytest.raises(ModelLoadError, match=message):
        _spec(**config)


def test_weight_only_fp8_and_transformers_config_objects_read():
    _spec(**_ct("channel", None))  # no input_activations: activations are not quantized here anyway
    config = FineGrainedFP8Config(weight_block_size=(32, 64), modules_to_not_convert=["lm_head"])
    assert fp8_spec(config, "Qwen3ForCausalLM") == Fp8Spec("fp8", (32, 64), unquantized=("lm_head",))


def _broken(checkpoints, tmp_path, change) -> Path:
    path = tmp_path / "broken"
    shutil.copytree(checkpoints["fp8-block"][0], path)
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


Q = "model.layers.0.self_attn.q_proj.weight"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t.pop(Q + "_scale_inv"), f"{Q} is stored as F8_E4M3 without a scale: the checkpoint lacks"),
        (lambda t: t.pop(Q), f"holds the scale {Q}_scale_inv but not its weight {Q}$"),
        (lambda t: t.update({Q + "_scale_inv": torch.ones(3, 3)}),
         r"of shape \[64, 96\] has a scale of shape \[3, 3\]; blocks of 48 x 40: \[2, 3\]"),
    ],
)  # fmt: skip
def test_a_missing_or_misshapen_scale_is_refused(checkpoints, tmp_path, change, message):
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(_broken(checkpoints, tmp_path, change)), dtype="float32", device="cpu")


def test_an_fp8_weight_of_a_module_the_ignore_list_leaves_unquantized_is_refused(checkpoints, tmp_path):
    path = tmp_path / "ignored"
    shutil.copytree(checkpoints["fp8-tensor"][0], path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = ["lm_head"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="lm_head.weight_scale_inv: a scale for a module that"):
        LLM(str(path), dtype="float32", device="cpu")


@pytest.mark.parametrize("names", [("self_attn.k_scale", "self_attn.v_scale"),
                                   ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale")])  # fmt: skip
def test_a_kv_cache_schemes_scales_load_into_the_fp8_cache(checkpoints, tmp_path, names):
    # llm-compressor's names (and AutoFP8's older ones) of the per-layer KV scales: read by an FP8 cache.
    fp8, twin = checkpoints["ct-tensor"]
    path = tmp_path / "kv"
    shutil.copytree(fp8, path)
    tensors = load_file(path / "model.safetensors")
    for layer in range(2):
        for name, value in zip(names, (0.25, 0.5), strict=True):
            tensors[f"model.layers.{layer}.{name}"] = torch.tensor([value + layer])
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(str(path), dtype="float32", device="cpu", kvcache_block_size=16, kv_cache_dtype="fp8")
    scales = [layer.self_attn.attn.kv_scales.scales() for layer in llm.engine.runner.model.model.layers]
    assert [(k.item(), v.item()) for k, v in scales] == [(0.25, 0.5), (1.25, 1.5)]
    assert_greedy_matches_transformers(path, twin)  # in the model's dtype the scales change nothing


# Kept FP8 (what a GPU runs; here with the reference matmul, the weight dequantized in each call): the same
# logits as the weights dequantized on load, the checkpoint's FP8 bytes and scales in the layers.
ALIGNED = (16, 16)  # heads of 16 rows, an intermediate of 160 (80 a rank): every layer keeps its blocks
KEPT_LAYOUTS = {"fp8-block-aligned": dataclasses.replace(
    LAYOUTS["fp8-block"], block=ALIGNED, config=LAYOUTS["fp8-block"].config | dict(weight_block_size=list(ALIGNED))
)} | {k: v for k, v in LAYOUTS.items() if k != "fp8-block"}  # fmt: skip


def logits_of(path: Path, keep_fp8: bool, tp: TensorParallel = SINGLE, load_format: str = "auto"):
    spec = spec_of(path)
    model = load_model(spec, LayerKernels(TorchAttention()), path, dtype=torch.float32, device=CPU, tp=tp,
                       load_format=load_format, keep_fp8=keep_fp8)  # fmt: skip
    kv = allocate_kv_pool(spec, 8, 8, torch.float32, CPU, model.shard.num_kv_heads)
    seq = Sequence("s", list(range(3, 40)), SamplingParams(), max_tokens=1, sampling_seed=0,
                   stop_token_ids=frozenset())  # fmt: skip
    seq.block_table = list(range(8))
    inputs = pack_step([WarmupChunk(seq, 0, 37)], 8, CPU)
    with torch.inference_mode():
        hidden = model(inputs.input_ids, inputs.positions, ForwardContext(inputs.meta, kv))
        return model, model.compute_logits(hidden[inputs.sample_rows])


def kept(model) -> dict[str, tuple[int, int]]:
    return {n: m.fp8_block for n, m in model.named_modules() if getattr(m, "fp8_block", None) is not None}


@pytest.fixture(scope="module")
def kept_checkpoints(qwen3, tmp_path_factory):
    return {name: paths[0] for name, paths in written(qwen3, tmp_path_factory, KEPT_LAYOUTS).items()}


@pytest.mark.parametrize("layout", list(KEPT_LAYOUTS))
def test_kept_fp8_weights_compute_what_the_dequantized_ones_do(layout, kept_checkpoints):
    path = kept_checkpoints[layout]
    model, logits = logits_of(path, keep_fp8=True)
    _, expected = logits_of(path, keep_fp8=False)
    torch.testing.assert_close(logits, expected, rtol=1e-6, atol=1e-6)
    blocks = kept(model)
    per_layer = ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"]
    skipped = {f"model.layers.1.{m}" for m in per_layer[2:]} if layout == "ct-channel" else set()
    assert set(blocks) == {f"model.layers.{i}.{m}" for i in range(2) for m in per_layer} - skipped
    expected_block = ALIGNED if layout == "fp8-block-aligned" else (1, None)
    for name, block in blocks.items():
        layer = model.get_submodule(name)
        assert layer.weight.dtype == FP8 and layer.weight_scale.dtype == torch.float32
        assert block[0] == expected_block[0] and block[1] == (expected_block[1] or layer.weight.shape[1])
    # the checkpoint's FP8 bytes, as stored: q's rows lead the fused projection
    q = load_file(path / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    qkv = model.get_submodule("model.layers.0.self_attn.qkv_proj").weight
    assert torch.equal(qkv[: q.shape[0]].view(torch.uint8), q.view(torch.uint8))


def test_two_ranks_keep_their_rows_of_the_fp8_blocks_and_compute_what_one_does(kept_checkpoints):
    path = kept_checkpoints["fp8-block-aligned"]
    _, expected = logits_of(path, keep_fp8=False)
    out = in_threads(2, lambda tp: logits_of(path, keep_fp8=True, tp=tp))
    assert len(kept(out[1][0])) == 8  # each rank's q/k/v heads, gate/up rows and o/down columns, block-aligned
    torch.testing.assert_close(out[0][1], expected, rtol=1e-5, atol=1e-5)


def test_a_layer_whose_rows_cross_the_blocks_dequantizes_on_load(checkpoints):
    # Blocks of 48 rows: q's 64 and gate's 160 end inside one, so the fused projections dequantize; o_proj and
    # down_proj, whole tensors at one rank, keep theirs (partial blocks at the edges).
    path = checkpoints["fp8-block"][0]
    model, logits = logits_of(path, keep_fp8=True)
    assert set(kept(model)) == {
        f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.o_proj", "mlp.down_proj")
    }
    torch.testing.assert_close(logits, logits_of(path, keep_fp8=False)[1], rtol=1e-6, atol=1e-6)


def test_a_kept_layer_quantizes_a_tensor_the_checkpoint_left_unquantized(kept_checkpoints, tmp_path):
    path = tmp_path / "mixed"
    shutil.copytree(kept_checkpoints["fp8-block-aligned"], path)
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name].float() * tensors.pop(name + "_scale_inv").repeat_interleave(16, 0).repeat_interleave(
        16, 1
    )
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    model, logits = logits_of(path, keep_fp8=True)
    assert "model.layers.0.mlp.gate_up_proj" in kept(model)
    _, expected = logits_of(kept_checkpoints["fp8-block-aligned"], keep_fp8=True)
    torch.testing.assert_close(logits, expected, rtol=0.02, atol=0.02)  # requantized in the same blocks


def test_dummy_fp8_weights_come_with_their_scales(tmp_path):
    path = make_tiny_model(tmp_path, weights=False)
    config = json.loads((path / "config.json").read_text())
    block = dict(quant_method="fp8", activation_scheme="dynamic", weight_block_size=[16, 16])
    (path / "config.json").write_text(json.dumps(config | {"quantization_config": block}))
    model, logits = logits_of(path, keep_fp8=True, load_format="dummy")
    assert kept(model) and all(b == (16, 16) for b in kept(model).values())
    layer = model.get_submodule("model.layers.0.mlp.down_proj")
    assert layer.weight_scale.min() > 0 and layer.weight.float().abs().max() == FP8_MAX  # each block's amax at 448
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("family", ["phi3", "glm4"])
@pytest.mark.parametrize("layout", ["fp8-block-aligned", "ct-channel"])
def test_kept_fp8_weights_of_fused_and_rotary_reordered_projections(family, layout, tmp_path):
    # Phi-3's checkpoint fuses qkv_proj and gate_up_proj; both families' q/k rows are reordered after loading
    # for their rotary layout (the FP8 bytes and their per-row scales with them; a block holds whole heads).
    src = make_tiny_model(tmp_path / "src", **TINY_PRESETS[family])
    write_fp8(src, tmp_path / "fp8", tmp_path / "twin", KEPT_LAYOUTS[layout])
    model, logits = logits_of(tmp_path / "fp8", keep_fp8=True)
    assert "model.layers.0.self_attn.qkv_proj" in kept(model)
    torch.testing.assert_close(logits, logits_of(tmp_path / "fp8", keep_fp8=False)[1], rtol=1e-6, atol=1e-6)


needs_fp8_gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)), reason="needs an sm89+ GPU"
)


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("m", [1, 5, 64, 300])
@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 12288)])  # Qwen3-8B's qkv_proj and down_proj
@pytest.mark.parametrize("block", [(128, 128), None])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_linear_on_cuda_against_the_dequantized_matmul_gpu(m, n, k, block, dtype):
    from nanostream.layers.fp8_linear import dequantize, fp8_linear, quantize

    gen = torch.Generator("cuda").manual_seed(m + n)
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    block_ = block or (1, k)
    wq, ws = quantize(w, block_)
    x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    bias = torch.randn(n, device="cuda", generator=gen).to(dtype)
    out = fp8_linear(x, wq, ws, block_, bias)
    assert out.dtype == dtype and out.shape == (m, n)
    ref = x.double() @ dequantize(wq, ws, block_).double().T + bias.double()
    # the activations' e4m3 rounding (3 mantissa bits) per element: ~2-3% of the product
    assert ((out.double() - ref).norm() / ref.norm()).item() < 0.05


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_an_fp8_checkpoint_on_cuda_runs_every_linear_layer_in_fp8_gpu(kv_cache_dtype, enforce_eager, tmp_path):
    # 128 x 128 blocks (Qwen3-8B-FP8's) over a small model of 128-wide heads: every linear layer keeps FP8, and
    # each of its calls in the engine (prefill and decode, 1 to 910 tokens; graphs replay what warm-up ran)
    # lands within the activations' e4m3 rounding of the dequantized matmul of its own input. (The tiny random
    # model's tokens are no measure of agreement: its 2.4x gain a layer amplifies any rounding into another
    # argmax; apps/fp8_agreement.py measures that on the 8B shape.)
    from nanostream.layers.fp8_linear import dequantize

    src = make_tiny_model(tmp_path / "src", seed=5, hidden_size=256, intermediate_size=512, head_dim=128,
                          num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=4)  # fmt: skip
    layout = dataclasses.replace(KEPT_LAYOUTS["fp8-block-aligned"], block=(128, 128),
                                 config=LAYOUTS["fp8-block"].config | dict(weight_block_size=[128, 128]))  # fmt: skip
    write_fp8(src, tmp_path / "fp8", tmp_path / "twin", layout)
    llm = LLM(str(tmp_path / "fp8"), dtype="bfloat16", device="cuda", enforce_eager=enforce_eager,
              gpu_memory_utilization=0.2, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    layers = kept(llm.engine.runner.model)
    assert len(layers) == 16
    errors: dict[tuple[str, int], float] = {}

    def check(name, layer, args, out):
        if torch.cuda.is_current_stream_capturing():
            return  # a graph's capture: checked where it ran eagerly (warm-up)
        x = args[0]
        if not isinstance(x, torch.Tensor):  # a PendingNorm (batch 1): the norm's input and its 1 / rms
            x = x.x * torch.rsqrt(x.sumsq.sum(-1, keepdim=True) / x.x.shape[-1] + x.eps)
        ref = F.linear(x.float(), dequantize(layer.weight, layer.weight_scale, layer.fp8_block))
        errors[name, x.shape[0]] = ((out.float() - ref).norm() / ref.norm()).item()

    for name in layers:
        llm.engine.runner.model.get_submodule(name).register_forward_hook(functools.partial(check, name))
    prompts = random_prompts([1, 9, 200, 700], seed=4)
    outputs = llm.generate(prompts, greedy(32), use_tqdm=False)
    assert [len(o.token_ids) for o in outputs] == [32] * 4
    if enforce_eager:  # the prefill of all four prompts (910 tokens) and their decode steps (4 rows)
        assert {4, 910} <= {m for _, m in errors}
    else:  # graphs: every call captured (no hook runs); the eager case checks the same layers
        assert llm.engine.runner.graphs is not None
    assert max(errors.values(), default=0.0) < 0.05, sorted(errors.items(), key=lambda e: -e[1])[:3]


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("family", ["Qwen3ForCausalLM", "Gemma3ForCausalLM"])
@pytest.mark.parametrize("layout", ["fp8-block-128", "ct-channel"])
def test_an_fp8_mlp_at_one_token_fuses_its_activation_into_the_gemv_with_the_same_bits_gpu(family, layout, tmp_path):
    # At one token on CUDA a kept gate_up_proj's GEMV applies the activation (SiLU; Gemma's tanh GELU) as it
    # stores: each kept MLP's output is the bits of its three steps one by one, and a batch-1 request decodes.
    from nanostream.layers.fp8_linear import gemv_runs
    from nanostream.models.mlps import MLP

    src = make_tiny_model(tmp_path / "src", architecture=family, seed=6, hidden_size=256, intermediate_size=512,
                          head_dim=128, num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    block128 = dataclasses.replace(KEPT_LAYOUTS["fp8-block-aligned"], block=(128, 128),
                                   config=LAYOUTS["fp8-block"].config | dict(weight_block_size=[128, 128]))  # fmt: skip
    write_fp8(src, tmp_path / "fp8", tmp_path / "twin", block128 if layout == "fp8-block-128" else KEPT_LAYOUTS[layout])
    llm = LLM(str(tmp_path / "fp8"), dtype="bfloat16", device="cuda", gpu_memory_utilization=0.2)
    mlps = [m for m in llm.engine.runner.model.modules() if isinstance(m, MLP) and m.gate_up_proj.fp8_block]
    assert mlps  # (ct-channel's ignore list leaves layer 1's MLP unquantized)
    gen = torch.Generator("cuda").manual_seed(0)
    with torch.inference_mode():
        for mlp in mlps:
            x = torch.randn(1, 256, device="cuda", generator=gen).bfloat16()
            assert gemv_runs(x, mlp.gate_up_proj.fp8_block)
            assert torch.equal(mlp(x), mlp.down_proj(mlp.act(mlp.gate_up_proj(x))))
    (out,) = llm.generate(random_prompts([9], seed=1), greedy(16), use_tqdm=False)
    assert len(out.token_ids) == 16


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("family", ["Qwen3ForCausalLM", "Gemma3ForCausalLM"])
def test_a_batch_1_step_ends_o_proj_and_down_proj_in_the_norms_after_them_gpu(family, tmp_path):
    # At one token a kept o_proj's GEMV ends in mlp_in's residual add and norm, down_proj's in the next layer's
    # attn_in, each norm's 1 / rms left to the GEMV after it (Qwen3; Gemma 3's norms after the blocks keep their
    # kernels): each hand-off between layers within a rounding of the layers' modules one by one, and a
    # batch-1 request decodes in the CUDA graphs.
    src = make_tiny_model(tmp_path / "src", architecture=family, seed=7, hidden_size=256, intermediate_size=512,
                          head_dim=128, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=3)  # fmt: skip
    block128 = dataclasses.replace(KEPT_LAYOUTS["fp8-block-aligned"], block=(128, 128),
                                   config=LAYOUTS["fp8-block"].config | dict(weight_block_size=[128, 128]))  # fmt: skip
    write_fp8(src, tmp_path / "fp8", tmp_path / "twin", block128)
    llm = LLM(str(tmp_path / "fp8"), dtype="bfloat16", device="cuda", gpu_memory_utilization=0.2)
    model = llm.engine.runner.model.model
    gen = torch.Generator("cuda").manual_seed(0)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    with torch.inference_mode():
        for i, (layer, after) in enumerate(zip(model.layers, model.layers[1:])):
            attn = torch.randn(1, 256, device="cuda", generator=gen).bfloat16()
            residual = torch.randn(1, 256, device="cuda", generator=gen).bfloat16()
            handed = layer.attn_out(attn, residual)[0]
            assert isinstance(handed, torch.Tensor) == (family != "Qwen3ForCausalLM")
            qkv, res = model.between(i, attn, residual)
            h = layer.self_attn.o_proj(attn)
            if layer._attn_out is not None:
                h = layer._attn_out(h)
            x, r = layer._mlp_in(h, residual)
            x = layer.mlp(x)
            if layer._mlp_out is not None:
                x = layer._mlp_out(x)
            h, r = after._attn_in(x, r)
            # (bf16 roundings apart, through a random MLP: ~8e-3 under Triton's interpreter on the CPU)
            assert rel(res, r) < 3e-2 and rel(qkv, after.self_attn.qkv_proj(h)) < 3e-2, i
    (out,) = llm.generate(random_prompts([9], seed=1), greedy(16), use_tqdm=False)
    assert len(out.token_ids) == 16 and llm.engine.runner.graphs is not None
