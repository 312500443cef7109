"""The host allocator's policy: memory a CPU run frees stays with its process.

PyTorch's CPU tensors come from the C library's ``malloc``.  glibc serves large blocks
with ``mmap`` and gives the top of its heap back to the kernel once enough of it is free,
so a pipeline stage that builds up its activations in the forward and frees them in the
backward gets fresh pages every iteration, and the kernel zeroes each one at its first
touch (a *minor page fault*).  Measured on this project's 2-core VM (U-Net of
``experiments/validate.py``, batch 32, whole forward then backward in one process:
``python experiments/host_allocator.py``): about 6,000 faults (24 MB) per
forward, which then takes 36 ms instead of 27 ms; the MLP's backward faults on some
iterations and not others, 3.5 to 6 ms.  A layer's profile does not see this (the
profiler frees each layer's tensors before the next), so every action of the run costs
more than its profile, by an amount that depends on what the allocator happened to keep.

:func:`retain_freed_memory` sets the policy the CUDA caching allocator has on a GPU: no
block is served by ``mmap`` and freed memory is never given back, so once the first
iteration has grown the heap to its peak the steady state touches no new page.  The
process's resident memory then stays at its peak (as CUDA's *reserved* does).  The
profiler, the thread pipeline and every rank of the process pipeline set it, so the costs
they measure and the costs of the run are costs of the same allocator.  Set
``PIPESIM_HOST_ALLOCATOR=default`` to leave the C library as it is (the ablation).
Elsewhere than glibc (macOS, musl) it does nothing and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

#: ``mallopt`` parameters (glibc ``malloc.h``)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
#: free bytes at the top of the heap before it is trimmed: the largest ``int`` mallopt
#: takes (2 GiB), which no CPU pipeline here frees at once
_NEVER_TRIM = 2**31 - 1

ENV = "PIPESIM_HOST_ALLOCATOR"
RETAIN = "retain"
DEFAULT = "default"

_applied: str | None = None


def retain_freed_memory() -> str:
    """Keep freed host memory in this process (see the module doc); idempotent.

    Returns the policy in force: ``"retain"``, or ``"default"`` followed by why not
    (``PIPESIM_HOST_ALLOCATOR=default``, or no glibc ``mallopt``), which profiles and
    traces record as ``meta["host_allocator"]``.
    """
    global _applied
    if _applied is None:
        _applied = _apply()
    return _applied


def _apply() -> str:
    if os.environ.get(ENV, RETAIN) == DEFAULT:
        return f"{DEFAULT} ({ENV}={DEFAULT})"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return f"{DEFAULT} (no glibc mallopt here)"
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM) == 1
    return RETAIN if ok else f"{DEFAULT} (mallopt refused)"
