"""Garbage collector: deletes bucket objects that no committed metadata references.

Objects enter the gc table in the same LMDB transaction that drops their last
reference, so an object is deleted only after that change is committed, and synced
to disk first.
"""
from __future__ import annotations

import logging
import time

import trio

from ..errors import ColdStoreError, FsError
from ..meta.schema import object_name
from .failure_log import FailureLog

log = logging.getLogger(__name__)


class GarbageCollector:
    def __init__(self, engine, interval: float = 2.0, batch: int = 256, *, meta=None,
                 grace: float = 0.0):
        """`meta`: the store whose gc table this collects (default: the engine's; a
        shared one is called in worker threads). `grace`: seconds an object waits
        after it is first seen in the table (other nodes may still read it)."""
        self.engine = engine
        self.meta = meta or engine.meta
        self.shared = meta is not None and meta.kv.shared
        self.interval = interval
        self.batch = batch
        self.grace = grace
        # object id -> (its queue record, when this queueing was first seen: monotonic)
        self._seen: dict[int, tuple[bytes, float]] = {}
        self.paused = lambda: False  # e.g. while this node is fenced off
        # Blocking lease check before deleting: a node taken over must not delete
        # objects that the new holder's metadata still references.
        self.still_ours = lambda: True
        self.delete_failures = FailureLog(log, "gc: deleting objects")

    async def run(self) -> None:
        failing = False
        while True:
            await trio.sleep(self.interval)
            self.engine.stats.inc("gc_passes")
            try:
                while await self.collect() >= self.batch:
                    pass  # a backlog (overwrites): keep deleting before sleeping again
            except FsError as e:  # a shared namespace's database is away: next pass
                if not failing:
                    log.warning("gc: the metadata store failed (%s); will retry", e)
                failing = True
                continue
            failing = False

    async def _call(self, fn, *args):
        if self.shared:
            return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)
        return fn(*args)

    def _ripe(self, queued: list[tuple[int, int, bytes]]) -> list[tuple[int, int]]:
        """(id, epoch) of the `queued` objects first seen at least `grace` seconds ago
        with the queue record they have now. An object that left the queue (a publish
        named it again) and came back has a new record, so its grace starts again."""
        if not self.grace:
            return [(i, epoch) for i, epoch, _record in queued]
        now = time.monotonic()
        seen = {}
        for obj_id, _epoch, record in queued:
            known = self._seen.get(obj_id)
            seen[obj_id] = known if known and known[0] == record else (record, now)
        self._seen = seen  # objects no longer queued are forgotten
        return [(i, epoch) for i, epoch, _record in queued if now - seen[i][1] >= self.grace]

    async def collect(self) -> int:
        meta, cold = self.meta, self.engine.cold
        if self.paused():
            return 0
        # Kept checkpoints may still reference an object dropped in epoch e.
        queued = await self._call(meta.gc_queue, 16 * self.batch)
        ids = [i for i, epoch in self._ripe(queued) if self.engine.gc_guard(epoch)]
        ids = ids[:self.batch]
        if not ids:
            return 0

        if not self.shared:
            # LMDB commits without fsync: the changes that dropped these objects go to
            # disk first, or a power cut could bring back records naming them.
            await self.engine.meta_sync.commits_so_far()

        def delete_all() -> bool:
            if not self.still_ours():
                return False  # taken over: the lease check fenced this node
            for obj_id in ids:
                cold.delete(object_name(obj_id))
            return True

        try:
            deleted = await trio.to_thread.run_sync(delete_all, limiter=self.engine.s3_limiter,
                                                    abandon_on_cancel=True)
        except ColdStoreError as e:
            self.delete_failures.failed(e)
            return 0
        if not deleted:
            return 0
        self.delete_failures.worked()
        await self._call(meta.gc_done, ids)
        for obj_id in ids:
            self._seen.pop(obj_id, None)
        self.engine.stats.inc("gc_deleted", len(ids))
        return len(ids)
