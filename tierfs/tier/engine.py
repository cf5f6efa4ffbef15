"""The data engine: read, write, truncate and fsync by (inode, offset) over
fixed-size extents that live on the hot tier, in the bucket, or both.

Runs on the trio thread. Hot-tier preads/pwrites are inline (page-cache fast);
object store calls, fsync and checksums of whole extents go to worker threads.
After every await the extent record is read again: it may have changed.
"""
from __future__ import annotations

import errno
import logging
import time
from dataclasses import replace

import trio

from ..checksum import xxh3
from ..errors import ChecksumMismatch, ColdStoreError, FsError, ObjectNotFound
from ..hot import HotStore
from ..meta import MetaStore
from ..meta.schema import DIRTY, HOT, Extent, object_name
from .cache import HotIndex, Key
from .stats import Stats

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, meta: MetaStore, hot: HotStore, cold, extent_size: int,
                 stats: Stats | None = None, s3_threads: int = 16, io_threads: int = 8):
        self.meta = meta
        self.hot = hot
        self.cold = cold
        self.E = extent_size
        self.stats = stats or Stats()
        self.index = HotIndex()
        self.s3_limiter = trio.CapacityLimiter(s3_threads)
        self.io_limiter = trio.CapacityLimiter(io_threads)
        self._fetching: dict[Key, trio.Event] = {}
        self._unsynced: dict[int, set[int]] = {}
        self.space = None  # set by the tiering layer: awaits room on the hot tier

    # ---- startup ----------------------------------------------------------------
    def load_index(self) -> list[str]:
        """Rebuild the in-memory hot index from metadata and the hot directory.
        Returns human-readable problems found (missing or stray hot files)."""
        problems = []
        on_disk = {(ino, idx): size for ino, idx, size in self.hot.scan()}
        fixes: dict[Key, Extent | None] = {}
        for ino, idx, ext in self.meta.iter_extents():
            key = (ino, idx)
            size = on_disk.pop(key, None)
            if ext.hot and size is None:
                if ext.dirty:
                    problems.append(f"inode {ino} extent {idx}: dirty hot file missing, data lost")
                    fixes[key] = replace(ext, flags=ext.flags & ~(HOT | DIRTY)) if ext.obj_id else None
                else:
                    fixes[key] = replace(ext, flags=ext.flags & ~HOT)
                continue
            if not ext.hot:
                if size is not None:
                    self.hot.remove(ino, idx)
                continue
            self.index.add(key, size, dirty=ext.dirty, pinned=ext.pinned)
        for ino, idx in on_disk:
            self.hot.remove(ino, idx)
        if on_disk:
            problems.append(f"removed {len(on_disk)} stray hot files")
        for (ino, idx), ext in fixes.items():
            self.meta.update(None, {(ino, idx): ext})
        return problems

    # ---- reads --------------------------------------------------------------------
    async def read(self, ino: int, off: int, size: int) -> bytes:
        E = self.E
        if size <= 0:
            return b""
        node, exts = self.meta.get_extents(ino, off // E, (off + size - 1) // E)
        end = min(off + size, node.size)
        if off >= end:
            return b""
        parts = []
        pos = off
        while pos < end:
            idx = pos // E
            start = idx * E
            n = min(end, start + E) - pos
            ext = exts.get(idx)
            if ext is None:
                chunk = b""
            elif ext.hot:
                try:
                    chunk = self.hot.pread(ino, idx, pos - start, n)
                    self.index.touch((ino, idx))
                    self.stats.inc("hot_read_bytes", n)
                except FileNotFoundError:
                    chunk = (await self._hot_file_lost(ino, idx))[pos - start:pos - start + n]
            else:
                data = await self.fetch(ino, idx)
                chunk = data[pos - start:pos - start + n]
            if len(chunk) < n:
                chunk = bytes(chunk) + bytes(n - len(chunk))
            parts.append(chunk)
            pos += n
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def _hot_file_lost(self, ino: int, idx: int) -> bytes:
        """A hot extent file vanished behind our back: refetch if clean, else EIO."""
        node, exts = self.meta.get_extents(ino, idx, idx)
        ext = exts.get(idx)
        self.index.remove((ino, idx))
        self.hot.remove(ino, idx)
        if ext is None:
            return b""
        if ext.dirty or not ext.obj_id:
            log.error("inode %d extent %d: hot file missing and not in the bucket", ino, idx)
            self.stats.inc("hot_file_lost")
            raise FsError(errno.EIO, "hot extent file lost")
        self.meta.update(None, {(ino, idx): replace(ext, flags=ext.flags & ~HOT)})
        return await self.fetch(ino, idx)

    async def fetch(self, ino: int, idx: int) -> bytes:
        """Bring one extent hot from the bucket (single-flight) and return its bytes."""
        key = (ino, idx)
        while True:
            _node, exts = self.meta.get_extents(ino, idx, idx)
            ext = exts.get(idx)
            if ext is None:
                return b""
            if ext.hot:
                try:
                    return self.hot.pread(ino, idx, 0, self.E)
                except FileNotFoundError:
                    return await self._hot_file_lost(ino, idx)
            event = self._fetching.get(key)
            if event is None:
                break
            await event.wait()
        event = self._fetching[key] = trio.Event()
        try:
            data = await self.get_verified(ext)
            if self.space is not None:
                await self.space.reserve(len(data))
            await trio.to_thread.run_sync(self.hot.store_whole, ino, idx, data,
                                          limiter=self.io_limiter)
            self.hot._forget_fd(ino, idx)
            if self.meta.put_extent_if(ino, idx, ext, replace(ext, flags=ext.flags | HOT)):
                self.index.add(key, len(data), dirty=False, pinned=ext.pinned)
            else:
                self.hot.remove(ino, idx)  # truncated or unlinked meanwhile
            return data
        finally:
            del self._fetching[key]
            event.set()

    async def get_verified(self, ext: Extent) -> bytes:
        """Read an extent's object range and verify its xxh3 (in a worker thread)."""
        name = object_name(ext.obj_id)

        def get_and_check() -> bytes:
            data = self.cold.get(name, ext.obj_off, ext.obj_len)
            if len(data) != ext.obj_len or xxh3(data) != ext.checksum:
                raise ChecksumMismatch(name)
            return data

        t0 = time.monotonic()
        try:
            data = await trio.to_thread.run_sync(get_and_check, limiter=self.s3_limiter)
        except ChecksumMismatch:
            self.stats.inc("checksum_errors")
            log.error("checksum mismatch on object %s (%d bytes at %d): returning EIO",
                      name, ext.obj_len, ext.obj_off)
            raise FsError(errno.EIO, "checksum mismatch") from None
        except ObjectNotFound:
            self.stats.inc("cold_errors")
            log.error("object %s is missing from the bucket: returning EIO", name)
            raise FsError(errno.EIO, "object missing") from None
        except ColdStoreError as e:
            self.stats.inc("cold_errors")
            log.error("cold read of %s failed: %s", name, e)
            raise FsError(errno.EIO, str(e)) from None
        self.stats.inc("cold_read_bytes", len(data))
        self.stats.inc("cold_reads")
        self.stats.inc("cold_read_seconds_x1000", int((time.monotonic() - t0) * 1000))
        return data

    async def ensure_hot(self, ino: int, idx: int) -> None:
        _node, exts = self.meta.get_extents(ino, idx, idx)
        ext = exts.get(idx)
        if ext is not None and not ext.hot:
            await self.fetch(ino, idx)

    # ---- writes ---------------------------------------------------------------------
    async def write(self, ino: int, off: int, data) -> int:
        E = self.E
        length = len(data)
        if length == 0:
            return 0
        end = off + length
        first, last = off // E, (end - 1) // E
        node, exts = self.meta.get_extents(ino, first, last)
        # Partially overwritten cold extents need their old bytes first.
        cold = [i for i, x in exts.items() if not x.hot and
                not (off <= i * E and end >= i * E + x.length)]
        if cold or self.space is not None:
            for idx in cold:
                await self.fetch(ino, idx)
            if self.space is not None:
                await self.space.reserve(length)
            node, exts = self.meta.get_extents(ino, first, last)
        view = memoryview(data)
        changed = {}
        pos = off
        t = time.time_ns()
        unsynced = self._unsynced.setdefault(ino, set())
        while pos < end:
            idx = pos // E
            start = idx * E
            n = min(end, start + E) - pos
            self.hot.pwrite(ino, idx, pos - start, view[pos - off:pos - off + n])
            ext = exts.get(idx)
            if ext is None:
                changed[(ino, idx)] = Extent(flags=HOT | DIRTY)
            elif not (ext.hot and ext.dirty):
                changed[(ino, idx)] = replace(ext, flags=ext.flags | HOT | DIRTY)
            self.index.written((ino, idx), pos - start + n)
            unsynced.add(idx)
            pos += n
        if end > node.size:
            node.size = end
        node.mtime_ns = node.ctime_ns = t
        self.meta.update(node, changed)
        self.stats.inc("write_bytes", length)
        return length

    async def truncate(self, ino: int, new_size: int) -> None:
        """Set a file's size; shrinking drops whole extents and cuts the last one."""
        E = self.E
        node = self.meta.get_inode(ino)
        if new_size < node.size and new_size % E:
            await self.ensure_hot(ino, new_size // E)
        node, exts = self.meta.get_extents(ino, 0, (1 << 64) - 1)
        changed: dict[Key, Extent | None] = {}
        gc = []
        if new_size < node.size:
            for idx, ext in exts.items():
                start = idx * E
                if start >= new_size:
                    changed[(ino, idx)] = None
                    if ext.obj_id:
                        gc.append(ext.obj_id)
                    self.hot.remove(ino, idx)
                    self.index.remove((ino, idx))
                    self._unsynced.get(ino, set()).discard(idx)
                elif start + E > new_size:
                    cut = new_size - start
                    if ext.hot:
                        self.hot.truncate(ino, idx, cut)
                        self.index.set_size((ino, idx), cut)
                        self.index.written((ino, idx), cut)
                        self._unsynced.setdefault(ino, set()).add(idx)
                        changed[(ino, idx)] = replace(ext, flags=ext.flags | DIRTY)
        node.size = new_size
        node.mtime_ns = node.ctime_ns = time.time_ns()
        self.meta.update(node, changed, gc)

    # ---- durability ---------------------------------------------------------------
    async def fsync(self, ino: int) -> None:
        """Make the inode's hot data and all committed metadata survive a crash."""
        idxs = self._unsynced.pop(ino, set())
        fds = [fd for fd in (self.hot.dup_fd(ino, i) for i in sorted(idxs)) if fd is not None]

        def sync_all():
            try:
                for fd in fds:
                    self.hot.fsync_fd(fd)
            finally:
                self.meta.sync()

        await trio.to_thread.run_sync(sync_all, limiter=self.io_limiter)

    async def sync_all(self) -> None:
        for ino in list(self._unsynced):
            await self.fsync(ino)
        await trio.to_thread.run_sync(self.meta.sync, limiter=self.io_limiter)

    def drop_inode(self, ino: int) -> None:
        """The inode was purged from metadata: remove its hot files."""
        for idx in self.index.indices(ino):
            self.hot.remove(ino, idx)
            self.index.remove((ino, idx))
        self._unsynced.pop(ino, None)
