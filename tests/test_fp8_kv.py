"""The FP8 KV cache (``kv_cache_dtype="fp8"``): the option and its refusals, the pool's size, the scales'
loading, the torch backend against a float32 cache, and the Triton kernels against the torch backend on
the same FP8 pool.

On CPU the Triton kernels run under Triton's interpreter. Its float32 -> float8 e4m3 cast (triton 3.9's
``_convert_float``) rounds by adding the first dropped bit to the three kept ones without carrying into
the exponent when the exponent's lowest bit is set: such an element (~2.5% of random values, those whose
mantissa rounds up from 1.111b) comes out as half its value, 2^e instead of 2^(e+1). Compiled kernels
round as the GPU does (round to nearest even, as torch). ``check_stored`` allows exactly that and nothing
else; the attention kernels are compared on a pool the torch backend wrote, where the two must agree to
float32 rounding.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_flash_attention_backend import SCALE, make_step
from test_kernels import DEVICE, paged_pool, randn, reference, rel_err
from transformers import AutoConfig

from nanostream import LLM, SamplingParams
from nanostream.cli import build_parser
from nanostream.config import EngineConfig
from nanostream.engine.runner.cache_pool import CacheLayout
from nanostream.engine.runner.kv_pool import WarmupChunk, allocate_kv_pool, plan_num_kv_blocks
from nanostream.engine.runner.step_inputs import pack_step
from nanostream.engine.sequence import Sequence
from nanostream.kernels.decode_attention import paged_decode_attention
from nanostream.kernels.fp8_kv import FP8_KV_DTYPE, FP8_KV_MAX, dequantize_kv, quantize_kv
from nanostream.kernels.prefill_attention import paged_prefill_attention
from nanostream.kernels.qkv_prologue import qkv_prologue
from nanostream.kernels.store_kv import store_kv
from nanostream.layers.attention import Attention, ForwardContext
from nanostream.layers.attention_backend import KVCache, TorchAttention
from nanostream.layers.cache_spec import PagedKV
from nanostream.layers.flash_attention import FP8_KV_REFUSED, FlashAttention, flash_attn_unavailable_reason
from nanostream.layers.layer_kernels import LayerKernels
from nanostream.layers.norm import RMSNorm
from nanostream.layers.rotary import RopeSpec, RotaryEmbedding
from nanostream.layers.triton_attention import TritonAttention
from nanostream.models import decoder_spec, load_model
from nanostream.testing import TINY_PRESETS, make_tiny_model

CPU = torch.device("cpu")
INTERPRETED = DEVICE == "cpu"
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def scales(k: float, v: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's k_scale and v_scale as the backends take them."""
    return tuple(torch.tensor([x], dtype=torch.float32, device=DEVICE) for x in (k, v))


def check_stored(out: torch.Tensor, ref: torch.Tensor, near: bool = False) -> None:
    """``out`` (a Triton kernel's FP8 store) equals ``ref`` (``quantize_kv``'s), but under the interpreter at
    elements its cast leaves at half their value (the module docstring), no more than 5% of them. ``near``:
    ``out`` came from values computed otherwise in float32's last bit, which may cross an e4m3 rounding
    boundary: an element may also be one e4m3 step (2^-3 of its power of two) from ``ref``'s."""
    a, b = out.float(), ref.float()
    assert not a.isnan().any(), "a stored element is NaN (not saturated, or never written)"
    off = a != b
    if near:
        off &= (a - b).abs() > 2 ** (b.abs().clamp_min(2**-6).log2().floor() - 3)
    if not INTERPRETED:
        assert not off.any(), (a[off][:4], b[off][:4])
        return
    assert off.float().mean() < 0.05, f"{int(off.sum())} of {off.numel()} stored elements differ"
    power_of_two = b[off].abs().log2() == b[off].abs().log2().round()
    assert torch.equal(a[off] * 2, b[off]) and power_of_two.all(), (a[off][:4], b[off][:4])


# ---- the option ------------------------------------------------------------------------------------


def test_kv_cache_dtype_is_validated_by_name():
    for name in ("auto", "fp8", "fp8_e4m3"):
        assert EngineConfig(model="m", kv_cache_dtype=name).kv_cache_dtype == name
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3; got 'int8'"):
        EngineConfig(model="m", kv_cache_dtype="int8")


