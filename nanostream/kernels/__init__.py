"""Triton kernels with typed launchers (installed as ``nanostream.kernels``).

Each launcher checks shapes, dtypes and strides before it launches. On a machine without a GPU the
kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set before this package is imported),
which is how the CPU test suite checks them.
"""
