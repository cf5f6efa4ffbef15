"""The C allocator's settings for the daemon.

glibc serves allocations above its mmap threshold with mmap and returns them to the
kernel when they are freed. Two costs pull the threshold in opposite directions:

- Memory kept. By default the threshold rises to the size of every large block freed
  (up to 32 MiB): after the first fetched span of a pack is freed, later spans (up to
  8 MiB) and extents come from the heap, which seldom shrinks, so a cold epoch left the
  daemon holding about 100 MiB it no longer used.
- Pages touched afresh. A block served by mmap is new memory each time, and every page
  of it faults when the daemon first writes it: on a virtual machine more than copying
  the page costs. A FUSE request carries up to 1 MiB; with a threshold below that, each
  read reply and each write's buffer cost 256 faults.

So the threshold is fixed just above the largest FUSE request: request buffers come
from the heap and are reused; fetched spans and whole extents above 1 MiB are mmapped
and returned at once. The trim threshold keeps up to TRIM_THRESHOLD of freed heap at
its top, so that the request buffers freed by one burst serve the next. The price:
fetched spans below the threshold come from the heap, and the free space they leave
in its middle stays with the daemon (docs/architecture.md § Memory).
"""
from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = (1 << 20) + (64 << 10)  # just above a FUSE request (1 MiB)
TRIM_THRESHOLD = 4 << 20   # freed heap kept for the next requests


def return_large_blocks() -> bool:
    """Fix glibc's mmap and trim thresholds; False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
            and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)