def test_serve_help_shows_kv_cache_dtype_and_a_bad_value_is_refused(capsys):
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]
    text = " ".join(serve.format_help().split())
    assert "--kv-cache-dtype {auto,fp8,fp8_e4m3}" in text and "twice the KV blocks" in text
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["serve", "--kv-cache-dtype", "int8"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'int8'" in capsys.readouterr().err
    assert parser.parse_args(["serve", "--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"


def test_flash_attn_with_an_fp8_cache_is_refused_naming_triton(qwen3_dir):
    reason = flash_attn_unavailable_reason(torch.device("cuda"), torch.bfloat16, 256, 128, FP8_KV_DTYPE)
    assert reason == FP8_KV_REFUSED and "attention_backend='triton'" in reason
    with pytest.raises(ValueError, match=r"'flash_attn' cannot run here: FlashAttention does not read an FP8 KV"):
        LLM(str(qwen3_dir), device="cpu", kv_cache_dtype="fp8", attention_backend="flash_attn")
    step = make_step([(0, 3)], 4, 2, 16, 16, seed=0)
    cache = KVCache(step.cache.k.to(FP8_KV_DTYPE), step.cache.v.to(FP8_KV_DTYPE))
    with pytest.raises(ValueError, match="FlashAttention does not read an FP8 KV cache"):
        k_scale, v_scale = scales(1, 1)
        FlashAttention().forward(step.q, step.k, step.v, cache, step.meta, SCALE, k_scale=k_scale, v_scale=v_scale)


# ---- the pool --------------------------------------------------------------------------------------


def no_cuda() -> int:
    raise AssertionError("the budget is given: nothing to measure")


def test_a_pool_never_holds_more_blocks_than_the_engine_can_fill():
    # A tiny model on an 80 GB GPU would get ~70 million blocks of 1 KiB (a Python record each, minutes to make):
    # the pool stops at a block table of max_model_len per sequence and KV group.
    config = EngineConfig(model="m", max_num_seqs=12, kvcache_block_size=8).resolve(
        max_position_embeddings=4096, cuda_available=True
    )
    gpu = lambda: 72 << 30
    assert plan_num_kv_blocks(config, 1024, torch.device("cuda"), gpu) == 12 * 4096 // 8
    assert plan_num_kv_blocks(config, 1 << 30, torch.device("cuda"), gpu) == 72  # the memory binds first


def test_an_fp8_pool_holds_twice_the_blocks_of_a_bfloat16_one(qwen3_dir, caplog):
    spec = decoder_spec(AutoConfig.from_pretrained(qwen3_dir), max_model_len=2048)
    layout = CacheLayout([PagedKV(spec.num_kv_heads, spec.head_dim)] * spec.num_layers)
    bf16, fp8 = (layout.kv_block_bytes(16, dtype) for dtype in (torch.bfloat16, FP8_KV_DTYPE))
    assert bf16 == 2 * fp8 == 2 * 2 * spec.num_layers * 16 * spec.num_kv_heads * spec.head_dim
    config = EngineConfig(model="m", kv_cache_memory_bytes=1 << 20).resolve(
        max_position_embeddings=2048, cuda_available=False
    )
    assert plan_num_kv_blocks(config, fp8, CPU, no_cuda) == 2 * plan_num_kv_blocks(config, bf16, CPU, no_cuda)
    # The engine as a user builds it: a bfloat16 model, the same budget, and the count in its start-up line.
    blocks = {}
    with caplog.at_level(logging.INFO, logger="nanostream.engine.llm_engine"):
        for kv in ("auto", "fp8"):
            llm = LLM(str(qwen3_dir), device="cpu", dtype="bfloat16", kvcache_block_size=16,
                      kv_cache_memory_bytes=1 << 20, kv_cache_dtype=kv)  # fmt: skip
            blocks[kv] = llm.engine.block_manager.num_blocks
            assert all(
                c.k.dtype == (FP8_KV_DTYPE if kv == "fp8" else torch.bfloat16) for c in llm.engine.runner.kv_caches
            )
    assert blocks["fp8"] == 2 * blocks["auto"] == (1 << 20) // fp8
    assert f"{blocks['fp8']} KV blocks of 16 tokens (float8_e4m3fn)" in caplog.text
    assert f"{blocks['auto']} KV blocks of 16 tokens (bfloat16)" in caplog.text


# ---- the torch backend: the reference ----------------------------------------------------------------


@pytest.mark.parametrize("window", [None, 3, 16])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("contexts", [[(0, 40), (200, 5), (37, 30)], [(0, 1), (16, 1), (99, 1), (299, 1)]])
def test_torch_backend_attends_the_dequantized_pool(contexts, window, sinks):
    # The FP8 pool's result is, to the bit, a float32 pool's holding its values dequantized: the stored
    # values are quantize_kv's (saturated: some inputs lie past 448 * scale), and nothing else changes.
    step = make_step(contexts, 8, 2, 16, 16, seed=len(contexts), device=DEVICE)
    k_scale, v_scale = scales(0.0037, 0.0029)  # amax / 448 of a unit-normal K/V: a calibrated pair
    sink = 2 * torch.randn(8, generator=torch.Generator().manual_seed(1)).to(DEVICE) if sinks else None
    pool = KVCache(quantize_kv(step.cache.k, k_scale), quantize_kv(step.cache.v, v_scale))
    out = TorchAttention().forward(step.q, step.k, step.v, pool, step.meta, SCALE, window=window, sinks=sink,
                                   k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    slots = step.meta.slot_mapping
    stored_k = pool.k.view(-1, 2, 16)[slots]
    assert torch.equal(stored_k.float(), quantize_kv(step.k, k_scale).float())
    assert stored_k.float().abs().max() == FP8_KV_MAX and (step.k.abs() > FP8_KV_MAX * k_scale).any()
    plain = KVCache(dequantize_kv(pool.k, k_scale, torch.float32), dequantize_kv(pool.v, v_scale, torch.float32))
    ref = TorchAttention().forward(step.q, dequantize_kv(stored_k, k_scale, torch.float32),
                                   dequantize_kv(pool.v.view(-1, 2, 16)[slots], v_scale, torch.float32),
                                   plain, step.meta, SCALE, window=window, sinks=sink)  # fmt: skip
    assert torch.equal(out, ref)


def batch_logits(model, spec, prompts: list[list[int]], kv_dtype: torch.dtype) -> torch.Tensor:
    """The logits [T, V] at every position of ``prompts``, prefilled as one step on a fresh pool."""
    kv = allocate_kv_pool(spec, 8 * len(prompts), 16, kv_dtype, CPU)
    chunks = []
    for i, prompt in enumerate(prompts):
        seq = Sequence(f"s{i}", prompt, SamplingParams(), max_tokens=1, sampling_seed=0, stop_token_ids=frozenset())
        seq.block_table = list(range(8 * i, 8 * i + 8))
        chunks.append(WarmupChunk(seq, 0, len(prompt)))
    inputs = pack_step(chunks, 16, CPU)
    with torch.inference_mode():
        return model.compute_logits(model(inputs.input_ids, inputs.positions, ForwardContext(inputs.meta, kv)))


# Measured (torch 2.13, CPU): relative logit error 0.062 / 0.153 / 0.233 and argmax agreement 0.919 / 0.779 /
# 0.738 over the batch's 652 positions. e4m3 keeps 3 mantissa bits (bfloat16: 7), a relative rounding of up
# to 1/16 an element; these random models' attention is sharp (init_std 0.15 for peaked next-token
# distributions), Gemma 3's windows and gpt-oss's sinks sharper still, so one element's rounding moves the
# logits more than a trained model's would.
LOGIT_BOUNDS = {"qwen3": (0.08, 0.88), "gemma3": (0.2, 0.72), "gpt_oss": (0.3, 0.68)}


@pytest.mark.parametrize("name", list(LOGIT_BOUNDS))
def test_fp8_cache_logits_stay_near_the_float32_caches(name, tmp_path):
    """A batch of 8 prompts (33 to 128 tokens) prefilled over a float32 pool and an FP8 one (scales 1.0, as
    an uncalibrated checkpoint's), teacher-forced: every position's next-token logits compared."""
    preset = {"seed": 1} if name == "qwen3" else TINY_PRESETS[name]
    path = make_tiny_model(tmp_path, **preset)
    spec = decoder_spec(AutoConfig.from_pretrained(path), max_model_len=2048)
    model = load_model(spec, LayerKernels.for_backend(TorchAttention()), path, dtype=torch.float32, device=CPU)
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, spec.vocab_size, (n,), generator=gen).tolist() for n in (40, 64, 77, 100, 120, 33, 90, 128)
    ]
    ref, out = (batch_logits(model, spec, prompts, dtype) for dtype in (torch.float32, FP8_KV_DTYPE))
    err_bound, agree_bound = LOGIT_BOUNDS[name]
    assert ((out - ref).norm() / ref.norm()).item() < err_bound
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean().item() > agree_bound


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_greedy_decoding_with_prefix_hits_and_chunks(qwen3_dir):
    """Through the engine: prompts sharing a 40-token prefix (prefix-cache hits on FP8 blocks) prefilled in
    chunks of 32 tokens decode the ids of the same prompts prefilled whole without a prefix cache, and
    agree with the float32 cache's on most first tokens (measured: 7 of 8). Past the first id that differs a
    random model's continuations part: the 24-token greedy runs share their first 3.9 ids on average
    (0 to 12); the per-position figure is test_fp8_cache_logits_stay_near_the_float32_caches's."""
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 500, (40,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 500, (n,), generator=gen).tolist() for n in (1, 9, 30, 70)]
    prompts += [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (5, 17, 64, 100)]
    common = dict(device="cpu", kvcache_block_size=16)
    chunked = LLM(str(qwen3_dir), kv_cache_dtype="fp8", max_num_batched_tokens=32, max_num_seqs=4, **common)
    chunked.generate(prompts[:1], GREEDY, use_tqdm=False)  # the shared prefix's blocks are cached now
    fp8 = chunked.generate(prompts, GREEDY, use_tqdm=False)
    whole = LLM(str(qwen3_dir), kv_cache_dtype="fp8", enable_prefix_caching=False, **common)
    assert [o.token_ids for o in fp8] == [o.token_ids for o in whole.generate(prompts, GREEDY, use_tqdm=False)]
    ref = LLM(str(qwen3_dir), **common).generate(prompts, GREEDY, use_tqdm=False)
    assert sum(o.token_ids[0] == r.token_ids[0] for o, r in zip(fp8, ref)) >= 6
    assert sum(common_prefix(o.token_ids, r.token_ids) for o, r in zip(fp8, ref)) / len(prompts) >= 3


# ---- scales from a checkpoint ------------------------------------------------------------------------


def with_scales(src: Path, dst: Path, values: dict[str, list[float]]) -> Path:
    """A copy of the model at ``src`` whose checkpoint also holds ``self_attn.{name}`` of each layer."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    for name, per_layer in values.items():
        for i, value in enumerate(per_layer):
            tensors[f"model.layers.{i}.self_attn.{name}"] = torch.tensor([value], dtype=torch.float32)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def layer_scales(llm: LLM) -> list[tuple[float, float]]:
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, Attention)]
    return [tuple(t.item() for t in a.kv_scales.scales()) for a in layers]


def test_checkpoint_scales_load_and_change_the_stored_values(qwen3_dir, tmp_path):
    # Scales of 1/4 and 1/8 (powers of two, nothing saturates): every stored value of e4m3's normal range
    # (|x| >= 2^-6; below it steps are absolute) is 4 (K) or 8 (V) times the unscaled cache's, read back as
    # the same value, so the greedy ids are the same too.
    scaled = with_scales(qwen3_dir, tmp_path / "scaled", {"k_scale": [0.25, 0.25], "v_scale": [0.125, 0.125]})
    prompt = [[5, 6, 7, 8, 9, 10, 11]]
    runs = {}
    for name, path in (("plain", qwen3_dir), ("scaled", scaled)):
        llm = LLM(str(path), device="cpu", kvcache_block_size=16, kv_cache_dtype="fp8", enable_prefix_caching=False)
        runs[name] = llm, llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert layer_scales(runs["plain"][0]) == [(1.0, 1.0)] * 2 and layer_scales(runs["scaled"][0]) == [(0.25, 0.125)] * 2
    plain, scaled_pool = (runs[n][0].engine.runner.kv_caches[0] for n in ("plain", "scaled"))
    for name, factor in (("k", 4), ("v", 8)):
        ours, unscaled = getattr(scaled_pool, name).float(), getattr(plain, name).float()
        normal = unscaled.abs() >= 2**-6
        assert normal.sum() > 100 and torch.equal(ours[normal], factor * unscaled[normal]), name
    assert runs["plain"][1][0].token_ids == runs["scaled"][1][0].token_ids
    # A cache in the model's dtype loads them and does not read them.
    auto = [
        LLM(str(p), device="cpu", kvcache_block_size=16).generate(prompt, GREEDY, use_tqdm=False)
        for p in (scaled, qwen3_dir)
    ]
    assert auto[0][0].token_ids == auto[1][0].token_ids


@pytest.mark.parametrize(
    "values, message",
    [
        ({"k_scale": [0.0, 1.0]}, "layer 0's k_scale must be a positive finite number, the checkpoint holds 0.0"),
        ({"v_scale": [1.0, float("nan")]}, "layer 1's v_scale must be a positive finite number"),
    ],
)
def test_bad_checkpoint_scales_are_refused_by_name(qwen3_dir, tmp_path, values, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(with_scales(qwen3_dir, tmp_path / "bad", values)), device="cpu", kv_cache_dtype="fp8")


def test_per_head_scales_are_refused(qwen3_dir, tmp_path):
    path = with_scales(qwen3_dir, tmp_path / "heads", {})
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.k_scale"] = torch.ones(2)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layer 0's k_scale of shape \[2\]: nanostream takes one KV scale per layer"):
        LLM(str(path), device="cpu", kv_cache_dtype="fp8")


def test_random_weights_leave_the_scales_at_one(tmp_path):
    path = make_tiny_model(tmp_path, weights=False)
    llm = LLM(str(path), device="cpu", load_format="dummy", kv_cache_dtype="fp8", kvcache_block_size=16)
    assert layer_scales(llm) == [(1.0, 1.0)] * 2
    assert len(llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].token_ids) == GREEDY.max_tokens


# ---- the Triton kernels against the torch backend, on the same FP8 pool --------------------------


def rows_fastest(pool: torch.Tensor) -> torch.Tensor:
    """``pool`` [blocks, block_size, Hkv, D] laid out as allocate_kv_pool lays an FP8 pool's V (rows fastest)."""
    return pool.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)


