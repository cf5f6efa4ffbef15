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

Evicted files are emptied by the hot store's trash a moment later; their blocks count
as free for eviction (or it would evict on while the trash catches up), but a write
that needs them on a disk short of `min_free` waits for the trash first.
"""
from __future__ import annotations

import errno
import logging
import os
import time
from dataclasses import replace

import trio

from ..config import format_size, min_cache_size
from ..errors import FsError, UserError
from ..hot import trash as trash_module
from ..meta.schema import HOT

log = logging.getLogger(__name__)

EVICT_BATCH = 256  # extents evicted per pass of the trio loop down to the low watermark


def check_cache_size(space: "Space", extent_size: int) -> None:
    """Refuse a hot tier that cannot work on its disk (UserError, at mount): a
    --cache-size larger than the disk, a --min-free or a full disk that leaves less
    than one request's extents (every write would fail), a limit below that."""
    need = min_cache_size(extent_size)
    # The hot store lives in CACHE_DIR/hot: name the directory the user gave.
    where = (f"the cache disk of {os.path.dirname(space.engine.hot.root)} "
             f"({format_size(space.disk_total)} in all, "
             f"{format_size(space.disk_free_at_start)} free)")
    if space.explicit_limit and space.high > space.disk_total:
        raise UserError(f"--cache-size {format_size(space.high)} is larger than {where}: "
                        f"lower it, or leave it out to use 90% of what the disk can give "
                        f"({format_size(space.default_limit)})")
    if space.can_give < need:
        if space.disk_free_at_start + space.index.total < need:
            raise UserError(f"{where} is too full for the hot tier, which needs at least "
                            f"{format_size(need)}: free space on it or choose another "
                            f"--cache-dir")
        raise UserError(f"--min-free {format_size(space.min_free)} leaves the hot tier less "
                        f"than the {format_size(need)} it needs on {where}: lower --min-free")
    if space.high < need:
        touched = need // extent_size
        if not space.explicit_limit:
            raise UserError(f"90% of what {where} can give the hot tier is "
                            f"{format_size(space.high)}, less than the {format_size(need)} "
                            f"that {format_size(extent_size)} extents need: free space on it, "
                            f"lower --min-free or set --cache-size")
        raise UserError(f"--cache-size {format_size(space.high)} is too small for "
                        f"{format_size(extent_size)} extents: one request can touch "
                        f"{touched} extents, so the hot tier needs at least "
                        f"{format_size(need)}; raise --cache-size")


