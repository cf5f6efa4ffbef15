"""The C allocator's settings for the daemon.

glibc serves allocations above its mmap threshold with mmap and returns them to the
kernel when they are freed. The threshold starts at 128 KiB and, by default, rises to
the size of every large block freed (up to 32 MiB): after the first fetched span of
a pack is freed, later spans (up to 8 MiB) and extents come from the heap, which
seldom shrinks, so a cold epoch left the daemon holding about 100 MiB it no longer
used. A fixed threshold keeps large buffers mmapped and returned at once.
"""
from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)
MMAP_THRESHOLD = 256 << 10


def return_large_blocks() -> bool:
    """Fix glibc's mmap threshold; False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
