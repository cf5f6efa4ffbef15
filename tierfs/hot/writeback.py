"""Start writing a file's dirty pages to the disk without waiting (sync_file_range).

A checkpoint fills one extent file after another; started as each fills, their
writeback streams while the writer goes on, so the fsync at the end has little left
to write, as with one large file whose writeback the kernel starts early. Python's
os module lacks sync_file_range: it comes from libc through ctypes. Advice only:
where it is missing or fails, nothing changes but the timing.
"""
from __future__ import annotations

import ctypes

_SYNC_FILE_RANGE_WRITE = 2  # <fcntl.h>: start writeback of the dirty pages, do not wait


def _load():
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


sync_file_range = _load()


def start_writeback(fd: int) -> None:
    """Start the disk write of every dirty page of `fd` (it may wait for a moment
    when the disk's queue is full: worker threads and clients, not the trio thread)."""
    if sync_file_range is not None:
        sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)
