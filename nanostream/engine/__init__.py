"""The inference engine, by role: each folder imports only what stands below it.

    process/   the engine process: busy loop, ZeroMQ transport, the open requests   (imports the core)
    (the core) llm_engine.py: admission, one step(), abort; deltas.py: what a step returns;
               scheduler.py, block_manager.py, sequence.py, admission.py, stats.py: plain Python;
               grammar.py + grammar_text.py: structured outputs (xgrammar, masks on the host)
    tp/        tensor parallelism's processes: rank 0's worker group, a worker's main, the control channel
    runner/    the device side: model runner, KV pool, step inputs, sampling, CUDA graphs

``llm_engine.py`` drives runner/ (and tp/ with several ranks); tp/ runs runner/ on the other ranks; runner/
takes from the core only ``sequence.py``. Nothing imports process/ but the entry points (cli.py).
"""
