"""apps/bench_kernels.py's parts: one module per section, and what they share.

- harness: the attention shape, the errors that steer a run (Skipped, Unavailable, ContextLost), CUDA state
- timing: eager (do_bench) and CUDA-graph timing of a list of calls
- peaks: the device's copy bandwidth and matmul rate, measured (no run: what run and the apps' step floors use)
- ceilings: the "ceilings" section, which reports them
- attention_cases: the attention cases, their random inputs and the float32 reference
- attention: store_kv, paged decode and prefill, ours and FlashAttention-4 (the "kernels" section), and
  decode with sliding windows (the "window" section)
- steps: decode and prefill steps through ``ModelRunner.execute`` (the "steps" and "prefill" sections)
- run: the report being built, its units, and the fresh process after a lost CUDA context
- report: the final table
"""
