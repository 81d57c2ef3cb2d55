"""Structured outputs, n samples and logit bias on a CUDA GPU (skipped without one): the same tokens as on
the CPU, with CUDA graphs and without, with the sampling kernel, and the free requests beside the
constrained ones unchanged."""

import json

import jsonschema
import pytest

from nanostream import LLM, SamplingParams
from nanostream.structured_outputs import StructuredOutputsParams as SO

pytestmark = pytest.mark.gpu

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
}
PROMPTS = [[5, 6, 7, 8] * k for k in (1, 5, 20)]


def run(llm: LLM) -> list[list[int]]:
    params = [
        SamplingParams(temperature=0, max_tokens=60, structured_outputs=SO(json=PERSON)),
        SamplingParams(temperature=1.0, seed=3, max_tokens=60, structured_outputs=SO(regex=r"[a-z]+( [a-z]+){3}")),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logit_bias={7: 2.5}),
    ]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    jsonschema.validate(json.loads(outs[0].text), PERSON)
    sampled = llm.generate(PROMPTS[1], SamplingParams(temperature=1.0, seed=9, n=3, max_tokens=16), use_tqdm=False)
    return [o.token_ids for o in outs] + [o.token_ids for o in sampled[0].outputs]


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda-graphs"])
def test_constrained_requests_on_cuda_match_the_cpu(qwen3_dir, enforce_eager):
    cpu = run(LLM(str(qwen3_dir), device="cpu", dtype="float32", kvcache_block_size=16))
    cuda = LLM(str(qwen3_dir), device="cuda", dtype="float32", kvcache_block_size=16, enforce_eager=enforce_eager)
    assert run(cuda) == cpu
