"""``/v1/embeddings`` on a tiny random embedding checkpoint (a Qwen3 model with sentence-transformers
files: last-token pooling, normalised, Matryoshka dimensions), over real HTTP with the official ``openai``
client and a real engine process: vectors equal transformers' (the last prompt token's final hidden
state, normalised) within float32 rounding, single and batched alike, beside generating requests;
``dimensions`` where the model allows it, base64, and the refusals (a generation model, a pooling
nanostream does not run, a request for embeddings from a generation engine)."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from helpers import API_KEY, engine_processes, run_in_thread, serve_http

from nanostream import AsyncClient, SamplingParams
from nanostream.errors import InvalidRequestError
from nanostream.frontends.openai_server import create_app
from nanostream.models.pooling import read_pooling
from nanostream.testing import make_tiny_model

pytestmark = pytest.mark.slow

TEXTS = ["The cat sat on the mat.", "Embeddings put texts in a space", "x"]
MATRYOSHKA = [16, 32, 64]


def sentence_transformers_files(path: Path, pooling: str = "pooling_mode_lasttoken", normalize: bool = True) -> Path:
    """The files that make a checkpoint an embedding model for sentence-transformers (and nanostream)."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, pooling: True}))
    return path


@pytest.fixture(scope="module")
def embed_dir(tmp_path_factory) -> Path:
    path = make_tiny_model(tmp_path_factory.mktemp("qwen3-embed"), architecture="Qwen3ForCausalLM", seed=3)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": MATRYOSHKA}))
    return sentence_transformers_files(path)


@pytest.fixture(scope="module")
def engines(embed_dir, qwen3_dir) -> Iterator[dict]:
    options = dict(kvcache_block_size=16, device="cpu")
    with (
        engine_processes(str(embed_dir), {"embed": options}) as embed,
        engine_processes(str(qwen3_dir), {"generate": options}) as generate,
    ):
        yield {"embed": embed["embed"].address, "generate": generate["generate"].address}


@pytest.fixture(scope="module")
def url(engines) -> Iterator[str]:
    base, stop = serve_http(create_app(engines["embed"], api_key=API_KEY))
    yield base
    stop()


@pytest.fixture(scope="module")
def embed_model(embed_dir) -> str:
    return embed_dir.name


