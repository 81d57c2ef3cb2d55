"""Bad input gets the documented error, says what to change, and the engine keeps serving."""

import json
import shutil
import subprocess
import sys

import pytest

from nanostream import LLM, EngineConfig, InvalidRequestError, ModelLoadError, SamplingParams
from nanostream.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(str(qwen3_dir), device="cpu", kvcache_block_size=16, max_model_len=128, num_kvcache_blocks=64)


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ([], GREEDY, "prompt is empty"),
        ([1, 2, 10**6], GREEDY, "outside the model's vocabulary"),
        ([1, -3], GREEDY, "outside the model's vocabulary"),
        ([1, True], GREEDY, "id True is outside the model's vocabulary"),
        ([1, 2.0], GREEDY, "id 2.0 is outside the model's vocabulary"),
        ([1, "2"], GREEDY, "id '2' is outside the model's vocabulary"),
        (list(range(3, 131)), GREEDY, "max_model_len is 128"),
        (list(range(3, 103)), SamplingParams(max_tokens=40), r"lower max_tokens to at most 28"),
        ([5, 6], SamplingParams(stop_token_ids=[99999]), "stop token id 99999"),
    ],
)
def test_bad_request_rejected_and_engine_still_serves(llm, prompt, params, match):
    before = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].token_ids
    with pytest.raises(InvalidRequestError, match=match):
        llm.generate([[5, 6, 7], prompt], params, use_tqdm=False)
    assert llm.engine.block_manager.num_free_blocks == 64
    assert not llm.engine.has_unfinished()
    assert llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].token_ids == before


def test_rejection_midway_leaves_running_requests_untouched(qwen3_dir):
    engine = LLMEngine(EngineConfig(str(qwen3_dir), device="cpu", kvcache_block_size=16, max_model_len=256))
    ref = LLMEngine(EngineConfig(str(qwen3_dir), device="cpu", kvcache_block_size=16, max_model_len=256))

    def run(eng, reject_at):
        eng.add_request("a", list(range(10, 50)), GREEDY)
        eng.add_request("b", list(range(60, 70)), GREEDY)
        out = {"a": [], "b": []}
        step = 0
        while eng.has_unfinished():
            if step == reject_at:
                with pytest.raises(InvalidRequestError):
                    eng.add_request("bad", [], GREEDY)
                with pytest.raises(InvalidRequestError, match="already in use"):
                    eng.add_request("a", [1, 2], GREEDY)
            for d in eng.step().deltas:
                out[d.request_id] += d.token_ids
            step += 1
        return out

    assert run(engine, reject_at=2) == run(ref, reject_at=-1)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_too_many_blocks_rejected(qwen3_dir):
    llm = LLM(str(qwen3_dir), device="cpu", kvcache_block_size=16, num_kvcache_blocks=4)
    with pytest.raises(InvalidRequestError, match="needs 5 KV blocks but the cache has only 4"):
        llm.generate([list(range(3, 60))], SamplingParams(max_tokens=20), use_tqdm=False)
    assert len(llm.generate([list(range(3, 40))], GREEDY, use_tqdm=False)[0].token_ids) == 8


def test_max_tokens_none_fills_the_context(qwen3_dir):
    llm = LLM(str(qwen3_dir), device="cpu", kvcache_block_size=16, max_model_len=40)
    out = llm.generate(
        [list(range(3, 33))], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].token_ids) == 10 and out[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_tokens": 0}, "max_tokens must be a positive integer"),
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -2}, "top_k must be"),
        ({"min_p": 2}, "min_p must be"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0"),
        ({"presence_penalty": 3}, "presence_penalty must be in"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop": [""]}, "stop must be"),
        ({"logprobs": 50}, "logprobs must be"),
        ({"seed": 1.5}, "seed must be"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_normalises_stop():
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[3]).stop_token_ids == (3,)


def test_unknown_config_key_is_a_type_error(qwen3_dir):
    with pytest.raises(TypeError, match=r"unknown engine option\(s\) 'max_num_seq'.*valid options are"):
        LLM(str(qwen3_dir), device="cpu", max_num_seq=4)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs must be a positive integer"),
        ({"max_num_batched_tokens": 8, "max_num_seqs": 16}, "must be at least max_num_seqs"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"dtype": "fp8"}, "dtype must be one of"),
        ({"attention_backend": "magic"}, "attention_backend must be one of"),
        ({"kvcache_block_size": -1}, "kvcache_block_size"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be a positive integer"),
        ({"worker_timeout": 0}, "worker_timeout must be a positive number"),
        ({"state_snapshot_interval": 100, "kvcache_block_size": 16}, r"multiple of kvcache_block_size \(16\)"),
        ({"state_snapshot_interval": 0}, "state_snapshot_interval must be a positive integer"),
        ({"max_state_snapshots": -1}, "max_state_snapshots must be a non-negative integer"),
        ({"max_state_snapshots": True}, "max_state_snapshots must be a non-negative integer"),
    ],
)
def test_bad_config_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(model="m", **kwargs)


