"""Building blocks of the models: attention over the paged cache, norms, rotary embedding, linears, experts.

May import kernels/ (the Triton launchers, the FP8 KV format), distributed/ (the collectives) and nanostream's
errors; models/ and the engine import these layers, never the reverse.
"""
