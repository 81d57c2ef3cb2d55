"""A Gradio app, the OpenAI-compatible server and a plain script stream from one engine at the same
time, each from a process or server of its own, and each gets exactly the offline greedy output."""

import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anyio
import openai
import pytest
from gradio_client import Client
from helpers import serve_http

from nanostream import LLM, AsyncClient, SamplingParams
from nanostream.client.launch import EngineProcess
from nanostream.frontends.gradio_chat import DEFAULT_SYSTEM_PROMPT, build_app
from nanostream.frontends.openai_server import create_app

pytestmark = pytest.mark.slow  # engine processes, servers or browsers: not in the fast lane

ENGINE_OPTIONS = dict(kvcache_block_size=16, device="cpu")
MAX_TOKENS = 300  # long enough that the three streams overlap


SCRIPT = textwrap.dedent(
    """
    import sys, anyio
    from nanostream import AsyncClient

    async def main():
        async with AsyncClient(sys.argv[1]) as client:
            async for chunk in client.stream(sys.argv[2], max_tokens=int(sys.argv[3]), temperature=0, ignore_eos=True):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()

    anyio.run(main)
    """
)


def test_gradio_http_and_a_script_stream_from_one_engine_at_once(qwen3_dir, tmp_path):
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm = LLM(str(qwen3_dir), **ENGINE_OPTIONS)
    chat_messages = [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": "Hi there"}]
    expected = {
        "gradio": llm.chat(chat_messages, greedy, use_tqdm=False)[0].text,
        "http": llm.generate(["The old mill"], greedy, use_tqdm=False)[0].text,
        "script": llm.generate(["A quiet harbour"], greedy, use_tqdm=False)[0].text,
    }
    del llm
    script = Path(tmp_path) / "stream.py"
    script.write_text(SCRIPT)
    with EngineProcess(str(qwen3_dir), **ENGINE_OPTIONS) as engine:
        gradio_app = build_app(engine.address, sampling=greedy)
        _, gradio_url, _ = gradio_app.launch(server_name="127.0.0.1", prevent_thread_lock=True, quiet=True)
        http_url, stop_http = serve_http(create_app(engine.address))
        try:
            gradio = Client(gradio_url, verbose=False)
            api = openai.OpenAI(base_url=f"{http_url}/v1", api_key="unused")
            model = api.models.list().data[0].id

            def via_gradio() -> str:
                message = {"text": "Hi there", "files": []}  # the chat's multimodal box (images may go in files)
                reply = gradio.predict(message, DEFAULT_SYSTEM_PROMPT, 0.0, 1.0, MAX_TOKENS, api_name="/chat")
                return reply if isinstance(reply, str) else reply[-1]["content"]

            def via_http() -> str:
                stream = api.completions.create(
                    model=model, prompt="The old mill", max_tokens=MAX_TOKENS, temperature=0, stream=True,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                return "".join(chunk.choices[0].text for chunk in stream if chunk.choices)

            # The script streams first; once its first text arrives, the other two start.
            proc = subprocess.Popen(
                [sys.executable, str(script), engine.address, "A quiet harbour", str(MAX_TOKENS)],
                stdout=subprocess.PIPE, text=True, encoding="utf-8", errors="replace",
            )  # fmt: skip
            first = proc.stdout.read(1)
            with ThreadPoolExecutor(2) as pool:
                futures = {"gradio": pool.submit(via_gradio), "http": pool.submit(via_http)}
                busiest = max_running(engine.address, until=lambda: all(f.done() for f in futures.values()))
                got = {name: f.result(timeout=180) for name, f in futures.items()}
            got["script"] = first + proc.stdout.read()
            assert proc.wait(60) == 0
        finally:
            stop_http()
            gradio_app.close(verbose=False)
    assert got == expected
    assert busiest == 3  # all three were in the engine at once


def max_running(address: str, until) -> int:
    """The most requests the engine ran at once, polled until ``until()``."""

    async def main() -> int:
        most = 0
        async with AsyncClient(address) as client:
            while not until():
                most = max(most, (await client.stats()).running)
                await anyio.sleep(0.01)
        return most

    return anyio.run(main)
