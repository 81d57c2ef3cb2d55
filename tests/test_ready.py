""" "Ready" means a client can connect and be heard: what scripts and supervisors that wait for the
ready line (and ``EngineProcess.start()``, and the discovery record) rely on."""

from __future__ import annotations

import logging
import os
import tempfile
import threading

import anyio
import pytest

from nanostream import AsyncClient
from nanostream.config import EngineConfig, ServerConfig
from nanostream.discovery import reachable
from nanostream.engine.process import server as server_module
from nanostream.engine.process.server import EngineServer
from nanostream.engine.process.transport import Transport

OPTIONS = dict(device="cpu", kvcache_block_size=16, max_model_len=256)


def _serving(model_dir, address: str) -> tuple[EngineServer, threading.Thread, threading.Event, list[str]]:
    server = EngineServer(
        EngineConfig(model=str(model_dir), **OPTIONS), ServerConfig(address=address, heartbeat_interval=0.1)
    )
    said: list[str] = []
    ready = threading.Event()

    def on_ready(address: str) -> None:
        said.append(address)
        ready.set()

    thread = threading.Thread(target=server.serve_forever, args=(on_ready,), daemon=True)
    thread.start()
    return server, thread, ready, said


def _stop(server: EngineServer, thread: threading.Thread) -> None:
    server._stop.set()
    thread.join(10)
    assert not thread.is_alive()


async def _hello(address: str) -> str:
    async with AsyncClient(address, timeout=2) as client:  # welcomed within 2 s, or EngineDeadError
        return client.model


def test_a_client_connecting_the_moment_the_engine_says_ready_is_welcomed_20_times_in_a_row(qwen3_dir):
    for i in range(20):
        address = f"ipc://{tempfile.mkdtemp(prefix='ns-')}/e.sock" if i % 2 else "tcp://127.0.0.1:0"
        server, thread, ready, said = _serving(qwen3_dir, address)
        try:
            assert ready.wait(10), "the engine never said it was ready"
            assert reachable(said[0]), f"round {i}: nothing listens at {said[0]} once the engine said ready"
            assert anyio.run(_hello, said[0]) == str(qwen3_dir)
        finally:
            _stop(server, thread)


def test_an_engine_that_cannot_be_reached_at_its_address_never_says_ready(qwen3_dir, monkeypatch, caplog):
    monkeypatch.setattr(server_module, "_PROBE_WARNING_S", 0.5)
    path = f"{tempfile.mkdtemp(prefix='ns-')}/e.sock"
    server = EngineServer(EngineConfig(model=str(qwen3_dir), **OPTIONS), ServerConfig(address=f"ipc://{path}"))
    os.unlink(path)  # as when another process removed the socket file: a bound engine nobody can reach
    said: list[str] = []
    thread = threading.Thread(target=server.serve_forever, args=(said.append,), daemon=True)
    with caplog.at_level(logging.WARNING, logger="nanostream.engine.process.server"):
        thread.start()
        try:
            anyio.run(anyio.sleep, 2.0)
            assert said == [], "the engine said ready though no client can connect at its address"
            assert "clients cannot connect there yet" in caplog.text
        finally:
            _stop(server, thread)


def test_a_stopping_engine_removes_its_own_socket_file_only():
    path = f"{tempfile.mkdtemp(prefix='ns-')}/e.sock"
    old = Transport(f"ipc://{path}")
    os.rename(path, path + ".old")  # the old engine's file, no longer at the address...
    new = Transport(f"ipc://{path}")  # ...where a new engine bound (as a restart does while the old one lingers)
    try:
        old.close()
        assert reachable(f"ipc://{path}"), "the old engine's close removed the new engine's socket file"
    finally:
        new.close()
    assert not os.path.exists(path), "an engine left its own socket file behind"


@pytest.fixture
def anyio_backend():
    return "asyncio"