@pytest.mark.parametrize("v_rows_fastest", [False, True])
def test_store_kv_quantizes_as_the_torch_backend(v_rows_fastest):
    gen = torch.Generator().manual_seed(2)
    tokens, hkv, d = 40, 2, 16
    qkv = 3 * randn((tokens, (4 + 2 * hkv) * d), torch.float32, gen)  # k, v are strided views
    k, v = qkv[:, 4 * d : (4 + hkv) * d].view(tokens, hkv, d), qkv[:, (4 + hkv) * d :].view(tokens, hkv, d)
    k_scale, v_scale = scales(0.011, 0.0042)  # some |k|, |v| past 448 * scale: saturated
    k_cache = torch.zeros(12, 4, hkv, d, dtype=FP8_KV_DTYPE, device=DEVICE)
    v_cache = rows_fastest(k_cache) if v_rows_fastest else k_cache.clone()
    slots = torch.randperm(48, generator=gen)[:tokens]
    slots[3] = -1
    slots = slots.to(DEVICE)
    store_kv(k, v, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)
    keep = slots >= 0
    flat_k, flat_v = k_cache.view(-1, hkv, d), v_cache.view(torch.uint8).reshape(-1, hkv, d).view(FP8_KV_DTYPE)
    check_stored(flat_k[slots[keep]], quantize_kv(k[keep], k_scale))
    check_stored(flat_v[slots[keep]], quantize_kv(v[keep], v_scale))
    assert (flat_v[slots[keep]].float().abs() == FP8_KV_MAX).any()
    untouched = torch.ones(48, dtype=torch.bool, device=DEVICE)
    untouched[slots[keep]] = False
    assert (flat_k[untouched].float() == 0).all()


