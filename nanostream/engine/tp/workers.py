"""Rank 0's side of tensor parallelism: the workers, the groups, the step channel, the watch over them.

``LLMEngine`` with ``tensor_parallel_size=N`` starts a ``WorkerGroup`` before its ``ModelRunner``:

1. a store: on this host on a port the OS picks; across hosts the one torchrun's variables name;
2. ``Setup`` (the resolved config and the model's shape) into it, and N-1 worker processes
   (``python -m nanostream.engine.tp.worker``) started here, or across hosts by torchrun;
3. the ``Watch`` over their heartbeats (and processes), from the first moment;
4. both process groups, once every worker has joined.

Then every launched step goes through ``step(chunks)``: it publishes the step to the workers, and makes any
failure while the step runs (a collective on a dead peer, anything else) the engine's death: a rank that
failed part-way cannot be brought back into step, so the step raises ``EngineDeadError``, never hangs.
When the watch sees a worker exit or fall silent it kills the workers it started, which makes a collective
waiting on one of them fail at once (gloo; NCCL is aborted), and tells ``on_failure`` subscribers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Iterator, Mapping

import torch

from nanostream.config import EngineConfig
from nanostream.distributed.group import TensorParallel
from nanostream.distributed.liveness import Watch
from nanostream.distributed.rendezvous import MULTICAST_OFF, STORE_TIMEOUT, Rendezvous, host_locally, rank_device
from nanostream.engine.runner.kv_pool import kv_dtype
from nanostream.engine.runner.step_inputs import Chunk
from nanostream.engine.tp.control import Setup, StepWriter, Stop, encode
from nanostream.errors import EngineDeadError, NanostreamError
from nanostream.layers.backends import get_backend
from nanostream.models.sharding import check_split
from nanostream.models.spec import DecoderSpec

log = logging.getLogger(__name__)

PARENT_VARIABLE = "NANOSTREAM_TP_PARENT"  # a worker started here exits when this pid is no longer its parent
_EXIT_WAIT = 10.0  # seconds a worker gets to exit after Stop, before it is killed


def joined_key(rank: int) -> str:
    return f"joined/{rank}"


def _kill(processes: dict[int, subprocess.Popen], watch: Watch | None = None) -> None:
    if watch is not None:
        watch.stop()
    for proc in processes.values():
        if proc.poll() is None:
            proc.kill()  # SIGKILL: a stopped (SIGSTOP) process dies of it too
    for proc in processes.values():
        proc.wait()


class WorkerGroup:
    """Rank 0's handle on the other ranks, from start to ``close()``. Example (what ``LLMEngine`` does)::

    workers = WorkerGroup(config, spec)  # config.tensor_parallel_size == 2: one worker process
    runner = ModelRunner(config, spec, path, tp=workers.tp, control=workers)
    ...
    workers.close()

    With ``rendezvous`` (torchrun's variables, this process RANK=0) the workers are launched elsewhere and
    meet it there; without, they are started here, on a store at a port the OS picks, each with this
    process's environment (NCCL reads its settings there, and every rank must agree) and its rank's variables.
    The group writes no environment variable: NVLink multicast is switched off by the process's entry point
    (``nanostream serve`` does; a program of its own sets ``MULTICAST_OFF`` of distributed/rendezvous.py).
    """

    def __init__(
        self, config: EngineConfig, spec: DecoderSpec, rendezvous: Rendezvous | None = None, vision=None
    ) -> None:
        size = config.tensor_parallel_size
        check_split(spec, size)
        device = torch.device(config.device)
        local = rendezvous is None
        if local:
            _check_gpus(device, size)
            rendezvous, store = host_locally(size)
        elif rendezvous.world_size != size or rendezvous.rank != 0:
            raise ValueError(
                f"this process is RANK={rendezvous.rank} of WORLD_SIZE={rendezvous.world_size}, but the engine runs "
                f"on rank 0 with tensor_parallel_size={size}; give --tensor-parallel-size {rendezvous.world_size}"
            )
        else:
            store = rendezvous.connect()
        if device.type == "cuda":
            _note_multicast(os.environ)
        self._store, self._writer, self._closed = store, StepWriter(), False
        self._failure: str | None = None  # why the engine died (a step failed), where the watch did not see it
        self._subscribers: list[Callable[[str], None]] = []
        self._processes: dict[int, subprocess.Popen] = {}  # the workers started here
        self.tp = TensorParallel(0, size, rendezvous.local_rank)  # connected below, once every rank is there
        method = weakref.WeakMethod(self._on_watch_failure)  # the watch's thread must not keep this object alive
        self.watch = Watch(store, size, config.worker_timeout, lambda why: _call(method, why), self._processes)
        # The workers die with this object (or when the interpreter exits) at the latest.
        self._finalizer = weakref.finalize(self, _kill, self._processes, self.watch)
        levels = None if vision is None else len(vision.deepstack_levels)  # (a model that takes images: its tower's)
        store.set("setup", encode(Setup(config, spec, levels, None if vision is None else vision.both_ways)))
        self.watch.start()
        try:
            for r in range(1, size) if local else ():
                self._processes[r] = _spawn(rendezvous.for_rank(r))
            self._wait_joined()
            self.tp = TensorParallel.connect(store, 0, size, rendezvous.local_rank, device)
        except BaseException as exc:
            raise self.dead(exc) from exc
        log.info("tensor parallel: %d ranks over %s; this process is rank 0", size, self.tp.compute.name())

    def _wait_joined(self) -> None:
        keys = [joined_key(r) for r in range(1, self.tp.size)]
        deadline = time.monotonic() + STORE_TIMEOUT.total_seconds()
        while not self._store.check(keys):
            reason = self.failure or self.watch.exited()
            if reason is None and time.monotonic() > deadline:
                reason = f"not every tensor-parallel worker joined within {STORE_TIMEOUT.total_seconds():.0f} s"
            if reason is not None:
                raise EngineDeadError(reason)
            time.sleep(0.02)

    # ---- serving ---------------------------------------------------------------------------------

    @property
    def failure(self) -> str | None:
        """Why the engine is dead (a worker died or hung, a step failed); None while it lives."""
        return self.watch.failure or self._failure

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` (on the watch's thread) when the watch sees a worker die or hang."""
        self._subscribers.append(callback)

    @contextlib.contextmanager
    def step(self, chunks: list[Chunk]) -> Iterator[None]:
        """Publish the step to the workers; run it on this rank inside. Any failure is fatal (``EngineDeadError``)."""
        if self.failure is not None:
            raise EngineDeadError(f"{self.failure}; the engine cannot go on")
        if self._closed:
            raise EngineDeadError("the engine was closed (close()); make a new one to generate again")
        try:
            self.tp.publish(encode(self._writer.step(chunks)))
            yield
        except Exception as exc:
            raise self.dead(exc) from exc
        except BaseException as exc:  # Ctrl-C part-way: the ranks are out of step all the same
            self.dead(exc)
            raise

    def dead(self, exc: BaseException) -> EngineDeadError:
        """The engine's death, of ``exc`` raised while the ranks worked together: names the worker that
        died where one did, kills the ones started here."""
        deadline = time.monotonic() + 1.0  # a worker whose sockets just closed is still exiting
        reason = self.failure or self.watch.exited()
        while reason is None and self._processes and time.monotonic() < deadline:
            time.sleep(0.02)
            reason = self.failure or self.watch.exited()
        if reason is None:
            reason = f"a tensor-parallel step failed on rank 0 ({type(exc).__name__}: {exc})"
        self._failure, self._closed = reason, True
        self.tp.abort()
        self._finalizer()  # stops the watch, kills the workers started here
        return EngineDeadError(f"{reason}; the engine cannot go on")

    def failed_to_start(self, exc: Exception) -> Exception:
        """What rank 0 raises when its runner fails to start, after killing the workers: its own error (a
        checkpoint it cannot load, a bad value) as it is; anything else (a collective on a worker that died
        while loading) as the engine's death."""
        dead = self.dead(exc)
        return exc if isinstance(exc, (NanostreamError, ValueError)) else dead

    def _on_watch_failure(self, reason: str) -> None:
        _kill(self._processes)  # a collective waiting on one of them now fails instead of waiting
        self.tp.abort()
        for callback in self._subscribers:
            callback(reason)

    def close(self) -> None:
        """Stop the workers: ``Stop`` to each (if they live), then kill any still there after a while."""
        if self._closed:
            return
        self._closed = True
        self.watch.stop()  # a worker exiting on Stop is no failure
        if self.failure is None and self.tp.control is not None:
            with contextlib.suppress(Exception):  # a dead worker must not keep the others from stopping
                self.tp.publish(encode(Stop("the engine closed")))
        deadline = time.monotonic() + _EXIT_WAIT
        for proc in self._processes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        self._finalizer()  # kills what is left


def agreed_config(config: EngineConfig, spec: DecoderSpec, local_rank: int) -> EngineConfig:
    """The config rank 0 runs and sends its workers: its own device (``cuda:LOCAL_RANK``), and the attention
    backend ``auto`` picks here made explicit, so that no rank picks another (and captures other graphs)."""
    device = rank_device(config.device, local_rank)
    backend = get_backend(
        config.attention_backend,
        torch.device(device),
        dtype=getattr(torch, config.dtype),
        block_size=config.kvcache_block_size,
        head_dim=spec.head_dim,
        kv_cache_dtype=kv_dtype(config, spec),  # (an FP8 pool the model cannot read: refused here)
    )
    return dataclasses.replace(config, device=device, attention_backend=backend.name)


def _call(method: weakref.WeakMethod, reason: str) -> None:
    bound = method()
    if bound is not None:
        bound(reason)


def _check_gpus(device: torch.device, size: int) -> None:
    if device.type == "cuda" and (device.index or 0) + size > torch.cuda.device_count():
        raise ValueError(
            f"tensor_parallel_size={size} from {device} needs {size} GPUs, this host has {torch.cuda.device_count()}; "
            "lower tensor_parallel_size, or choose the GPUs with CUDA_VISIBLE_DEVICES"
        )


def worker_environment(rendezvous: Rendezvous, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment of the worker of ``rendezvous``'s rank started here: ``environ`` (this process's: NCCL
    reads its settings from each rank's, and they must agree), torchrun's variables of its rank, this pid."""
    return {**environ, **rendezvous.environment(), PARENT_VARIABLE: str(os.getpid())}


def _note_multicast(environ: Mapping[str, str]) -> None:
    unset = [name for name in MULTICAST_OFF if name not in environ]
    if unset:
        log.warning(
            "tensor parallel: NVLink multicast is left to NCCL (%s unset); where setting it up fails or hangs (a "
            "GPU slice of a bigger host), set %s in the environment before the engine starts (nanostream serve does)",
            ", ".join(unset),
            " ".join(f"{k}={v}" for k, v in MULTICAST_OFF.items()),
        )


def _spawn(rendezvous: Rendezvous) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "nanostream.engine.tp.worker"]
    return subprocess.Popen(cmd, env=worker_environment(rendezvous, os.environ), stdin=subprocess.DEVNULL)
