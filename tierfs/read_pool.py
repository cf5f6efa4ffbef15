"""Reads of several extent files at once, for the direct path's large reads.

A read through `tierfs.open` that covers several extents is one preadv() per extent
file. Made one after another, each waits for its own disk read, and the kernel's
readahead starts afresh in every file; made at once, from a few threads (preadv()
lets go of the GIL), the disk gets them all together, as it gets one large read of a
local file (README, Benchmark: W7 torch.load hot, tierfs.open).

The threads belong to the process that made them: a forked child (a DataLoader
worker) gets threads of its own on its first large read.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait

THREADS = 8               # reads in flight: the 4-5 extents of a 16 MiB read, and more
PARALLEL_MIN = 2 << 20    # below this, a read across two extents is not worth a thread

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(THREADS, thread_name_prefix="tierfs-read")
        return _pool


def _after_fork_in_child() -> None:
    """A child has none of its parent's threads, and a lock some other thread held
    at the fork would stay held: it starts afresh. (The parent's pool is not shut
    down here: its queue is a copy the child never uses.)"""
    global _lock, _pool
    _lock, _pool = threading.Lock(), None


os.register_at_fork(after_in_child=_after_fork_in_child)


def in_background(fn, *args):
    """fn(*args) in one of the pool's threads: a Future of its result."""
    return _executor().submit(fn, *args)


def pread_full(fd: int, out: memoryview, offset: int) -> int:
    """Read into `out` up to the end of the file; the number of bytes read."""
    done = 0
    while done < len(out):
        n = os.preadv(fd, [out[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def read_all(pieces: list[tuple[int, memoryview, int]]) -> list[int]:
    """pread_full of every (fd, out, offset); the bytes each got, in order. At once
    where there are several and PARALLEL_MIN bytes in all, else one after another.
    Returns only when every read has ended (the caller may then close the
    descriptors); the first error is raised then."""
    if len(pieces) < 2 or sum(len(out) for _fd, out, _off in pieces) < PARALLEL_MIN:
        return [pread_full(fd, out, offset) for fd, out, offset in pieces]
    pool = _executor()
    futures = [pool.submit(pread_full, fd, out, offset) for fd, out, offset in pieces[1:]]
    error: BaseException | None = None
    got = [0]
    try:
        fd, out, offset = pieces[0]
        got[0] = pread_full(fd, out, offset)  # this thread reads one of them itself
    except BaseException as e:
        error = e
    while True:  # even when interrupted: the reads write into the caller's buffer
        try:
            wait(futures)
            break
        except BaseException as e:
            error = error or e
    for fut in futures:
        if fut.exception() is not None:
            error = error or fut.exception()
        else:
            got.append(fut.result())
    if error is not None:
        raise error
    return got