def test_fp8_stores_write_nan_as_zero():
    # The attention kernels multiply a block's rows past a context's end by 0: no FP8 pool byte may be NaN.
    x = torch.tensor([[[float("nan"), float("inf"), -float("inf"), 1e6, -3.0, 0.5]]], device=DEVICE)
    ks, vs = scales(1.0, 0.5)
    want = [0.0, FP8_KV_MAX, -FP8_KV_MAX, FP8_KV_MAX, -3.0, 0.5]
    assert quantize_kv(x, ks).float().flatten().tolist() == want
    k_cache = torch.zeros(1, 4, 1, 6, dtype=FP8_KV_DTYPE, device=DEVICE)
    v_cache = rows_fastest(k_cache)
    store_kv(x, x, k_cache, v_cache, torch.tensor([2], device=DEVICE), k_scale=ks, v_scale=vs)
    assert k_cache[0, 2, 0].float().tolist() == want
    assert v_cache[0, 2, 0].float().tolist() == [0.0, FP8_KV_MAX, -FP8_KV_MAX, FP8_KV_MAX, -6.0, 1.0]


@pytest.mark.parametrize("norm, v_rows_fastest", [(True, False), (False, False), (True, True)])
def test_qkv_prologue_stores_as_the_modules_and_the_torch_backend(norm, v_rows_fastest):
    gen = torch.Generator().manual_seed(4)
    tokens, hq, hkv, d = 9, 4, 2, 16
    qkv = randn((tokens, (hq + 2 * hkv) * d), torch.float32, gen)
    positions = torch.randint(0, 4096, (tokens,), generator=gen).to(DEVICE)
    rotary = RotaryEmbedding(d, 4096, RopeSpec(1e6)).to(DEVICE)
    norms = [RMSNorm(d, 1e-6).to(DEVICE) for _ in range(2)]
    for n in norms:
        n.weight.data = 1 + 0.3 * randn((d,), torch.float32, gen)
    k_cache = torch.zeros((tokens + 3) // 4, 4, hkv, d, dtype=FP8_KV_DTYPE, device=DEVICE)
    v_cache = rows_fastest(k_cache) if v_rows_fastest else k_cache.clone()
    slots = torch.randperm(tokens + 3, generator=gen)[:tokens].to(DEVICE)
    k_scale, v_scale = scales(0.004, 0.006)
    weights = (norms[0].weight, norms[1].weight, 1e-6) if norm else (None, None, 0.0)
    q = qkv_prologue(qkv, positions, rotary.cos, rotary.sin, *weights, k_cache, v_cache, slots, hq, hkv,
                     k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    # The same step unfused: the torch path's modules, then the torch backend's store (quantize_kv).
    ref_q, ref_k, ref_v = qkv.split([hq * d, hkv * d, hkv * d], -1)
    ref_q, ref_k, ref_v = ref_q.view(-1, hq, d), ref_k.view(-1, hkv, d), ref_v.view(-1, hkv, d)
    if norm:
        ref_q, ref_k = norms[0](ref_q), norms[1](ref_k)
    ref_q, ref_k = rotary(positions, ref_q, ref_k)
    assert rel_err(q, ref_q.double()) < 1e-5
    check_stored(v_cache.view(torch.uint8).reshape(-1, hkv, d)[slots].view(FP8_KV_DTYPE), quantize_kv(ref_v, v_scale))
    # k: the fused norm sums its squares in another order than the module (float32's last bit)
    check_stored(k_cache.view(-1, hkv, d)[slots], quantize_kv(ref_k, k_scale), near=True)


def fp8_pool(k: torch.Tensor, v: torch.Tensor, k_scale: float, v_scale: float):
    """(the FP8 pool of k and v, its scales, the same pool dequantized in float32) as the torch backend writes."""
    ks, vs = scales(k_scale, v_scale)
    kq, vq = quantize_kv(k, ks), quantize_kv(v, vs)
    return kq, vq, ks, vs, dequantize_kv(kq, ks, torch.float32), dequantize_kv(vq, vs, torch.float32)


@pytest.mark.parametrize(
    "seq_lens, heads, block_size, window, sinks",
    [
        ([1, 37, 200], (4, 2), 16, None, False),  # several splits per sequence
        ([70, 5, 300], (8, 1), 5, 100, False),  # a window starting mid-block, GQA 8
        ([3, 30, 1, 9], (6, 6), 1, 3, True),
        ([1500, 700], (4, 2), 16, 1000, True),  # 16 splits: each split's output scaled once
    ],
)
def test_decode_attention_reads_an_fp8_pool(seq_lens, heads, block_size, window, sinks):
    gen = torch.Generator().manual_seed(7)
    hq, hkv = heads
    k, v, tables = paged_pool(seq_lens, block_size, hkv, 16, torch.float32, gen)
    kq, vq, ks, vs, kd, vd = fp8_pool(k, v, 0.013, 0.0071)
    q = randn((len(seq_lens), hq, 16), torch.float32, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    sink = 2 * randn((hq,), torch.float32, gen) if sinks else None
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, kq, vq, tables, lens, 0.25, max(seq_lens), out, window=window, sinks=sink,
                           k_scale=ks, v_scale=vs)  # fmt: skip
    ref = reference(q, kd, vd, tables, list(range(len(seq_lens) + 1)), lens, 0.25, window, sink)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize(
    "q_lens, prefix_lens, heads, block_size, window, sinks",
    [
        ([5, 70, 1], [0, 30, 100], (4, 2), 16, None, True),  # fresh, chunked/prefix-hit, a decode row
        ([33, 2], [7, 0], (8, 1), 5, 3, False),
        ([130], [300], (4, 2), 16, 100, True),  # query tiles after a long prefix, masked at both ends
    ],
)
def test_prefill_attention_reads_an_fp8_pool(q_lens, prefix_lens, heads, block_size, window, sinks):
    gen = torch.Generator().manual_seed(8)
    hq, hkv = heads
    seq_lens = [a + b for a, b in zip(q_lens, prefix_lens)]
    k, v, tables = paged_pool(seq_lens, block_size, hkv, 16, torch.float32, gen)
    kq, vq, ks, vs, kd, vd = fp8_pool(k, v, 0.009, 0.0033)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    q = randn((cu[-1], hq, 16), torch.float32, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    sink = 2 * randn((hq,), torch.float32, gen) if sinks else None
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, kq, vq, cu_t, lens, tables, max(q_lens), 0.25, out, window=window, sinks=sink,
                            k_scale=ks, v_scale=vs)  # fmt: skip
    assert rel_err(out, reference(q, kd, vd, tables, cu, lens, 0.25, window, sink)) < 1e-5


def test_the_allocator_lays_an_fp8_pool_s_v_rows_fastest():
    spec = SimpleNamespace(num_layers=2, num_kv_heads=4, head_dim=16)  # what the allocator reads of a DecoderSpec
    fp8, bf16 = (allocate_kv_pool(spec, 3, 8, dtype, CPU)[1] for dtype in (FP8_KV_DTYPE, torch.bfloat16))
    assert fp8.v.shape == fp8.k.shape == bf16.v.shape == (3, 8, 4, 16)
    assert fp8.v.stride(1) == 1 and fp8.k.is_contiguous() and bf16.v.is_contiguous()


@pytest.mark.parametrize("pool", ["fp8", "float32"])
@pytest.mark.parametrize("kernel", ["decode", "prefill"])
@pytest.mark.parametrize(
    "seq_lens, block_size, window, sinks",
    [
        ([1, 300, 129, 700], 256, None, False),  # decode: 128-row tiles (FP8) or 64 inside 256-row blocks
        ([65, 5, 200, 64], 64, 50, True),  # 64-row tiles (decode) or 32 (prefill); a window mid-tile
        ([1000, 3], 128, 300, False),  # several splits, the window's first tile masked
        ([40, 17], 16, 7, True),  # blocks smaller than a tile: a page number a row
    ],
)
def test_attention_reads_either_v_layout_and_not_stale_rows(pool, kernel, seq_lens, block_size, window, sinks):
    # Rows of a sequence's last block past its end hold another moment's values: NaN in a float32 pool, e4m3's
    # largest (an FP8 pool holds no NaN: test_fp8_stores_write_nan_as_zero). Tiles inside a block read those
    # rows whole; the output must not see them. The FP8 V is laid out as the allocator lays it (rows fastest).
    gen = torch.Generator().manual_seed(11)
    hq, hkv, d = 4, 2, 16
    k, v, tables = paged_pool(seq_lens, block_size, hkv, d, torch.float32, gen)
    if pool == "fp8":
        k, v, ks, vs, kd, vd = fp8_pool(k, v, 0.013, 0.0071)
        scales_kw = dict(k_scale=ks, v_scale=vs)
    else:
        kd, vd, scales_kw = k.clone(), v.clone(), {}
    for i, n in enumerate(seq_lens):
        if n % block_size:
            block = tables[i, n // block_size]
            for t in (k, v):
                if pool == "fp8":
                    t.view(torch.uint8)[block, n % block_size :] = 0x7E  # 448
                else:
                    t[block, n % block_size :] = float("nan")
    if pool == "fp8":
        v = rows_fastest(v)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    sink = 2 * randn((hq,), torch.float32, gen) if sinks else None
    if kernel == "decode":
        q = randn((len(seq_lens), hq, d), torch.float32, gen)
        cu = list(range(len(seq_lens) + 1))
        out = paged_decode_attention(q, k, v, tables, lens, 0.25, max(seq_lens), window=window, sinks=sink,
                                     **scales_kw)  # fmt: skip
    else:
        q_lens = [min(n, 37) for n in seq_lens]  # the last 37 queries after a prefix (or the whole context)
        cu = [0, *itertools.accumulate(q_lens)]
        q = randn((cu[-1], hq, d), torch.float32, gen)
        cu_t = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
        out = paged_prefill_attention(q, k, v, cu_t, lens, tables, max(q_lens), 0.25, window=window, sinks=sink,
                                      **scales_kw)  # fmt: skip
    assert out.isfinite().all()
    assert rel_err(out, reference(q, kd, vd, tables, cu, lens, 0.25, window, sink)) < 1e-5


@pytest.mark.parametrize("kind", ["prefill", "decode", "mixed"])
def test_triton_backend_matches_the_torch_backend_on_fp8(kind):
    # K/V that are e4m3 values times a power-of-two scale: both stores are exact, the interpreter's too,
    # so the pools must be equal and the outputs agree to float32 rounding.
    contexts = {"prefill": [(0, 40), (200, 5)], "decode": [(0, 1), (99, 1), (299, 1)], "mixed": [(99, 1), (0, 25)]}
    step = make_step(contexts[kind], 8, 2, 16, 16, seed=3, device=DEVICE)
    k_scale, v_scale = scales(0.5, 0.03125)
    exact = [dequantize_kv(quantize_kv(x, s), s, torch.float32) for x, s in ((step.k, k_scale), (step.v, v_scale))]
    pools = [KVCache(quantize_kv(step.cache.k, k_scale), quantize_kv(step.cache.v, v_scale)) for _ in range(2)]
    pools[1] = KVCache(pools[1].k.clone(), pools[1].v.clone())
    outs = [
        backend.forward(step.q, *exact, pool, step.meta, SCALE, window=16, k_scale=k_scale, v_scale=v_scale)
        for backend, pool in zip((TritonAttention(), TorchAttention()), pools)
    ]
    assert torch.equal(pools[0].k.float(), pools[1].k.float()) and torch.equal(pools[0].v.float(), pools[1].v.float())
    assert rel_err(outs[0], outs[1].double()) < 1e-5


def test_launchers_take_scales_with_an_fp8_pool_only():
    q = torch.randn(2, 4, 16, device=DEVICE)
    cache = torch.zeros(4, 16, 2, 16, device=DEVICE)
    tables = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(2, dtype=torch.int32, device=DEVICE)
    ks, vs = scales(1, 1)
    with pytest.raises(ValueError, match="k_scale and v_scale go with a torch.float8_e4m3fn KV cache, and only"):
        paged_decode_attention(q, cache.to(FP8_KV_DTYPE), cache.to(FP8_KV_DTYPE), tables, lens, 0.25, 16)
    with pytest.raises(ValueError, match="only with one; this cache is torch.float32"):
        paged_prefill_attention(q, cache, cache, lens, lens, tables, 1, 0.25, k_scale=ks, v_scale=vs)
    with pytest.raises(ValueError, match=r"must be \[1\] float32 tensors"):
        store_kv(q[:, :2], q[:, :2], cache.to(FP8_KV_DTYPE), cache.to(FP8_KV_DTYPE), lens.long(),
                 k_scale=ks.double(), v_scale=vs)  # fmt: skip
    with pytest.raises(AssertionError):  # a float16 pool for float32 queries is no FP8 pool
        paged_decode_attention(q, cache.half(), cache.half(), tables, lens, 0.25, 16)


# ---- on a GPU ----------------------------------------------------------------------------------------

gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_fp8_kernels_against_bf16_at_a_real_shape(kernel):
    # Qwen3-8B's attention (32 query heads over 8 KV heads of 128), 256-token blocks, 4k contexts: the FP8
    # pool's output against the bfloat16 pool's (the same K/V before quantization), and against the bfloat16
    # kernel on the FP8 pool's dequantized values (the same numbers: only the reading differs).
    gen = torch.Generator().manual_seed(0)
    seq_lens = [4096, 1000, 3000, 17] * 8
    k, v, tables = paged_pool(seq_lens, 256, 8, 128, torch.bfloat16, gen)
    kq, vq, ks, vs, kd, vd = fp8_pool(k, v, 4.5 / 448, 4.5 / 448)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    if kernel == "decode":
        q = randn((len(seq_lens), 32, 128), torch.bfloat16, gen)

        def run(kc, vc, **s):
            return paged_decode_attention(q, kc, vc, tables, lens, 128**-0.5, 4096, **s)
    else:
        q_lens = [min(n, 512) for n in seq_lens]
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
        q = randn((int(cu[-1]), 32, 128), torch.bfloat16, gen)

        def run(kc, vc, **s):
            return paged_prefill_attention(q, kc, vc, cu, lens, tables, 512, 128**-0.5, **s)

    out = run(kq, vq, k_scale=ks, v_scale=vs)
    assert rel_err(out, run(kd.bfloat16(), vd.bfloat16()).double()) < 1e-2
    assert rel_err(out, run(k, v).double()) < 5e-2  # e4m3's rounding of K and V: ~3% an element


@gpu
def test_fp8_cache_through_cuda_graphs(qwen3_dir, tmp_path):
    # Decode steps replayed from CUDA graphs give the eager engine's ids (float32, the Triton kernels, a
    # checkpoint's scales: tensors the graphs read where they were at capture, not floats baked into them).
    path = with_scales(qwen3_dir, tmp_path / "scaled", {"k_scale": [0.011, 0.009], "v_scale": [0.013, 0.01]})
    prompts = [[5, 6, 7, 8], list(range(3, 300)), [9] * 17]
    outs = []
    for eager in (False, True):
        llm = LLM(
            str(path),
            dtype="float32",
            kv_cache_dtype="fp8",
            attention_backend="triton",
            enforce_eager=eager,
            kvcache_block_size=16,
            num_kvcache_blocks=64,
        )  # fmt: skip (two engines at once)
        assert (llm.engine.runner.graphs is None) == eager and layer_scales(llm)[0] == pytest.approx((0.011, 0.013))
        outs.append([o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)])
    assert outs[0] == outs[1]
