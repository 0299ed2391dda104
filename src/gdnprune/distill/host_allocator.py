"""glibc's malloc told to return freed blocks to the system: a process-level setting a CPU training run opts into.

FSDP2 gathers every layer unit (and its gradient) whole for a moment and frees it, several times a step.
glibc's malloc serves such blocks from its heaps once it has freed one of their size (its mmap threshold
rises to the largest block freed, up to 32 MiB), and keeps the freed memory for reuse: the resident memory
of a CPU run then grows by what was gathered, as if it were never sharded (BENCHMARKS.md, "Distillation at
scale": about 0.6 GB per process at 129M). :func:`return_freed_memory` fixes the threshold (``mallopt``),
so that blocks of ``threshold`` bytes and more are mapped on allocation and unmapped on free, as
``MALLOC_MMAP_THRESHOLD_`` in the environment does.

It costs CPU time: the pages of every block of ``threshold`` bytes and more are mapped anew each time it is
allocated (at 129M, 2 processes: FSDP2's peak 2.93 -> 2.30 GB per process, its CPU time per step
+30 to +80%; BENCHMARKS.md). The setting holds for the whole process and every later allocation, so the library
never applies it by itself: ``gdnprune distill --fsdp`` calls it when the run trains on the CPU (never on
CUDA, whose caching allocator owns device memory; not for DDP, which frees no gathered weights). It does
nothing on a C library other than glibc, or when the environment already chooses a malloc setting
(``MALLOC_*`` variables, ``glibc.malloc`` tunables: those win).
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Mapping

__all__ = ["MMAP_THRESHOLD", "return_freed_memory", "user_malloc_setting"]

#: the threshold set: 64 KiB (glibc starts at 128 KiB and raises it to the largest block freed, up to 32 MiB).
#: 1 and 4 MiB returned too little at 129M (BENCHMARKS.md): what glibc keeps is mostly blocks of 64 KiB to 4 MiB
MMAP_THRESHOLD = 1 << 16
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def user_malloc_setting(environ: Mapping[str, str] | None = None) -> str | None:
    """The environment variable that already sets glibc's malloc (a ``MALLOC_*`` variable, or
    ``GLIBC_TUNABLES`` naming a ``glibc.malloc`` tunable), else None."""
    environ = os.environ if environ is None else environ
    mine = sorted(name for name in environ if name.startswith("MALLOC_"))
    if mine:
        return mine[0]
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    return None


def _glibc() -> ctypes.CDLL | None:
    """The running C library when it is glibc on Linux, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") else None  # glibc only (musl has no such function)


def return_freed_memory(threshold: int = MMAP_THRESHOLD) -> bool:
    """Make glibc's malloc map blocks of ``threshold`` bytes and more on allocation and unmap them on free, for
    the rest of this process (see the module docstring). Returns whether it was set: False on another C
    library or platform, or when :func:`user_malloc_setting` finds the user's own choice (kept)."""
    if threshold <= 0:
        raise ValueError(f"return_freed_memory: expected a positive threshold, found {threshold}")
    if user_malloc_setting() is not None:
        return False
    libc = _glibc()
    if libc is None:
        return False
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    libc.mallopt.restype = ctypes.c_int
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))
