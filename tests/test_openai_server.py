"""The OpenAI-compatible server over real HTTP (uvicorn on a free port), a real engine process and the
official ``openai`` package as the client; no mocks.

What a user of the API relies on: the text equals the offline engine's (streamed or not), usage
counts are right, stop strings and max_tokens end a reply as OpenAI says, a seed reproduces a
sampled reply, logprobs have OpenAI's shapes and the engine's values, every bad request is a 4xx
with OpenAI's error JSON that says what to change, a dead engine is a 503, a client that hangs up
frees its request in the engine at once, and /health and /metrics tell the truth.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import anyio
import httpx
import pytest
from helpers import API_KEY, engine_processes, serve_http, wait_engine_idle
from prometheus_client.parser import text_string_to_metric_families

from nanostream import LLM, AsyncClient, SamplingParams
from nanostream.client.launch import EngineProcess
from nanostream.frontends.engine_wait import EngineWait
from nanostream.frontends.openai_server import OpenAIServer, create_app

pytestmark = pytest.mark.slow  # engine processes, servers or browsers: not in the fast lane

ENGINE_OPTIONS = dict(kvcache_block_size=16, device="cpu")
LONG = {"max_tokens": 2000, "temperature": 0, "ignore_eos": True}  # runs for seconds unless aborted
ABORT_WITHIN = 3.0  # seconds for a hung-up request to leave the engine
CONVERSATION = [
    {"role": "system", "content": "You keep a lighthouse."},
    {"role": "user", "content": "Write to\nthe sea"},
]
# The same conversation in OpenAI's list-of-parts form (text parts are joined with a newline).
PARTS = [
    CONVERSATION[0],
    {"role": "user", "content": [{"type": "text", "text": "Write to"}, {"type": "text", "text": "the sea"}]},
]


@pytest.fixture(scope="module")
def engines(qwen3_dir) -> Iterator[dict[str, EngineProcess]]:
    """Engine processes: "main" serves the module, "doomed" is killed by one test."""
    with engine_processes(str(qwen3_dir), {"main": ENGINE_OPTIONS, "doomed": ENGINE_OPTIONS}) as started:
        yield started


@pytest.fixture(scope="module")
def llm(qwen3_dir) -> LLM:
    return LLM(str(qwen3_dir), **ENGINE_OPTIONS)


@pytest.fixture(scope="module")
def url(engines) -> Iterator[str]:
    base, stop = serve_http(create_app(engines["main"].address, api_key=API_KEY))
    yield base
    stop()


def events(response: httpx.Response) -> Iterator[dict | str]:
    """The SSE ``data:`` payloads of a streaming response, decoded ("[DONE]" stays a string)."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            yield data if data == "[DONE]" else json.loads(data)


