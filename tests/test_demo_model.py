"""The embedded demo model: shipped in the package, loads in nanostream and transformers, and is what
``generate``, ``serve`` and ``demo`` run when no model is given."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import run_in_thread
from transformers import AutoModelForCausalLM, AutoTokenizer

from nanostream import LLM, AsyncClient, SamplingParams
from nanostream.client.launch import EngineProcess
from nanostream.demo_model import DEMO_MODEL_DIR, default_model_dir

pytestmark = pytest.mark.slow  # engine processes, servers or browsers: not in the fast lane

# Its greedy continuation. The prompt was picked because no greedy step of it is near a tie (the
# smallest gap between the top two float32 logits over these 24 tokens is 0.19), so the text does not
# depend on the CPU's rounding.
FIXED_PROMPT = "The LORD is my shepherd"
FIXED_CONTINUATION = ", and he is my people.\nThe LORD hath spoken by me, and will not hear me, neither will I"
GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def llm():
    return LLM(str(default_model_dir()), dtype="float32", device="cpu")


def test_the_package_ships_a_small_bfloat16_qwen3():
    assert default_model_dir() == DEMO_MODEL_DIR
    config = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["dtype"] == "bfloat16"
    assert (DEMO_MODEL_DIR / "model.safetensors").stat().st_size <= 25 * 10**6
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    assert 4000 <= len(tokenizer) <= 8000
    hi = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert hi == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    log = json.loads((DEMO_MODEL_DIR / "training_log.json").read_text())
    assert log["final_val_loss"] < 4.0 and log["num_params"] < 12.5e6


def test_greedy_output_equals_transformers(llm):
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    hf = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # both run the full 32 tokens

    def chat(text: str) -> str:
        messages = [{"role": "user", "content": text}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    prompts = ["In the beginning", "Blessed are the", chat("Tell me a fortune."), chat("Read me Psalms chapter 23.")]
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    for prompt_ids, out in zip(ids, outs):
        x = torch.tensor([prompt_ids])
        with torch.no_grad():
            ref = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=32)
        assert out.token_ids == ref[0, len(prompt_ids) :].tolist(), tokenizer.decode(prompt_ids)


def test_a_fixed_prompt_gives_a_fixed_english_continuation(llm):
    (out,) = llm.generate([FIXED_PROMPT], GREEDY, use_tqdm=False)
    assert out.text == FIXED_CONTINUATION


def test_generate_without_a_model_runs_the_demo_model():
    options = ["--temperature", "0", "--max-tokens", "24", "--quiet", "--device", "cpu", "--dtype", "float32"]
    out = subprocess.run(
        [sys.executable, "-m", "nanostream", "generate", FIXED_PROMPT, *options],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert out.returncode == 0, out.stderr
    assert FIXED_CONTINUATION in out.stdout


def test_serve_without_a_model_serves_the_demo_model():
    async def main(address: str) -> str:
        async with AsyncClient(address) as client:
            assert client.model == str(DEMO_MODEL_DIR)
            return await client.generate(FIXED_PROMPT, temperature=0, max_tokens=24)

    with EngineProcess(None, device="cpu", dtype="float32") as engine:
        reply = run_in_thread(main, engine.address)
    assert reply.text == FIXED_CONTINUATION
