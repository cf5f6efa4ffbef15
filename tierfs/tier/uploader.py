"""Write-back: upload dirty extents to the bucket after a delay since their last
write, with bounded parallelism. While any extent was written within the delay
(a checkpoint is being written), uploads wait up to MAX_WAIT_FACTOR delays, so
the writer has the CPU and the disk; `sync`, unmount and a full hot tier do not
wait.

An upload reads the extent in a worker thread, checksums it, puts it under a
fresh object id and then, back on the trio thread, marks the extent clean only
if nobody wrote to it meanwhile (write generation unchanged). Superseded and
unneeded objects go to the gc table in the same transaction.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import replace

import trio

from ..checksum import xxh3
from ..errors import ColdStoreError, FsError
from ..meta.schema import DIRTY, object_name
from .cache import Key

log = logging.getLogger(__name__)

MAX_WAIT_FACTOR = 4


class Uploader:
    def __init__(self, engine, space, *, delay: float, parallel: int):
        self.engine = engine
        self.space = space
        self.delay = delay
        self.limit = trio.CapacityLimiter(parallel)
        self.in_flight: set[Key] = set()
        self.urgent: set[int] | None = None   # inodes to upload now (sync), None = none
        self._wake = trio.Event()
        self.changed = trio.Event()           # fires after every finished upload
        self.failures = 0
        self.last_error: str | None = None   # of the latest failed upload, for sync/status
        self.backoff_until = 0.0
        self.paused = lambda: False  # e.g. while this node is fenced off
        space.kick_uploader = self.kick

    def kick(self) -> None:
        self._wake.set()

    def _due(self, now: float) -> list[Key]:
        if self.paused():
            return []
        urgent_all = self.space.need_upload.is_set()
        urgent = self.urgent or set()
        dirty = self.engine.index.dirty
        # While the mount is being written, uploads wait (they would take CPU and disk
        # from the writer), but never longer than MAX_WAIT_FACTOR delays. Extents found
        # dirty at mount do not wait at all: whoever wrote them is gone.
        writing = any(now - info.last_write < self.delay for info in dirty.values())
        quiet_for = self.delay * (MAX_WAIT_FACTOR if writing else 1)
        due = []
        held = self.engine.index.held  # a direct writer is writing them
        for key, info in dirty.items():
            if key in self.in_flight or key in held:
                continue
            if (urgent_all or info.found or key[0] in urgent
                    or now - info.last_write >= quiet_for):
                due.append(key)
        return due

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            while True:
                now = time.monotonic()
                if now >= self.backoff_until:
                    for key in self._due(now):
                        self.in_flight.add(key)
                        nursery.start_soon(self._upload_one, key)
                    self.space.need_upload = trio.Event()
                with trio.move_on_after(min(0.5, max(self.delay / 2, 0.05))):
                    await self._wake.wait()
                self._wake = trio.Event()

    async def _upload_one(self, key: Key) -> None:
        try:
            async with self.limit:
                await self.upload(key)
        except ColdStoreError as e:
            self.failures += 1
            self.engine.stats.inc("upload_errors")
            # Back off so a bucket outage does not become a hot loop.
            self.backoff_until = time.monotonic() + min(30.0, 0.5 * 2 ** min(self.failures, 6))
            if self.last_error is None:  # once per outage, not once per extent
                log.warning("upload of inode %d extent %d failed (%s); will retry", *key, e)
            self.last_error = str(e)
        except Exception:
            log.exception("upload of inode %d extent %d failed", *key)
        finally:
            self.in_flight.discard(key)
            self.changed.set()
            self.changed = trio.Event()

    async def upload(self, key: Key) -> None:
        engine = self.engine
        ino, idx = key
        info = engine.index.dirty.get(key)
        if info is None or key in engine.index.held:
            # Taken by a direct writer since it was found due (this task may have waited
            # for a free upload slot): its generation no longer moves with its content.
            return
        gen = info.gen
        try:
            node, exts = engine.meta.get_extents(ino, idx, idx)
        except FsError:  # the inode was purged
            engine.index.remove(key)
            return
        ext = exts.get(idx)
        length = min(engine.E, node.size - idx * engine.E)
        if ext is None or not ext.dirty or length <= 0:
            engine.index.cleaned(key, gen)
            return
        fd = engine.hot.dup_fd(ino, idx)
        if fd is None:
            return  # removed meanwhile (truncate/unlink)
        obj_id = engine.meta.next_object_id()
        name = object_name(obj_id)

        def read_and_put() -> tuple[int, int]:
            try:
                data = os.pread(fd, length, 0)
            finally:
                os.close(fd)
            if len(data) < length:  # a hole at the end of the extent
                data += bytes(length - len(data))
            checksum = xxh3(data)
            engine.cold.put(name, data)
            return len(data), checksum

        t0 = time.monotonic()
        try:
            # Abandoned if cancelled (unmount): a bucket that never answers must not
            # hold the daemon; the intent stays, and the next mount cleans it up.
            size, checksum = await trio.to_thread.run_sync(
                read_and_put, limiter=engine.s3_limiter, abandon_on_cancel=True)
        except trio.Cancelled:
            raise
        except BaseException:
            # It may exist in the bucket; nothing references it: gc deletes it now.
            engine.meta.update(None, {}, unreferenced=[obj_id])
            raise
        engine.stats.inc("uploads")
        engine.stats.inc("upload_bytes", size)
        engine.stats.observe("upload_seconds", "", time.monotonic() - t0)
        if self.failures:
            log.info("uploads work again")
        self.failures = 0
        self.last_error = None
        # Back on the trio thread: is what we uploaded still the extent's content?
        try:
            _node, exts = engine.meta.get_extents(ino, idx, idx)
        except FsError:
            exts = {}
        cur = exts.get(idx)
        info = engine.index.dirty.get(key)
        if cur is None or not cur.dirty or info is None or info.gen != gen:
            # Written, truncated or removed meanwhile: a stale copy nobody references.
            engine.meta.update(None, {}, unreferenced=[obj_id])
            engine.stats.inc("uploads_superseded")
            return
        new = replace(cur, flags=cur.flags & ~DIRTY, length=size, checksum=checksum,
                      obj_id=obj_id, obj_off=0, obj_len=size)
        engine.meta.update(None, {key: new},
                           [(cur.obj_id, cur.obj_len)] if cur.obj_id else [], [obj_id])
        engine.index.cleaned(key, gen)
        engine.verified.add(key)  # the checksum was computed from this very hot copy
        self.space.uploaded()

    async def flush(self, inos: set[int] | None) -> None:
        """Upload every dirty extent of `inos` (all if None) now and wait for it."""
        index = self.engine.index

        def pending() -> bool:
            return any(inos is None or k[0] in inos for k in index.dirty)

        while pending():
            if inos is None:
                self.space.need_upload.set()
            else:
                self.urgent = (self.urgent or set()) | inos
            if self.failures:
                self.backoff_until = 0.0
            self.kick()
            await self.changed.wait()
        if inos is not None and self.urgent:
            self.urgent -= inos
