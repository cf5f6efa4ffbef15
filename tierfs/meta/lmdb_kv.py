"""LMDB engine for the metadata store: one environment in the node's cache dir.

Everything LMDB-specific lives here: the environment, map growth, the readers
in worker threads that pin the map, and the file copy checkpoints take.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import time
from typing import Iterator

import lmdb

from ..errors import FsError, UserError

log = logging.getLogger("tierfs.meta")

DEFAULT_MAP_SIZE = 1 << 36  # 64 GiB of address space; the file grows as used
MAX_MAP_SIZE = 1 << 40      # growth stops here (then ENOSPC)


class LmdbKV:
    kind = "lmdb"
    shared = False  # one node: the lease keeps others out

    def __init__(self, path: str, map_size: int = DEFAULT_MAP_SIZE,
                 max_map_size: int = MAX_MAP_SIZE):
        os.makedirs(path, exist_ok=True)
        self.path = path
        try:
            # sync=False: commits reach the OS page cache (survive kill -9);
            # fsync() and checkpoints call sync() to make them survive power loss.
            self.env = lmdb.open(path, map_size=map_size, subdir=True, sync=False,
                                 metasync=False, max_dbs=0, readahead=False)
        except lmdb.Error as e:
            raise UserError(f"cannot open metadata database in {path}: {e}") from None
        self.map_size = self.env.info()["map_size"]
        self.max_map_size = max(max_map_size, self.map_size)
        self.thread_readers = 0  # read transactions in worker threads: the map must not move
        self._disk_full_logged = -1e9  # monotonic time of the last "cache disk is full"
        # read() and write() as the environment's own calls: the store's hot path.
        self.read = functools.partial(self.env.begin, buffers=False)
        self.peek = self.read  # one transaction is as cheap as single reads here
        self.write = functools.partial(self.env.begin, write=True)

    def get(self, key: bytes) -> bytes | None:
        with self.env.begin(buffers=False) as txn:
            return txn.get(key)

    def run(self, fn, *args, **kwargs):
        """fn(*args, **kwargs), once more after growing a full map; if the map cannot
        grow (at its limit, or a worker thread is reading: reading_in_thread() made
        room before it began), the caller gets ENOSPC."""
        try:
            try:
                return fn(*args, **kwargs)
            except lmdb.MapFullError:
                if self.grow():
                    try:
                        return fn(*args, **kwargs)
                    except lmdb.MapFullError:
                        pass
        except lmdb.DiskError:
            # The disk under the cache dir is full (the commit wrote nothing): a full
            # disk, not a broken database, so ENOSPC as for a full map.
            self._disk_full()
            raise FsError(errno.ENOSPC, "the cache disk is full") from None
        log.error("metadata database is full (%d bytes): returning ENOSPC", self.map_size)
        raise FsError(errno.ENOSPC)

    def _disk_full(self) -> None:
        """Say so once a minute, however many requests fail meanwhile."""
        now = time.monotonic()
        if now - self._disk_full_logged > 60:
            self._disk_full_logged = now
            log.error("cache disk is full: the metadata database in %s cannot grow, "
                      "returning ENOSPC: free space on that disk", self.path)

    def scan(self, txn, start: bytes, end: bytes,
             values: bool = True) -> Iterator[tuple[bytes, bytes | None]]:
        cur = txn.cursor()
        if not cur.set_range(start):
            return
        if values:
            for key, val in cur:
                if key >= end:
                    return
                yield key, val
        else:
            for key in cur.iternext(keys=True, values=False):
                if key >= end:
                    return
                yield key, None

    def last_keys(self, txn, start: bytes, end: bytes, limit: int) -> list[bytes]:
        cur = txn.cursor()
        if not cur.set_range(end):  # nothing at or above `end`: start from the last key
            if not cur.last():
                return []
        elif not cur.prev():
            return []
        out = []
        while len(out) < limit and cur.key() >= start:
            if cur.key() < end:
                out.append(cur.key())
            if not cur.prev():
                break
        return out

    def get_many(self, txn, keys: list[bytes]) -> list[bytes | None]:
        return [txn.get(key) for key in keys]

    def scan_many(self, txn, ranges, values: bool = True) -> list[list]:
        return [list(self.scan(txn, start, end, values)) for start, end in ranges]

    @staticmethod
    def now_ns(txn) -> int:
        return time.time_ns()

    def listen(self, on_change) -> None:
        """One node: nothing changes behind its back."""
        return None

    def grow(self) -> bool:
        """Double the map (no transaction may be open in this process)."""
        if self.thread_readers or self.map_size >= self.max_map_size:
            return False
        self.map_size = min(self.map_size * 2, self.max_map_size)
        self.env.set_mapsize(self.map_size)
        return True

    def used_bytes(self) -> int:
        """How much of the map the database file uses."""
        return (self.env.info()["last_pgno"] + 1) * self.env.stat()["psize"]

    @contextlib.contextmanager
    def reading_in_thread(self):
        """Around a worker thread's read transactions: the map must not move under them.
        Writes meanwhile cannot grow it, and cannot reuse the pages the reader's
        snapshot holds: first the map gets room for as much again as the database
        holds (called on the event loop, between its transactions), so that writes
        during a checkpoint copy or a scan do not fail with ENOSPC."""
        if not self.thread_readers:
            while self.map_size < 2 * self.used_bytes() and self.grow():
                pass
        self.thread_readers += 1
        try:
            yield
        finally:
            self.thread_readers -= 1

    def copy_to(self, directory: str) -> str:
        """A consistent, compacted copy of the database (blocking); its file's path.
        OSError if it cannot be written (a full disk: lmdb says so as a DiskError)."""
        try:
            self.env.copy(directory, compact=True)
        except lmdb.Error as e:
            raise OSError(errno.EIO, str(e)) from None
        return os.path.join(directory, "data.mdb")

    def sync(self) -> None:
        self.env.sync(True)

    def close(self) -> None:
        if self.env is not None:
            self.env.sync(True)
            self.env.close()
            self.env = None