def test_config_is_frozen_and_resolved_as_a_copy():
    cfg = EngineConfig(model="m")
    with pytest.raises(AttributeError):
        cfg.max_num_seqs = 3
    resolved = cfg.resolve(max_position_embeddings=2048, cuda_available=False)
    assert (resolved.max_model_len, resolved.device, resolved.dtype) == (2048, "cpu", "float32")
    assert cfg.max_model_len is None and cfg.device == "auto"
    with pytest.raises(ValueError, match="max_model_len 1000000 exceeds the model's max_position_embeddings"):
        EngineConfig(model="m", max_model_len=10**6).resolve(max_position_embeddings=2048, cuda_available=False)
    with pytest.raises(ValueError, match="no CUDA GPU"):
        EngineConfig(model="m", device="cuda").resolve(max_position_embeddings=8, cuda_available=False)


def relabelled(model_dir, tmp_path, architecture: str):
    """A copy of ``model_dir`` whose config.json names another architecture."""
    model = tmp_path / architecture
    shutil.copytree(model_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["architectures"] = [architecture]
    (model / "config.json").write_text(json.dumps(cfg))
    return model


def test_unsupported_architecture_names_supported_ones(qwen3_dir, tmp_path):
    model = relabelled(qwen3_dir, tmp_path, "GPT2LMHeadModel")
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel.*Qwen3ForCausalLM.*LlamaForCausalLM.*MistralForCausalLM"):
        LLM(str(model), device="cpu")


def test_qwen3_weights_labelled_llama_are_refused_not_silently_stripped(qwen3_dir, tmp_path):
    # Llama has no QK-norm: loading Qwen3's weights as Llama would drop them and run a different model.
    model = relabelled(qwen3_dir, tmp_path, "LlamaForCausalLM")
    with pytest.raises(ModelLoadError, match="q_norm|k_norm"):
        LLM(str(model), device="cpu")


def test_missing_model_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match="no config.json"):
        LLM(str(tmp_path), device="cpu")


def test_missing_weights_are_named(qwen3_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    model = tmp_path / "partial"
    shutil.copytree(qwen3_dir, model)
    tensors = load_file(model / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model.layers.1.self_attn.qkv_proj.weight"):
        LLM(str(model), device="cpu")


def test_hub_id_without_network_says_to_pass_a_directory(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="pass a local model directory"):
        LLM("nanostream-test/not-a-real-model")


def write_config(path, config, architectures: list[str]):
    """A model directory holding only ``config`` (saved as transformers does) under ``architectures``."""
    config.architectures = architectures
    config.save_pretrained(path)
    return path


def test_a_published_multimodal_model_nanostream_does_not_run_is_refused_by_name_not_with_a_traceback(tmp_path):
    # As LLaVA is published: the language model's settings under text_config, no max_position_embeddings at the top
    # (the Qwen vision-language checkpoints, alike, run: tests/test_image_engine.py).
    from transformers import LlavaConfig

    model = write_config(tmp_path, LlavaConfig(), ["LlavaForConditionalGeneration"])
    with pytest.raises(ModelLoadError, match=r"unsupported architecture \['LlavaForConditionalGeneration'\].*"
                       r"nanostream runs Qwen3ForCausalLM, .*Gemma3ForCausalLM"):  # fmt: skip
        LLM(str(model), device="cpu")
    done = subprocess.run(
        [sys.executable, "-m", "nanostream", "generate", "--model", str(model), "--device", "cpu", "hi"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2  # the CLI's exit for an error whose message says what to change
    assert "LlavaForConditionalGeneration" in done.stderr and "Traceback" not in done.stderr


def test_a_config_that_lacks_a_field_the_architecture_needs_names_both(tmp_path):
    # A composite config (model_type qwen3_5: its fields under text_config) labelled as a decoder nanostream runs.
    from transformers import Qwen3_5Config

    model = write_config(tmp_path, Qwen3_5Config(), ["Qwen3ForCausalLM"])
    with pytest.raises(ModelLoadError, match=r"Qwen3ForCausalLM's config.json \(Qwen3_5Config\) has no "
                       r"max_position_embeddings"):  # fmt: skip
        LLM(str(model), device="cpu")


def test_every_field_the_config_reader_reads_is_named_when_missing():
    # Whatever field decoder_spec reads first and finds missing, the error names the architecture and it.
    from types import SimpleNamespace

    from nanostream.models import decoder_spec
    from nanostream.testing import tiny_config

    full = tiny_config("Qwen3ForCausalLM").to_dict()
    for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "rms_norm_eps",
                "intermediate_size", "max_position_embeddings"):  # fmt: skip
        partial = SimpleNamespace(**{k: v for k, v in full.items() if k != key})
        with pytest.raises(ModelLoadError, match=rf"Qwen3ForCausalLM's config.json \(SimpleNamespace\) has no {key}"):
            decoder_spec(partial, max_model_len=64)


def test_a_checkpoint_without_weights_is_refused_before_its_model_takes_memory(tmp_path):
    # Qwen3-VL's default shape (an 8B language model: 32 GB in float32) with config.json alone: the refusal comes
    # before the model is built, so the process never holds the model.
    import resource

    from transformers import Qwen3VLConfig

    model = write_config(tmp_path, Qwen3VLConfig(), ["Qwen3VLForConditionalGeneration"])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors files .*--load-format dummy"):
        LLM(str(model), device="cpu")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 2 * 2**20  # KiB: under 2 GiB more
