"""Room on the hot tier: watermarks, LRU eviction and writer backpressure.

The hot tier holds at most `high` bytes (--cache-size) and leaves `min_free`
bytes free on its disk. When a write or a fetch needs room, clean unpinned
extents are evicted least recently used first, down to the low watermark.
Dirty extents are never evicted: writers then wait for uploads to finish
(backpressure) and get ENOSPC only when there is nothing left to upload or
evict, or the bucket could not take uploads for `wait_limit` seconds.
"""
from __future__ import annotations

import errno
import logging
import time

import trio

from ..errors import FsError
from ..meta.schema import HOT

log = logging.getLogger(__name__)


class Space:
    def __init__(self, engine, *, cache_size: int, min_free: int, policy: str = "lru",
                 wait_limit: float = 120.0):
        self.engine = engine
        self.index = engine.index
        st = engine.hot.disk_usage()
        disk = st.f_blocks * st.f_frsize
        self.high = cache_size or int(disk * 0.9)
        self.low = int(self.high * 0.9)
        self.min_free = min_free
        self.policy = policy
        self.wait_limit = wait_limit
        self.room_freed = trio.Event()      # set whenever uploads clean something
        self.need_upload = trio.Event()     # asks the uploader to skip its delay
        self._free_cache = (0.0, 0)
        self.reserved = 0  # admitted fetches not installed yet

    def disk_free(self) -> int:
        t, free = self._free_cache
        now = time.monotonic()
        if now - t > 0.2:
            st = self.engine.hot.disk_usage()
            free = st.f_bavail * st.f_frsize
            self._free_cache = (now, free)
        return free

    def _over(self, n: int) -> int:
        """Bytes that must be freed before `n` more fit."""
        by_cache = self.index.total + self.reserved + n - self.high
        by_disk = self.min_free + self.reserved + n - self.disk_free()
        return max(by_cache, by_disk, 0)

    def needs_room(self, n: int) -> bool:
        return self._over(n) > 0

    def evict(self, need: int) -> int:
        """Drop clean, unpinned extents (LRU first) until `need` bytes are freed,
        going on down to the low watermark. Returns bytes freed."""
        target = max(need, self.index.total - self.low) if need > 0 else 0
        freed = 0
        batch = {}
        skipped = []
        meta = self.engine.meta
        while freed < target and self.index.lru:
            key, _ = self.index.lru.popitem(last=False)
            if key in self.engine.busy:
                skipped.append(key)
                continue
            ino, idx = key
            _node, exts = meta.get_extents(ino, idx, idx)
            ext = exts.get(idx)
            if ext is None or ext.dirty or ext.pinned or not ext.obj_id:
                continue  # the index was stale; the record is the truth
            batch[key] = type(ext)(ext.flags & ~HOT, ext.length, ext.checksum, ext.obj_id,
                                   ext.obj_off, ext.obj_len)
            freed += self.index.sizes.get(key, 0)
            self.engine.hot.remove(ino, idx)
            self.index.remove(key)
            self.engine.verified.discard(key)
        for key in skipped:
            self.index.lru[key] = None
        if batch:
            meta.update(None, batch)
            self.engine.stats.inc("evictions", len(batch))
            self._free_cache = (0.0, 0)
        return freed

    def admit_fetch(self, n: int) -> bool:
        """May a fetched extent be kept hot? (no-replace: only while there is room).
        If so, `n` bytes stay reserved until release(n) once it is installed."""
        over = self._over(n)
        if over > 0:
            if self.policy == "no-replace":
                return False
            self.evict(over)
            if self._over(n) > 0:
                return False
        self.reserved += n
        return True

    def release(self, n: int) -> None:
        self.reserved -= n

    async def reserve(self, n: int) -> None:
        """Wait until `n` bytes of new hot data fit; ENOSPC if they never can."""
        over = self._over(n)
        if over <= 0:
            return
        self.evict(over)
        deadline = time.monotonic() + self.wait_limit
        while self._over(n) > 0:
            if not self.index.dirty:
                log.warning("hot tier full: nothing left to upload or evict; returning ENOSPC")
                raise FsError(errno.ENOSPC, "hot tier full")
            if time.monotonic() > deadline:
                log.error("hot tier full and uploads made no room for %.0fs; returning ENOSPC",
                          self.wait_limit)
                raise FsError(errno.ENOSPC, "hot tier full")
            self.engine.stats.inc("backpressure_waits")
            self.need_upload.set()
            with trio.move_on_after(1.0):
                await self.room_freed.wait()
            self.evict(self._over(n))

    def uploaded(self) -> None:
        """An upload made an extent clean (evictable): wake waiting writers."""
        self.room_freed.set()
        self.room_freed = trio.Event()
