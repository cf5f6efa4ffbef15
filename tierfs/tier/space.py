"""Room on the hot tier: watermarks, LRU eviction and writer backpressure.

The hot tier holds at most `high` bytes (--cache-size) and leaves `min_free`
bytes free on its disk. When a write or a fetch needs room, clean unpinned
extents are evicted least recently used first, down to the low watermark.
Dirty extents are never evicted: a writer that needs room asks the uploader to
upload every dirty extent at once (whatever --upload-delay says) and waits for
it. Waiting is bounded by `wait_limit` (--write-wait) counted from the moment
the hot tier got stuck, not per request: once uploads have freed nothing for
that long (a bucket outage), every write that needs room fails with ENOSPC at
once until an upload succeeds again. ENOSPC comes at once, too, when there is
nothing left to upload or evict.
"""
from __future__ import annotations

import errno
import logging
import time
from dataclasses import replace

import trio

from ..config import format_size
from ..errors import FsError, UserError
from ..meta.schema import HOT

log = logging.getLogger(__name__)


# The largest FUSE read or write request (libfuse 3 negotiates 1 MiB).
MAX_REQUEST = 1 << 20


def min_cache_size(extent_size: int) -> int:
    """The smallest hot tier that can serve any one request: the extents a 1 MiB
    request can touch (one more than it covers when it is not aligned)."""
    return (-(-MAX_REQUEST // extent_size) + 1) * extent_size


def check_cache_size(cache_size: int, extent_size: int) -> None:
    need = min_cache_size(extent_size)
    if cache_size < need:
        touched = need // extent_size
        raise UserError(f"--cache-size {format_size(cache_size)} is too small for "
                        f"{format_size(extent_size)} extents: one request can touch "
                        f"{touched} extents, so the hot tier needs at least "
                        f"{format_size(need)}; raise --cache-size")


class Space:
    def __init__(self, engine, *, cache_size: int, min_free: int, policy: str = "lru",
                 wait_limit: float = 60.0):
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
        self.stuck_since: float | None = None  # writers waiting and no upload since then
        self.kick_uploader = lambda: None      # set by the uploader: start uploads now
        self._enospc_logged = -1e9
        self._enospc_quiet = 0

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

    def evict(self, need: int, spare_busy: bool = True) -> int:
        """Drop clean, unpinned extents (LRU first) until `need` bytes are freed,
        going on down to the low watermark. Returns bytes freed. Extents that a
        write is preparing are spared unless `spare_busy` is False (then the write
        fetches them again: slower, never wrong)."""
        target = max(need, self.index.total - self.low) if need > 0 else 0
        freed = 0
        batch = {}
        skipped = []
        meta = self.engine.meta
        while freed < target and self.index.lru:
            key, _ = self.index.lru.popitem(last=False)
            if spare_busy and key in self.engine.busy:
                skipped.append(key)
                continue
            ino, idx = key
            _node, exts = meta.get_extents(ino, idx, idx)
            ext = exts.get(idx)
            if ext is None or ext.dirty or ext.pinned or not ext.obj_id:
                continue  # the index was stale; the record is the truth
            batch[key] = replace(ext, flags=ext.flags & ~HOT)
            freed += self.index.sizes.get(key, 0)
            self.engine.forget_hot(ino, idx)
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
        """An admitted fetch is installed (or failed): its room is evictable again."""
        self.reserved -= n
        self._wake_writers()

    async def reserve(self, n: int) -> None:
        """Wait until `n` bytes of new hot data fit; ENOSPC if they never can or the
        hot tier has been stuck for longer than wait_limit."""
        while True:
            over = self._over(n)
            if over <= 0:
                return
            if self.evict(over) > 0:
                continue
            if not self.index.dirty and not self.reserved:
                # Only extents of writes waiting like this one may be left: take them
                # (those writes fetch them again) rather than hold each other's room.
                if self.evict(over, spare_busy=False) > 0:
                    continue
                self._refuse("hot tier full: nothing left to upload or evict")
            # Room comes from uploads (dirty extents) or from fetches being installed.
            now = time.monotonic()
            if self.stuck_since is None:
                self.stuck_since = now
            left = self.stuck_since + self.wait_limit - now
            if left <= 0:
                self._refuse(f"hot tier full of data not uploaded yet, and uploads made no "
                             f"room for {self.wait_limit:.0f}s (--write-wait)")
            self.engine.stats.inc("backpressure_waits")
            self.need_upload.set()
            self.kick_uploader()
            with trio.move_on_after(min(1.0, left)):
                await self.room_freed.wait()

    def _refuse(self, why: str) -> None:
        """ENOSPC, logged once a minute however many requests get it."""
        self.engine.stats.inc("enospc")
        self._enospc_quiet += 1
        now = time.monotonic()
        if now - self._enospc_logged > 60:
            more = (f" ({self._enospc_quiet - 1} more requests refused since the last "
                    f"message)") if self._enospc_quiet > 1 else ""
            self._enospc_logged, self._enospc_quiet = now, 0
            log.warning("%s: returning ENOSPC%s", why, more)
        raise FsError(errno.ENOSPC, "hot tier full")

    def uploaded(self) -> None:
        """An upload made an extent clean (evictable): wake waiting writers."""
        self.stuck_since = None
        self._wake_writers()

    def _wake_writers(self) -> None:
        self.room_freed.set()
        self.room_freed = trio.Event()
