"""Giving freed host memory back to the operating system.

glibc's ``free`` unmaps large blocks at once, but blocks under its (dynamic)
mmap threshold stay in malloc's arenas, counted in the process's RSS, until
``malloc_trim`` returns them. Whoever frees a lot of host memory on purpose
(the CPU saver's release, weight packing parking the plain weights) trims.
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


def trim_host_heap() -> None:
    """Return free heap pages to the OS (glibc); a no-op where ``malloc_trim`` does not exist."""
    trim = _libc_malloc_trim()
    if trim is not None:
        trim(0)
