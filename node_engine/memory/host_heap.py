"""Giving freed host memory back to the operating system.

glibc's ``free`` unmaps large blocks at once, but blocks under its (dynamic)
mmap threshold stay in malloc's arenas, counted in the process's RSS, until
``malloc_trim`` returns them. Whoever frees a lot of host memory on purpose
(the CPU saver's release, weight packing parking the plain weights) trims.

glibc also raises its mmap threshold each time a mapped block is freed (up to
32 MiB), so after a large free, blocks of that size come from the arenas
instead, where what a computation frees stays resident until it ends.
:func:`pin_mmap_threshold` fixes the threshold, so every large block is mapped
and unmapped on its own and the resident set follows the live tensors (what
the vision reservation on CPU relies on: ``vision/reservation.py``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _libc_malloc_trim():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name)
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim.argtypes = [ctypes.c_size_t]
    return trim


M_MMAP_THRESHOLD = -3             # mallopt's parameter number (malloc.h)
PINNED_MMAP_THRESHOLD = 2**20     # blocks from 1 MiB up are mapped on their own


@functools.cache
def _libc_mallopt():
    name = ctypes.util.find_library("c")
    mallopt = getattr(ctypes.CDLL(name), "mallopt", None) if name is not None else None
    if mallopt is not None:
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt.restype = ctypes.c_int
    return mallopt


def pin_mmap_threshold(num_bytes: int = PINNED_MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold (no dynamic raise); False where ``mallopt`` does not exist or refuses."""
    mallopt = _libc_mallopt()
    return mallopt is not None and mallopt(M_MMAP_THRESHOLD, num_bytes) == 1


def trim_host_heap() -> None:
    """Return free heap pages to the OS (glibc); a no-op where ``malloc_trim`` does not exist."""
    trim = _libc_malloc_trim()
    if trim is not None:
        trim(0)