def assert_error(response: httpx.Response, status: int, param: str | None = None, *fragments: str) -> dict:
    """OpenAI's error JSON with this status, naming ``param``, with a message that contains ``fragments``."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    for fragment in fragments:
        assert fragment in error["message"], error
    return error


# ---- 1. the same text as the offline engine ------------------------------------------------------


def test_models_lists_the_served_model(api, model):
    assert [m.id for m in api.models.list().data] == [model]
    assert api.models.retrieve(model).id == model


def test_completions_match_offline_greedy(api, llm, model):
    # Long enough that the stream cannot arrive as one chunk on a busy CPU: a consumer that falls behind
    # gets the tokens generated meanwhile merged into its next chunk.
    prompt, n = "Once upon a time", 96
    ref = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)[0]
    args = dict(model=model, prompt=prompt, max_tokens=n, temperature=0, extra_body={"ignore_eos": True})

    whole = api.completions.create(**args)
    assert (whole.object, whole.choices[0].text, whole.choices[0].finish_reason) == (
        "text_completion",
        ref.text,
        "length",
    )
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ref.prompt_token_ids), n)
    assert whole.usage.total_tokens == len(ref.prompt_token_ids) + n

    chunks = list(api.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    *text_chunks, usage_chunk = chunks
    assert len(text_chunks) > 1, "tokens arrive as they are generated"
    assert "".join(c.choices[0].text for c in text_chunks) == ref.text
    assert [c.choices[0].finish_reason for c in text_chunks] == [None] * (len(text_chunks) - 1) + ["length"]
    assert usage_chunk.choices == []
    assert (usage_chunk.usage.prompt_tokens, usage_chunk.usage.completion_tokens) == (len(ref.prompt_token_ids), n)
    assert all(c.id == chunks[0].id for c in chunks)

    by_ids = api.completions.create(**{**args, "prompt": ref.prompt_token_ids})  # token ids as the prompt
    assert by_ids.choices[0].text == ref.text


def test_chat_matches_offline_greedy(api, llm, model):
    ref = llm.chat(CONVERSATION, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    args = dict(model=model, max_completion_tokens=16, temperature=0)

    whole = api.chat.completions.create(messages=CONVERSATION, **args)
    choice = whole.choices[0]
    assert (whole.object, choice.message.role, choice.message.content) == ("chat.completion", "assistant", ref.text)
    assert choice.finish_reason == ref.finish_reason
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ref.prompt_token_ids), len(ref.token_ids))

    stream = api.chat.completions.create(messages=PARTS, stream=True, stream_options={"include_usage": True}, **args)
    *chunks, usage_chunk = list(stream)
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert [c.choices[0].finish_reason for c in chunks][-2:] == [None, ref.finish_reason]
    assert usage_chunk.choices == []
    assert usage_chunk.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert usage_chunk.usage.completion_tokens == len(ref.token_ids)


def test_stop_string_and_max_tokens(api, llm, model):
    ref = llm.generate("The river", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    stop = ref.text[5:8]
    expected = ref.text[: ref.text.index(stop)]
    args = dict(model=model, prompt="The river", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})

    whole = api.completions.create(stop=[stop, "never appears"], **args).choices[0]
    assert (whole.text, whole.finish_reason) == (expected, "stop")
    streamed = list(api.completions.create(stop=stop, stream=True, **args))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"

    with_logprobs = api.completions.create(stop=stop, logprobs=1, **args)
    assert with_logprobs.choices[0].text == expected
    assert len(with_logprobs.choices[0].logprobs.tokens) == with_logprobs.usage.completion_tokens

    short = api.completions.create(**{**args, "max_tokens": 3})
    assert (short.choices[0].finish_reason, short.usage.completion_tokens) == ("length", 3)


def test_text_with_unicode_line_separators_streams_as_whole_events(http, model):
    # U+2028, U+2029 and NEL may stand raw in JSON, but str.splitlines() (httpx's iter_lines) breaks a
    # line at each: they go out escaped, so every line of the stream is a whole event. A grammar forces
    # the text, separators and all.
    text = "a\u2028b\u2029c\x85d"
    body = {"model": model, "prompt": "x", "max_tokens": 20, "stream": True, "structured_outputs": {"choice": [text]}}
    with http.stream("POST", "/v1/completions", json=body) as response:
        payloads = list(events(response))
    assert payloads[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in payloads[:-1] if e["choices"]) == text


def test_concurrent_streams_do_not_mix(api, llm, model):
    prompts = ["Once upon a time", "The river ran", "Seven small boats 🚀 東京", "A stream can end"]
    refs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)

    def streamed(prompt: str) -> str:
        chunks = api.completions.create(
            model=model, prompt=prompt, max_tokens=20, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        return "".join(c.choices[0].text for c in chunks)

    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(streamed, prompts)) == [ref.text for ref in refs]


def test_seed_reproduces_a_sampled_reply(api, model):
    args = dict(model=model, messages=CONVERSATION, max_tokens=24, temperature=1.0, extra_body={"ignore_eos": True})
    first, again = (api.chat.completions.create(seed=1234, **args).choices[0].message.content for _ in range(2))
    streamed = api.chat.completions.create(seed=1234, stream=True, **args)
    assert first == again == "".join(c.choices[0].delta.content or "" for c in streamed)


def test_logprobs(api, llm, model):
    ref = llm.chat(CONVERSATION, SamplingParams(temperature=0, max_tokens=8, logprobs=3), use_tqdm=False)[0]
    chat = api.chat.completions.create(
        model=model, messages=CONVERSATION, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    ).choices[0]
    content = chat.logprobs.content
    assert len(content) == len(ref.token_ids)
    for entry, token_id, lps in zip(content, ref.token_ids, ref.logprobs):
        assert entry.logprob == pytest.approx(lps[token_id], abs=1e-4)
        assert len(entry.top_logprobs) == 3
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert entry.top_logprobs[0].token == entry.token, "greedy picks the most likely token"
    # bytes are each token's own bytes: together they are the reply, even where a token splits a character
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace") == chat.message.content

    streamed = api.chat.completions.create(
        model=model, messages=CONVERSATION, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3, stream=True
    )
    streamed_content = [
        e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert [e.model_dump() for e in streamed_content] == [e.model_dump() for e in content]

    text = api.completions.create(model=model, prompt="Once upon", max_tokens=6, temperature=0, logprobs=2).choices[0]
    lp = text.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs), "the top 2 and the sampled token"
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(text.text)
    without = api.completions.create(model=model, prompt="Once upon", max_tokens=6, temperature=0)
    assert without.choices[0].logprobs is None


# ---- 2. errors ------------------------------------------------------------------------------------

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
BAD_REQUESTS = {
    "bad JSON": ("/v1/chat/completions", b'{"messages": [', 400, None, "not valid JSON"),
    "not an object": ("/v1/chat/completions", [1, 2], 400, None, "JSON object"),
    "no messages": ("/v1/chat/completions", {"max_tokens": 4}, 400, "messages", "Field required"),
    "no prompt": ("/v1/completions", {"max_tokens": 4}, 400, "prompt", "Field required"),
    "mixed prompts": ("/v1/completions", {"prompt": ["a", [1, 2], 3]}, 400, "prompt", "list of several"),
    "negative temperature": ("/v1/chat/completions", {**CHAT, "temperature": -1}, 400, "temperature", ">= 0"),
    "top_p 0": ("/v1/completions", {"prompt": "a", "top_p": 0}, 400, "top_p", "(0, 1]"),
    "NaN temperature": ("/v1/completions", b'{"prompt": "a", "temperature": NaN}', 400, "temperature", "finite"),
    "huge seed": ("/v1/completions", {"prompt": "a", "seed": 2**70}, 400, "seed", "less than"),
    "string max_tokens": ("/v1/completions", {"prompt": "a", "max_tokens": "many"}, 400, "max_tokens", "integer"),
    "too long": ("/v1/chat/completions", {**CHAT, "max_tokens": 10**6}, 400, None, "lower max_tokens"),
    "bad token id": ("/v1/completions", {"prompt": [1, 10**7]}, 400, None, "vocabulary"),
    "empty prompt": ("/v1/completions", {"prompt": ""}, 400, None, "prompt is empty"),
    "n=0": ("/v1/chat/completions", {**CHAT, "n": 0}, 400, "n", "n must be an integer in [1, 128]"),
    "best_of": ("/v1/completions", {"prompt": "a", "best_of": 3}, 400, "best_of", "best_of must be 1"),
    "image part": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages",
        "takes no images",
    ),
    "top_logprobs alone": ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs", "logprobs"),
    "unknown model": ("/v1/chat/completions", {**CHAT, "model": "gpt-4o"}, 404, "model", "GET /v1/models"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_an_openai_error(http, case):
    path, body, status, param, fragment = BAD_REQUESTS[case]
    for stream in (False, True):  # streaming requests fail before the stream starts: a plain HTTP error
        if isinstance(body, bytes):
            sent = {"content": body, "headers": {"Content-Type": "application/json"}}
        else:
            sent = {"json": {**body, "stream": stream} if isinstance(body, dict) else body}
        error = assert_error(http.post(path, **sent), status, param, fragment)
        assert error["type"] == "invalid_request_error"
    if case == "unknown model":
        assert error["code"] == "model_not_found"


def test_unknown_fields_are_ignored(http, model):
    fields = {"user": "u1", "metadata": {"a": "b"}, "store": False, "logit_bias": {}, "x": 1}
    response = http.post("/v1/chat/completions", json={**CHAT, "model": model, **fields})
    assert response.status_code == 200, response.text


def test_api_key(url, http):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        error = assert_error(httpx.post(url + "/v1/chat/completions", json=CHAT, headers=headers), 401, None, "API key")
        assert error["code"] == "invalid_api_key"
    assert_error(httpx.get(url + "/v1/models"), 401, None, "Authorization: Bearer")
    assert httpx.get(url + "/health").status_code == 200, "health needs no key"
    assert http.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_engine_down_is_503_until_it_comes_back(engines, qwen3_dir):
    """An open stream ends with an SSE error event; then every request is a 503, and /health says so;
    an engine started again at the same address is found without restarting the frontend."""
    engine = engines["doomed"]
    base, stop = serve_http(create_app(lambda: AsyncClient(engine.address, timeout=1.0)))
    try:
        with httpx.Client(base_url=base, timeout=30) as http:
            assert http.get("/health").json()["status"] == "ok"
            with http.stream("POST", "/v1/completions", json={"prompt": "Once", "stream": True, **LONG}) as response:
                received = events(response)
                next(received), next(received)
                os.kill(engine.pid, signal.SIGKILL)
                *_, error, done = received
            assert done == "[DONE]"
            assert error["error"]["type"] == "service_unavailable"
            for response in (http.get("/health"), http.post("/v1/completions", json={"prompt": "Once"})):
                error = assert_error(response, 503, None, "engine")
                assert error["type"] == "service_unavailable"
            assert "nanostream_engine_up 0.0" in http.get("/metrics").text

            # The killed engine left its socket file; a new one replaces it and the frontend reconnects.
            with EngineProcess(str(qwen3_dir), address=engine.address, **ENGINE_OPTIONS):
                deadline = time.monotonic() + 10
                while http.get("/health").status_code != 200:
                    assert time.monotonic() < deadline, "the frontend did not reconnect"
                    time.sleep(0.05)
                reply = http.post("/v1/completions", json={"prompt": "Once", "max_tokens": 4})
                assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
    finally:
        stop()


def test_frontend_without_an_engine_address_says_what_to_give(monkeypatch, capsys):
    monkeypatch.delenv("NANOSTREAM_ADDRESS", raising=False)
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine")
    OpenAIServer.add_arguments(parser)
    assert OpenAIServer().run(parser.parse_args(["--port", "0", "--engine-wait", "0"])) == 2  # at once
    assert "NANOSTREAM_ADDRESS" in capsys.readouterr().err
    # Waiting (the default), it serves meanwhile and says the same when no local engine came.
    assert OpenAIServer().run(parser.parse_args(["--port", "0", "--engine-wait", "1"])) == 1
    err = capsys.readouterr().err
    assert "waiting up to 1 s for a local engine (`nanostream serve`)" in err
    assert "no local engine is running" in err and "NANOSTREAM_ADDRESS" in err.splitlines()[-1]


def test_a_wait_whose_deadline_passes_mid_poll_still_says_what_to_give(monkeypatch):
    # The deadline may pass between the wait's check and its pause (a slow write to stderr, a busy machine):
    # the wait must end with its own message, not with a sleep of negative length.
    monkeypatch.delenv("NANOSTREAM_ADDRESS", raising=False)
    for wait in (EngineWait(None, 0.05, "test"), EngineWait("tcp://127.0.0.1:9", 0.05, "test")):
        monkeypatch.setattr(wait, "_say", lambda what: time.sleep(0.1))
        if wait.engine is None:
            with pytest.raises(ValueError, match="no local engine is running"):
                anyio.run(wait.find)
        else:
            assert anyio.run(wait.until_reachable, wait.engine) is False


# ---- 3. a client that hangs up ---------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
def test_hanging_up_aborts_the_request(url, engines, stream):
    address = engines["main"].address
    wait_engine_idle(address, ABORT_WITHIN)
    body = {"messages": CONVERSATION, "stream": stream, **LONG}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    if stream:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=30) as response:
            received = events(response)
            assert next(received)["choices"][0]["delta"]["role"] == "assistant"
            assert next(received)["choices"][0]["finish_reason"] is None
    else:
        with pytest.raises(httpx.ReadTimeout):  # hangs up after half a second
            httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=0.5)
    hung_up = time.monotonic()
    wait_engine_idle(address, ABORT_WITHIN)
    assert time.monotonic() - hung_up < ABORT_WITHIN
    assert 'nanostream_requests_total{endpoint="chat",finish_reason="abort"}' in httpx.get(url + "/metrics").text


# ---- 4. health and metrics ------------------------------------------------------------------------


def metric_samples(url: str) -> dict[tuple, float]:
    """Every sample /metrics shows, by (name, sorted labels)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(httpx.get(url + "/metrics").text)
        for s in family.samples
    }


