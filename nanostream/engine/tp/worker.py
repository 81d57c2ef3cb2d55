"""A tensor-parallel worker: rank 1..N-1 of an engine, running rank 0's steps on its shard of the model.

Started by the engine on its host (``python -m nanostream.engine.tp.worker``, torchrun's variables in its
environment), or on another host by torchrun itself (``nanostream serve`` with RANK > 0). It talks to the
other ranks only, never to a client:

1. join the store rank 0 names, and start beating (distributed/liveness.py);
2. read ``Setup`` from the store: every setting is rank 0's, only the device is this rank's own;
3. build both process groups, load this rank's shard, size the KV pool with the others (the minimum),
   warm up and capture CUDA graphs in lockstep with them;
4. receive each ``Step`` rank 0 publishes and run it (engine/tp/control.py), until ``Stop``.

It exits on ``Stop``, when a collective fails (rank 0's sockets closed), when the store cannot be
reached, or when the process that started it is gone.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys

import torch
import torch.distributed as dist

from nanostream.distributed.group import TensorParallel
from nanostream.distributed.liveness import Heartbeat
from nanostream.distributed.rendezvous import Rendezvous, rank_device
from nanostream.engine.runner.model_runner import InFlight, ModelRunner
from nanostream.engine.tp.control import StepReader, Stop, decode, decode_setup
from nanostream.engine.tp.workers import PARENT_VARIABLE, joined_key
from nanostream.kernels.late_compiles import warn_on_late_compiles
from nanostream.models.loader import resolve_model_path

log = logging.getLogger("nanostream.engine.tp.worker")  # also when run as __main__


def _lost(reason: str) -> None:
    log.error("tensor-parallel worker exiting: %s", reason)
    os._exit(1)  # the main thread may be inside a collective that never returns


def run_worker(rendezvous: Rendezvous, parent_pid: int | None = None) -> int:
    """The life of a worker process (call it from the process's entry point: it sets the CUDA device)."""
    rank = rendezvous.rank
    store = rendezvous.connect()
    heartbeat = Heartbeat(store, rank, _lost, parent_pid).start()
    try:
        return _serve(rendezvous, store)
    finally:  # the beat leaves the store first: one inside it as the interpreter finalizes aborts the process
        if not heartbeat.stop():
            log.warning("tensor-parallel worker rank %d: a heartbeat is stuck in the store; exiting now", rank)
            logging.shutdown()
            os._exit(1)


def _serve(rendezvous: Rendezvous, store: dist.Store) -> int:
    rank = rendezvous.rank
    setup = decode_setup(store.get("setup"))
    config = dataclasses.replace(setup.config, device=rank_device(setup.config.device, rendezvous.local_rank))
    device = torch.device(config.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif "OMP_NUM_THREADS" not in os.environ:  # the ranks on one CPU share its cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // rendezvous.world_size))
    store.set(joined_key(rank), str(os.getpid()))
    tp = TensorParallel.connect(store, rank, rendezvous.world_size, rendezvous.local_rank, device)
    images = None if setup.image_levels is None else (setup.image_levels, setup.images_both_ways)
    runner = ModelRunner(config, setup.spec, resolve_model_path(config.model), tp=tp, image_levels=images)
    warn_on_late_compiles()
    log.info("tensor-parallel worker rank %d of %d ready on %s", rank, tp.size, device)
    reader, prev = StepReader(), None
    while True:
        message = decode(tp.receive())
        if isinstance(message, Stop):
            log.info("tensor-parallel worker rank %d stopping: %s", rank, message.reason)
            return 0
        prev: InFlight | None = runner.launch_local(reader.chunks(message), prev)


def main() -> int:
    """``python -m nanostream.engine.tp.worker``: torchrun's variables say which rank this is."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle; it stops its workers
    rendezvous = Rendezvous.from_env(os.environ)
    if rendezvous is None or rendezvous.rank == 0:
        print("nanostream worker: run by the engine, with RANK >= 1 of WORLD_SIZE >= 2 set", file=sys.stderr)
        return 2
    tag = f"rank {rendezvous.rank}"
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s [{tag}] %(name)s: %(message)s")
    parent = os.environ.get(PARENT_VARIABLE)
    try:
        return run_worker(rendezvous, int(parent) if parent else None)
    except Exception:
        log.exception("tensor-parallel worker rank %d failed", rendezvous.rank)
        return 1


if __name__ == "__main__":
    sys.exit(main())
