"""The device side of one engine rank: it runs the scheduler's chunks through the model.

Owns: ``ModelRunner`` (model_runner.py) and its helpers: the KV pool's size and allocation (kv_pool.py),
a step's packed inputs and their uploads (step_inputs.py), sampling parameters as tensors and samples
read back (sampling_batch.py), the sampler (sampler.py), the CUDA graphs of decode steps
(decode_graphs.py) and of prefill steps (prefill_graphs.py), prompt logprobs (prompt_logprobs.py).

May import: ``nanostream.engine.sequence`` (the one type the scheduler hands down), layers/, models/,
distributed/, kernels/, config, errors, sampling_params. Never the engine loop or the scheduler, tp/ or
process/: the runner knows nothing of scheduling, of other ranks' processes, or of clients.
"""