def test_health_and_metrics(url, api, model):
    health = httpx.get(url + "/health")
    assert health.status_code == 200
    assert health.json()["status"] == "ok" and health.json()["running"] == 0

    before = metric_samples(url)
    chat = api.chat.completions.create(
        model=model, messages=CONVERSATION, max_tokens=5, extra_body={"ignore_eos": True}
    )
    text = api.completions.create(model=model, prompt="Once", max_tokens=5, extra_body={"ignore_eos": True})
    after = metric_samples(url)

    def grew(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert grew("nanostream_requests_total", endpoint="chat", finish_reason="length") == 1
    assert grew("nanostream_requests_total", endpoint="completions", finish_reason="length") == 1
    assert grew("nanostream_prompt_tokens_total") == chat.usage.prompt_tokens + text.usage.prompt_tokens
    assert grew("nanostream_generation_tokens_total") == 10
    assert grew("nanostream_time_to_first_token_seconds_count") == 2
    assert grew("nanostream_time_to_first_token_seconds_sum") > 0
    # one sample per token after a request's first chunk (none if a short request's tokens came as one chunk)
    assert 0 <= grew("nanostream_inter_token_latency_seconds_count") <= 8
    # gauges from the engine's own counters, read at the scrape: nothing runs now
    assert after[("nanostream_requests_running", ())] == after[("nanostream_requests_waiting", ())] == 0
    assert after[("nanostream_kv_cache_usage", ())] == 0
    assert after[("nanostream_engine_up", ())] == 1
    # the engine's step and cache counters: two requests of 5 tokens each ran
    steps = sum(grew("nanostream_engine_steps", kind=k) for k in ("prefill", "decode", "mixed"))
    assert 5 <= steps <= 10 and grew("nanostream_engine_step_seconds") > 0
    assert grew("nanostream_prefix_cache_queries") == chat.usage.prompt_tokens + text.usage.prompt_tokens
    hits = chat.usage.prompt_tokens_details.cached_tokens + text.usage.prompt_tokens_details.cached_tokens
    assert grew("nanostream_prefix_cache_hits") == hits
    # the engine's part of those two requests' time to first token: in its queue, then their prefill
    assert grew("nanostream_engine_first_tokens") == 2
    assert grew("nanostream_engine_queue_seconds") >= 0 and grew("nanostream_engine_prefill_seconds") > 0
    assert grew("nanostream_engine_prefill_seconds") < grew("nanostream_time_to_first_token_seconds_sum")
    assert 0 < after[("nanostream_engine_step_seconds_quantile", (("quantile", "0.5"),))] < 10
    assert after[("nanostream_engine_mean_batch_size", ())] >= 1
    # A request long enough to arrive in several chunks, however busy the machine: latencies between them.
    long = api.completions.create(
        model=model, prompt="Once", max_tokens=300, stream=True, extra_body={"ignore_eos": True}
    )
    assert sum(1 for _ in long) > 1
    assert (
        metric_samples(url)[("nanostream_inter_token_latency_seconds_count", ())]
        > after[("nanostream_inter_token_latency_seconds_count", ())]
    )
