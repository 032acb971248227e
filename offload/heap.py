"""The C heap on CPU runs: its free pages given back to the system, so that offloading on the CPU
shows in RSS; and its thresholds fixed, so that a step's memory is reused rather than given back
and faulted in again every step.

Activations freed after they were written to disk go back to malloc, not to the system: glibc
keeps freed chunks in its heap (everything under its dynamic mmap threshold, up to 32 MiB a
chunk) and returns only the free space at the very top. Backward then needs memory of other
sizes, the heap grows past the holes, and the process's resident size ends up as high as with no
offload at all (measured: the main arena held 2.3 GiB free against 215 MiB in use at the peak).
`malloc_trim(0)` hands every free page inside the heap back (glibc >= 2.8, madvise per page);
the price is that pages used again later fault in afresh.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from typing import Callable, Mapping, Optional

# mallopt's parameter numbers (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
# glibc's dynamic thresholds on 64-bit go no higher than these (DEFAULT_MMAP_THRESHOLD_MAX and
# twice it for trimming): where a process's thresholds end up once it has freed one 32 MiB block.
STEADY_MMAP_BYTES, STEADY_TRIM_BYTES = 32 << 20, 64 << 20
# Set by a user, glibc reads these at start-up; they win over the steady values.
MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
              "GLIBC_TUNABLES")


@functools.cache
def _libc() -> Optional[ctypes.CDLL]:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


@functools.cache
def _malloc_trim() -> Optional[Callable[[int], int]]:
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None  # musl, macOS: none
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def can_release() -> bool:
    return _malloc_trim() is not None


def release_free_heap() -> bool:
    """Return the heap's free pages to the system; False where the C library cannot."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def steady_thresholds(env: Mapping[str, str] = os.environ) -> str:
    """Fix glibc's mmap and trim thresholds at the values its dynamic ones reach at most.

    glibc moves both with the largest mapped block a process has freed so far, so two processes
    doing the same steps can differ by their start-up alone: one keeps its activations' pages
    between steps, the other hands the top of its heap back after a step and faults it in again
    during the next (measured on this project's CPU bench, 2026-12-02: 800-11,000 page faults a
    step against 1-6 with these values, the step 3-7% slower). Returns what was done, for the
    log: "fixed", or why not (the user set the allocator's environment; not glibc).
    """
    given = [name for name in MALLOC_ENV if name in env]
    if given:
        return f"left as {given[0]} sets it"
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    if mallopt is None:
        return "left alone (the C library is not glibc)"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # The mmap threshold first: setting either one ends glibc's moving of both.
    ok = mallopt(_M_MMAP_THRESHOLD, STEADY_MMAP_BYTES) and mallopt(_M_TRIM_THRESHOLD,
                                                                   STEADY_TRIM_BYTES)
    return "fixed" if ok else "left alone (mallopt refused)"
