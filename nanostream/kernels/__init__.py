"""Triton kernels with typed launchers (installed as ``nanostream.kernels``), and the torch-only pieces they share
with the layers' references (fp8_kv.py: the FP8 KV cache's format; expert_ops.py: the experts' activation).

The lowest floor of the package: it imports torch and triton, nothing of nanostream's above it (the layers
import it, never the reverse). Each launcher checks shapes, dtypes and strides before it launches. On a machine
without a GPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set before this package is
imported), which is how the CPU test suite checks them.
"""
