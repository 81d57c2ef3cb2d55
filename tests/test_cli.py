"""The command line as a new user meets it: --help that explains every option, and a mistake gives one
line that says what to change (exit 2), a runtime failure one line (exit 1), Ctrl-C exit 130 — never a
traceback. Real processes."""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from nanostream import __version__
from nanostream.cli import build_parser
from nanostream.client.launch import EngineProcess
from nanostream.config import EngineConfig, ServerConfig
from nanostream.options import field_docs


def nanostream(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanostream", *args], capture_output=True, text=True, timeout=timeout)


def one_line(out: subprocess.CompletedProcess) -> str:
    lines = [line for line in out.stderr.splitlines() if line.strip() and not line.startswith("INFO ")]
    assert "Traceback" not in out.stderr and len(lines) == 1, out.stderr
    return lines[0]


def test_every_config_field_has_a_description():
    for cls in (EngineConfig, ServerConfig):
        missing = {f.name for f in dataclasses.fields(cls)} - {"model"} - set(field_docs(cls))
        assert not missing, f"{cls.__name__} fields without a docstring (the --help text): {sorted(missing)}"


def test_help_describes_every_option_of_every_command():
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in commands.choices.items():
        for action in sub._actions:
            if not action.option_strings or action.dest == "help":
                continue
            text = action.help or ""
            assert text and not text.startswith("(default"), f"nanostream {name} {action.option_strings[0]}: {text!r}"
    serve_help = nanostream("serve", "--help").stdout
    assert "--dtype {auto,float32,bfloat16,float16}" in serve_help and "--openai-port" in serve_help


def test_version():
    assert nanostream("--version").stdout.strip() == f"nanostream {__version__}"


def test_max_model_len_past_the_model_is_an_error_not_a_silent_clamp(qwen3_dir):
    out = nanostream("serve", str(qwen3_dir), "--device", "cpu", "--max-model-len", "999999")
    assert out.returncode == 2
    assert "max_model_len 999999 exceeds the model's max_position_embeddings" in one_line(out)


def test_a_bad_sampling_option_of_the_demo_is_refused_before_an_engine_starts():
    out = nanostream("demo", "--temperature", "-1")
    assert out.returncode == 2 and "temperature" in one_line(out)
    assert "starting an engine" not in out.stdout


@pytest.mark.slow
def test_openai_frontend_mistakes_are_one_line(qwen3_dir, tmp_path):
    nobody = f"ipc://{tmp_path}/nobody.sock"
    out = nanostream("frontend", "openai", "--engine", nobody, "--port", "0", "--engine-wait", "0")
    assert out.returncode == 1 and "no engine answers at" in one_line(out) and "nanostream serve" in out.stderr
    out = nanostream("frontend", "openai", "--engine", nobody, "--port", "0", "--engine-wait", "1")
    assert out.returncode == 1 and "Traceback" not in out.stderr  # it served meanwhile, then gave up: its last line
    assert "no engine answers at" in out.stderr.splitlines()[-1] and "within 1 s (--engine-wait)" in out.stderr
    with EngineProcess(str(qwen3_dir), device="cpu", max_model_len=256) as engine, socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = nanostream("frontend", "openai", "--engine", engine.address, "--port", str(port))
    assert out.returncode == 2 and f"port {port} is in use: pass --port" in one_line(out)


@pytest.mark.slow
def test_an_engine_port_in_use_is_one_line(qwen3_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = nanostream("serve", str(qwen3_dir), "--device", "cpu", "--address", f"tcp://127.0.0.1:{port}")
    assert out.returncode == 2 and "address in use" in one_line(out)


@pytest.mark.slow
def test_ctrl_c_during_generate_exits_130_without_a_traceback(qwen3_dir):
    cmd = [sys.executable, "-m", "nanostream", "generate", "--model", str(qwen3_dir), "--device", "cpu"]
    prompts = [chr(ord("a") + i) for i in range(16)]  # seconds of decoding: the signal comes long before the end
    proc = subprocess.Popen([*cmd, "--max-tokens", "2000", "--ignore-eos", *prompts], stderr=subprocess.PIPE, text=True)
    seen = ""
    deadline = time.monotonic() + 60
    while "decode" not in seen:  # the progress bar counts decoded tokens: the engine runs
        assert time.monotonic() < deadline and proc.poll() is None, seen[-2000:]
        seen += os.read(proc.stderr.fileno(), 4096).decode()
    proc.send_signal(signal.SIGINT)
    rest = proc.communicate(timeout=30)[1]
    assert proc.returncode == 130
    assert "Traceback" not in seen + rest, rest[-2000:]


def test_generate_takes_the_sampling_options(qwen3_dir):
    from nanostream import LLM, SamplingParams

    ref = LLM(str(qwen3_dir), device="cpu").generate(
        ["Hi"], SamplingParams(temperature=0.9, top_k=5, seed=7, max_tokens=6, ignore_eos=True), use_tqdm=False
    )[0]
    cmd = ["generate", "--model", str(qwen3_dir), "--device", "cpu", "--quiet", "--temperature", "0.9", "--top-k"]
    out = nanostream(*cmd, "5", "--seed", "7", "--max-tokens", "6", "--ignore-eos", "Hi")
    assert out.returncode == 0, out.stderr
    assert f"{ref.text}\n[6 tokens, finish_reason=length]" in out.stdout
    bad = nanostream("generate", "--model", str(qwen3_dir), "--top-p", "7")
    assert bad.returncode == 2 and "top_p" in one_line(bad)
