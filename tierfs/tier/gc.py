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
        # Where the next pass reads the queue from: objects that cannot go yet (a
        # kept checkpoint holds them, the bucket refuses) must not fill every
        # pass's window and hide the ones behind them for ever.
        self._resume_at = 0
        self.paused = lambda: False  # e.g. while this node is fenced off
        # Blocking lease check before deleting: a node taken over must not delete
        # objects that the new holder's metadata still references.
        self.still_ours = lambda: True
        self.delete_failures = FailureLog(log, "gc: deleting objects")
        # Objects the bucket refuses to delete (a hold on them) fail pass after pass: a
        # story of their own, or they would hide an outage and its end for ever.
        self.refusals = FailureLog(log, "gc: deleting objects")

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

    def _ripe(self, queued: list[tuple[int, int, bytes]], start: int, end: int
              ) -> tuple[list[tuple[int, int]], bool]:
        """(id, epoch) of the `queued` objects (the whole queue from id `start` to
        `end`, excluded) first seen at least `grace` seconds ago with the queue
        record they have now, and whether others are still within their grace. An
        object that left the queue (a publish named it again) and came back has a
        new record, so its grace starts again."""
        if not self.grace:
            return [(i, epoch) for i, epoch, _record in queued], False
        now = time.monotonic()
        # Objects of this range no longer queued are forgotten; others wait their turn.
        seen = {i: v for i, v in self._seen.items() if not start <= i < end}
        for obj_id, _epoch, record in queued:
            known = self._seen.get(obj_id)
            seen[obj_id] = known if known and known[0] == record else (record, now)
        self._seen = seen
        ripe = [(i, epoch) for i, epoch, _record in queued if now - seen[i][1] >= self.grace]
        return ripe, len(ripe) < len(queued)

    async def collect(self) -> int:
        meta, cold = self.meta, self.engine.cold
        if self.paused():
            return 0
        window, start = 16 * self.batch, self._resume_at
        queued = await self._call(meta.gc_queue, window, start)
        end = queued[-1][0] + 1 if len(queued) >= window else 1 << 64
        ripe, waiting = self._ripe(queued, start, end)
        # Kept checkpoints may still reference an object dropped in epoch e.
        ripe = [i for i, epoch in ripe if self.engine.gc_guard(epoch)]
        ids = ripe[:self.batch]
        # The next pass reads on after the last object this one tries (or the end
        # of its window); from the start again once it reached the queue's end. A
        # window with objects within their grace is read again until they ripen:
        # only what was seen is remembered, so memory stays bounded by the window.
        if len(ripe) > len(ids):
            end = ids[-1] + 1
        elif waiting:
            end = start
        self._resume_at = end if end < 1 << 64 else 0
        if not ids:
            return 0

        if not self.shared:
            # LMDB commits without fsync: the changes that dropped these objects go to
            # disk first, or a power cut could bring back records naming them.
            await self.engine.meta_sync.commits_so_far()

        def delete_all() -> tuple[list[int], ColdStoreError | None]:
            """(the ids deleted, the last error). An object the bucket refuses to
            delete (a hold on it) is left for a later pass, the others still go; a
            transient error (an outage) ends the batch."""
            deleted, error = [], None
            if not self.still_ours():
                return deleted, error  # taken over: the lease check fenced this node
            for obj_id in ids:
                try:
                    cold.delete(object_name(obj_id))
                except ColdStoreError as e:
                    error = e
                    if e.transient:
                        break
                    continue
                deleted.append(obj_id)
            return deleted, error

        try:
            deleted, error = await trio.to_thread.run_sync(
                delete_all, limiter=self.engine.s3_limiter, abandon_on_cancel=True)
        except ColdStoreError as e:  # the lease could not be read
            deleted, error = [], e
        refused = error is not None and not error.transient
        if error is not None and not refused:
            self.delete_failures.failed(error)
        elif deleted or refused:  # the bucket answered
            self.delete_failures.worked()
        if refused:
            self.refusals.failed(error)
        elif deleted:
            self.refusals.worked()
        if not deleted:
            return 0
        await self._call(meta.gc_done, deleted)
        for obj_id in deleted:
            self._seen.pop(obj_id, None)
        self.engine.stats.inc("gc_deleted", len(deleted))
        return len(deleted)