@pytest.fixture(scope="module")
def reference(embed_dir):
    """transformers' vectors: the base model's last hidden state (after its final norm) at the last token."""
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(embed_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(embed_dir)

    def embed(text: str | list[int]) -> np.ndarray:
        ids = text if isinstance(text, list) else tokenizer(text).input_ids
        with torch.no_grad():
            hidden = model(torch.tensor([ids])).last_hidden_state[0, -1]
        return torch.nn.functional.normalize(hidden, dim=-1).numpy()

    return embed


def test_vectors_equal_transformers_single_and_batched(api, embed_model, reference):
    batched = api.embeddings.create(model=embed_model, input=TEXTS)
    assert [d.index for d in batched.data] == [0, 1, 2]
    for text, item in zip(TEXTS, batched.data):
        np.testing.assert_allclose(item.embedding, reference(text), atol=2e-5)
        single = api.embeddings.create(model=embed_model, input=text, encoding_format="float")
        np.testing.assert_allclose(single.data[0].embedding, item.embedding, atol=2e-6)
    assert batched.usage.prompt_tokens == batched.usage.total_tokens > 0
    ids = api.embeddings.create(model=embed_model, input=[[5, 6, 7], [8, 9]]).data
    np.testing.assert_allclose(ids[1].embedding, reference([8, 9]), atol=2e-5)


def test_base64_and_dimensions(http, embed_model, reference):
    body = {"model": embed_model, "input": TEXTS[0], "encoding_format": "base64", "dimensions": 32}
    got = http.post("/v1/embeddings", json=body).json()["data"][0]["embedding"]
    vector = np.frombuffer(base64.b64decode(got), dtype="<f4")
    cut = reference(TEXTS[0])[:32]
    np.testing.assert_allclose(vector, cut / np.linalg.norm(cut), atol=2e-5)
    r = http.post("/v1/embeddings", json={**body, "dimensions": 20})
    assert r.status_code == 400 and "dimensions must be one of [16, 32, 64]" in r.json()["error"]["message"], r.text


def test_embeddings_beside_a_generating_request(api, http, embed_model, reference):
    """The engine batches an embedding's prompt in the steps of a request that is decoding."""
    body = {"model": embed_model, "prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True, "stream": True}
    started = threading.Event()

    def generate() -> None:
        with http.stream("POST", "/v1/completions", json=body) as r:
            for _ in r.iter_lines():
                started.set()

    thread = threading.Thread(target=generate)
    thread.start()
    started.wait(60)
    got = api.embeddings.create(model=embed_model, input=TEXTS[1], encoding_format="float").data[0].embedding
    thread.join(120)
    np.testing.assert_allclose(got, reference(TEXTS[1]), atol=2e-5)


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"input": []}, "input must be"),
        ({"input": [""]}, "input must be"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
        ({"input": "x", "pooling": "mean"}, "pooling"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(http, embed_model, body, fragment):
    r = http.post("/v1/embeddings", json={"model": embed_model, **body})
    assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text


def test_a_generation_model_answers_400_and_its_engine_refuses_embed(engines, qwen3_dir):
    base, stop = serve_http(create_app(engines["generate"], api_key=API_KEY))
    try:
        api = openai.OpenAI(base_url=base + "/v1", api_key=API_KEY, max_retries=0)
        with pytest.raises(openai.BadRequestError, match="--runner pooling"):
            api.embeddings.create(model=qwen3_dir.name, input="hi")
    finally:
        stop()

    async def hostile() -> None:  # a client that asks anyway: the engine refuses, and serves on
        async with AsyncClient(engines["generate"]) as client:
            with pytest.raises(InvalidRequestError, match="runner pooling"):
                async for _ in client.stream([5, 6], SamplingParams(max_tokens=1, embed=True)):
                    pass
            assert (await client.generate([5, 6], max_tokens=2)).outputs[0].token_ids

    run_in_thread(hostile)


def test_pooling_nanostream_does_not_run_is_refused_at_load(tmp_path, qwen3_dir):
    for name in ("config.json",):
        (tmp_path / name).write_text((qwen3_dir / name).read_text())
    mean = sentence_transformers_files(tmp_path, "pooling_mode_mean_tokens")
    with pytest.raises(ValueError, match="pooling_mode_mean_tokens.*last token only"):
        read_pooling(mean, "auto")
    assert read_pooling(qwen3_dir, "auto") is None  # a generation model
    plain = read_pooling(qwen3_dir, "pooling")  # no sentence-transformers files: Qwen3-Embedding's way
    assert (plain.mode, plain.normalize, plain.matryoshka) == ("last", True, None)
    (tmp_path / "modules.json").write_text(json.dumps([{"type": "sentence_transformers.models.Dense", "path": "2"}]))
    with pytest.raises(ValueError, match="Dense"):
        read_pooling(tmp_path, "pooling")


def test_a_prompt_from_the_prefix_cache_embeds_the_same(api, engines, embed_model, reference):
    long_text = " ".join(TEXTS * 4)  # several full KV blocks of 16 tokens

    async def hits() -> int:
        async with AsyncClient(engines["embed"]) as client:
            return (await client.stats()).engine.prefix_cache_hits

    before = run_in_thread(hits)
    first, again = (api.embeddings.create(model=embed_model, input=long_text).data[0].embedding for _ in range(2))
    assert run_in_thread(hits) >= before + 16  # the second found the first's blocks
    np.testing.assert_allclose(again, first, atol=2e-6)
    np.testing.assert_allclose(again, reference(long_text), atol=2e-5)


def test_the_offline_llm_embeds_as_the_server_does(api, embed_dir, embed_model, qwen3_dir, reference):
    from nanostream import LLM

    with LLM(str(embed_dir), kvcache_block_size=16, device="cpu") as llm:
        vectors = llm.embed(TEXTS)
        cut = llm.embed(TEXTS[0], dimensions=16)[0]
    served = api.embeddings.create(model=embed_model, input=TEXTS, encoding_format="float").data
    for text, vector, item in zip(TEXTS, vectors, served):
        np.testing.assert_allclose(vector, reference(text), atol=2e-5)
        np.testing.assert_allclose(vector, item.embedding, atol=2e-6)
    np.testing.assert_allclose(cut, reference(TEXTS[0])[:16] / np.linalg.norm(reference(TEXTS[0])[:16]), atol=2e-5)
    generation = LLM(str(qwen3_dir), kvcache_block_size=16, device="cpu")
    with generation, pytest.raises(InvalidRequestError, match="runner pooling"):
        generation.embed("hi")
