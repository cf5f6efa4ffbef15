"""Hot copies let go of but not yet emptied, and the thread of their own that empties
them.

Emptying the file of a dropped hot copy (an `ftruncate` that frees its blocks, to
keep the inode as a spare, or an unlink) cost 1.3-1.8 ms per 4 MiB extent on ext4
(the delete of scripts/bench_stall.py: 1,024 extents). Done where the copy was dropped, on the trio thread, deleting a 4 GiB file
held every request of the mount for 1.3-1.9 s, and an eviction down to the low
watermark as long per 1,024 extents (README, Benchmark: "Requests while hot copies
are dropped"). Now:
- a copy whose place may take a new copy soon (eviction, release, a truncate, a
  damaged copy) is renamed into this directory on the caller's thread (`take`):
  its place is free at once;
- a copy whose place is never used again (its inode is gone: inode numbers are
  never reused) stays where it is until the thread gets to it (`take_later`);
and the thread closes its cached descriptor (at most MAX_FDS wait here) and empties
the file. Its blocks count as free meanwhile (`pending_bytes`): they will be within
moments. A daemon that stops leaves what it had not emptied yet: the next one
empties what is in here, and its scan of the hot tier removes the copies of inodes
that are gone.
"""
from __future__ import annotations

import itertools
import logging
import os
import queue
import secrets
import threading
from typing import Callable

log = logging.getLogger(__name__)

MAX_FDS = 256  # descriptors waiting here at most; beyond, the caller closes its own
WAIT = 5.0  # seconds a write that needs the room of files in here waits for them


class Trash:
    def __init__(self, path: str, empty: Callable[[str], None]):
        """empty(path): make the file at `path` a spare, or unlink it (blocking)."""
        self.path = path
        os.makedirs(path, exist_ok=True)
        self._empty = empty
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # (path, bytes, fd) or None
        self._cond = threading.Condition()
        self.waiting = 0         # files not emptied yet
        self.pending_bytes = 0   # their blocks
        self._fds = 0            # descriptors of them waiting to be closed here
        # Names never collide with one a stopped daemon left here.
        self._prefix = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopped = False
        for entry in os.scandir(path):  # left by a daemon that stopped
            try:
                if entry.is_file(follow_symlinks=False):
                    size = entry.stat(follow_symlinks=False).st_blocks * 512
                    self._put(entry.path, size, None)
            except FileNotFoundError:
                continue

    def take(self, src: str, fd: int | None = None) -> None:
        """Move the file at `src` in here (a rename on the caller's thread) and have
        it emptied; `fd`, a descriptor of it, is closed by the thread.
        FileNotFoundError (fd closed) if there is no such file."""
        dst = os.path.join(self.path, f"{self._prefix}-{next(self._ids)}")
        try:
            os.rename(src, dst)
            size = os.stat(dst).st_blocks * 512
        except FileNotFoundError:
            if fd is not None:
                os.close(fd)
            raise
        except OSError:
            # The trash could not take it (a full disk needs a block for the entry, an
            # I/O error): unlink it here, which needs none. Its place must be free.
            if fd is not None:
                os.close(fd)
            os.unlink(src)
            return
        self._put(dst, size, fd)

    def take_later(self, src: str, size: int, fd: int | None = None) -> None:
        """Have the file at `src` (about `size` bytes) emptied where it is, by the
        thread, with nothing done on the caller's: for a place never used again."""
        self._put(src, size, fd)

    def _put(self, path: str, size: int, fd: int | None) -> None:
        if fd is not None and self._fds >= MAX_FDS:  # a backlog must not use them all up
            os.close(fd)
            fd = None
        with self._cond:
            self.waiting += 1
            self.pending_bytes += size
            self._fds += fd is not None
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tierfs-trash",
                                                daemon=True)
                self._thread.start()
        self._queue.put((path, size, fd))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None or self._stopped:
                return
            path, size, fd = item
            if fd is not None:
                os.close(fd)
                with self._cond:
                    self._fds -= 1
            try:
                self._empty(path)
            except FileNotFoundError:
                pass
            except OSError as e:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                except OSError:
                    log.warning("could not empty or remove %s (%s): the next mount "
                                "tries again", path, e)
            except Exception:  # a bug: this thread must go on, or writers wait for it
                log.exception("emptying %s failed", path)
            with self._cond:
                self.waiting -= 1
                self.pending_bytes -= size
                if not self.waiting:
                    self._cond.notify_all()

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until everything given so far has been emptied; False if that took
        longer than `timeout` seconds (blocking: worker threads, tests)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self.waiting, timeout)

    def close(self) -> None:
        """Stop the thread once it is done with the file at hand; the rest stays for
        the next daemon."""
        self._stopped = True
        if self._thread is not None:
            self._queue.put(None)
