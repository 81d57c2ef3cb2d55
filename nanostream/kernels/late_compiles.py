"""The warning for a Triton kernel variant built after an engine's start-up: each one (~0.3 s) stalls every stream.

Triton's post-compile hook is process-wide state, so this is installed by an engine process's entry point
(``nanostream serve``, a tensor-parallel worker's main) once its start-up is done, never by a library
constructor::

    warn_on_late_compiles()  # start-up is over: a kernel built from now on is logged
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def warn_on_late_compiles() -> None:
    """From now on, log each Triton kernel variant built: building one (~0.3 s) stalls every stream, and the
    engine's warm-up steps (engine/runner/kv_pool.py) should have met it. Triton's hook is process-wide: call this from
    an engine process's entry point once its start-up is done (it installs itself once, keeping a hook that was
    there before)."""
    try:
        from triton import knobs
    except ImportError:
        return
    earlier = knobs.runtime.jit_post_compile_hook
    if getattr(earlier, "nanostream", False):
        return

    def hook(*, fn, key, **kwargs):
        name = getattr(fn, "__name__", fn)
        log.warning("Triton kernel %s got a variant after start-up, a stall of every stream (key %s)", name, key)
        return earlier(fn=fn, key=key, **kwargs) if earlier is not None else None

    hook.nanostream = True
    knobs.runtime.jit_post_compile_hook = hook
