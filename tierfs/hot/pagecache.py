"""Two page-cache calls Python's os module lacks, from libc through ctypes.

- `start_writeback(fd)`: sync_file_range(SYNC_FILE_RANGE_WRITE) starts writing a
  file's dirty pages to the disk without waiting. A checkpoint fills one extent file
  after another; started as each fills, their writeback streams while the writer
  goes on, so the fsync at the end has little left to write, as with one large file
  whose writeback the kernel starts early.
- `is_cached(fd, length)`: cachestat() (Linux 6.5+) tells whether the page cache
  holds all of a file's first `length` bytes, without reading anything. (A read with
  RWF_NOWAIT is no such test: a miss starts the kernel's readahead, and on a fast disk
  it may answer as if the data had been there.)

Advice only: where a call is missing or fails, nothing changes but the timing.
"""
from __future__ import annotations

import ctypes
import os

_SYNC_FILE_RANGE_WRITE = 2  # <fcntl.h>: start writeback of the dirty pages, do not wait
_NR_CACHESTAT = 451         # the same number on every architecture
_PAGE = os.sysconf("SC_PAGE_SIZE")


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [("nr_cache", ctypes.c_uint64), ("nr_dirty", ctypes.c_uint64),
                ("nr_writeback", ctypes.c_uint64), ("nr_evicted", ctypes.c_uint64),
                ("nr_recently_evicted", ctypes.c_uint64)]


def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_lib = _libc()
sync_file_range = getattr(_lib, "sync_file_range", None)
if sync_file_range is not None:
    sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    sync_file_range.restype = ctypes.c_int
_syscall = getattr(_lib, "syscall", None)
cachestat_works = _syscall is not None  # until the kernel says it has no cachestat


def start_writeback(fd: int) -> None:
    """Start the disk write of every dirty page of `fd` (it may wait for a moment
    when the disk's queue is full: worker threads and clients, not the trio thread)."""
    if sync_file_range is not None:
        sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


def is_cached(fd: int, length: int) -> bool | None:
    """Whether the page cache holds every page of the first `length` bytes of `fd`;
    None where the kernel cannot tell (before Linux 6.5, or a filesystem without
    a page cache)."""
    global cachestat_works
    if not cachestat_works:
        return None
    rng, out = _Range(0, length), _Stat()
    if _syscall(_NR_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(out), 0) != 0:
        if ctypes.get_errno() in (38, 1):  # ENOSYS, EPERM (seccomp): never again
            cachestat_works = False
        return None
    return out.nr_cache >= -(-length // _PAGE)
