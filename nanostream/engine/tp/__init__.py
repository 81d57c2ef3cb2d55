"""Tensor parallelism's processes: rank 0's worker group, the workers' main, the channel between them.

Owns: ``WorkerGroup`` (workers.py: rank 0 starts or meets the workers, watches them, publishes steps),
a worker's main loop (worker.py: ``python -m nanostream.engine.tp.worker``), and the frames of the
control channel (control.py: ``Setup`` once, then each ``Step``).

May import: runner/ (a worker runs a ``ModelRunner``), ``nanostream.engine.sequence``, distributed/,
models/, layers/, config, errors. Never the engine loop, the scheduler or process/.
"""