class Space:
    def __init__(self, engine, *, cache_size: int, min_free: int, policy: str = "lru",
                 wait_limit: float = 60.0):
        self.engine = engine
        self.index = engine.index
        st = engine.hot.disk_usage()
        self.disk_total = st.f_blocks * st.f_frsize
        self.disk_free_at_start = st.f_bavail * st.f_frsize
        # What the hot tier can grow to: what it holds plus the free space, less
        # --min-free; on a shared disk far less than its size.
        self.can_give = max(0, min(self.index.total + self.disk_free_at_start - min_free,
                                   self.disk_total))
        self.default_limit = int(self.can_give * 0.9)
        self.explicit_limit = bool(cache_size)
        self.high = cache_size or self.default_limit
        if cache_size:
            self.limit_note = "--cache-size" + (
                f"; the cache disk can give only {format_size(self.can_give)} now"
                if cache_size > self.can_give else "")
        else:
            self.limit_note = (f"default: 90% of the {format_size(self.can_give)} the cache "
                               f"disk can give ({format_size(self.disk_free_at_start)} free now)")
        self.low = int(self.high * 0.9)
        self.min_free = min_free
        self.policy = policy
        self.wait_limit = wait_limit
        self.room_freed = trio.Event()      # set whenever uploads clean something
        self.need_upload = trio.Event()     # asks the uploader to skip its delay
        self._free_cache = (0.0, 0)
        self.reserved = 0  # admitted fetches not installed yet
        self._evicting = False  # the task that evicts down to the low watermark runs
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
        by_disk = self._disk_short(n) - self.engine.hot.trash.pending_bytes
        return max(by_cache, by_disk, 0)

    def _disk_short(self, n: int) -> int:
        """Bytes the disk lacks now for `n` more, `min_free` kept (not counting what
        the trash is about to free)."""
        return self.min_free + self.reserved + n - self.disk_free()

    def needs_room(self, n: int) -> bool:
        """Must a write of `n` more bytes call reserve() first?"""
        if self._over(n) > 0:
            return True
        return bool(self.engine.hot.trash.waiting) and self._disk_short(n) > 0

    def evict(self, need: int, spare_busy: bool = True) -> int:
        """Drop clean, unpinned extents (LRU first) until `need` bytes are freed;
        a task goes on down to the low watermark, EVICT_BATCH extents per pass of the
        trio loop, so that no request waits for more than its own room. Returns bytes
        freed. Extents that a write is preparing are spared unless `spare_busy` is
        False (then the write fetches them again: slower, never wrong)."""
        if need <= 0:
            return 0
        freed = self._drop_lru(need, spare_busy)
        self._evict_on()
        return freed

    def _evict_on(self) -> None:
        nursery = getattr(self.engine, "nursery", None)  # none before the mount runs
        if not self._evicting and self.index.total > self.low and nursery is not None:
            self._evicting = True
            nursery.start_soon(self._evict_down)

    async def _evict_down(self) -> None:
        try:
            while self.index.total > self.low:
                if not self._drop_lru(self.index.total - self.low, True, EVICT_BATCH):
                    break
                await trio.sleep(0)
        except Exception:  # a background task: its error must not end the mount
            log.exception("evicting from the hot tier failed; the next write tries again")
        finally:
            self._evicting = False

    def _drop_lru(self, target: int, spare_busy: bool, limit: int | None = None) -> int:
        """Evict least recently used clean extents until `target` bytes are freed
        (or `limit` extents looked at); bytes freed."""
        freed = 0
        batch = {}
        skipped = []
        meta = self.engine.meta
        looked = 0
        try:
            while freed < target and self.index.lru and (limit is None or looked < limit):
                looked += 1
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
            if batch:
                # The records first (no await until the files are gone): a failed commit
                # (a full disk under LMDB) then leaves every copy in place and counted.
                meta.update(None, batch)
        except BaseException:
            for key in batch:
                self.index.lru[key] = None
            raise
        finally:
            for key in skipped:
                self.index.lru[key] = None
        for ino, idx in batch:
            self.engine.forget_hot(ino, idx)
        if batch:
            self.engine.stats.inc("evictions", len(batch))
            self._free_cache = (0.0, 0)
        return freed

    def room_now(self, n: int) -> bool:
        """Is there room for `n` more bytes once clean extents are evicted, without
        waiting for anything? (Evicts what it takes.)"""
        over = self._over(n)
        if over > 0:
            self.evict(over)
        return self._over(n) <= 0

    def admit_without_evicting(self, n: int) -> bool:
        """Reserve room for `n` bytes of speculative fetches (read-around) only if it is
        free now: they never push out data already hot. release(n) afterwards."""
        if self._over(n) > 0:
            return False
        self.reserved += n
        return True

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

    def keeps_fetch(self, n: int) -> bool:
        """Would a fetch of `n` bytes for a read be kept hot now? (admit_fetch's answer,
        without its evictions: no-replace keeps one only while there is room.)"""
        return self.policy != "no-replace" or self._over(n) <= 0

    def release(self, n: int) -> None:
        """An admitted fetch is installed (or failed): its room is evictable again."""
        self.reserved -= n
        self._wake_writers()

    async def reserve(self, n: int) -> None:
        """Wait until `n` bytes of new hot data fit; ENOSPC if they never can or the
        hot tier has been stuck for longer than wait_limit."""
        waited_for_trash = False
        while True:
            over = self._over(n)
            if over <= 0:
                trash = self.engine.hot.trash
                if waited_for_trash or not (trash.waiting and self._disk_short(n) > 0):
                    return
                # The room is in files the trash has yet to empty (once, bounded).
                await trio.to_thread.run_sync(trash.settle, trash_module.WAIT)
                self._free_cache = (0.0, 0)
                waited_for_trash = True
                continue
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
