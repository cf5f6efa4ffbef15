"""Syncs of the metadata database, shared by everyone waiting for one (group commit).

Between syncs the database is written without fsync: its commits survive a killed
daemon, not a power cut. A caller that needs its commits durable before it goes on
(fsync; an uploaded extent before its hot copy may be dropped) awaits
`commits_so_far()`: a sync that starts after the call covers them, and callers that
arrive while one runs share the next one.
"""
from __future__ import annotations

import trio


class MetaSync:
    def __init__(self, meta, limiter: trio.CapacityLimiter):
        self.meta = meta
        self.limiter = limiter
        self._started = 0     # syncs started so far
        self._finished = 0    # the number of the newest sync that succeeded
        self._running: trio.Event | None = None  # set when the sync running now ends

    async def commits_so_far(self) -> None:
        """Return once every commit made before this call is durable; raises the
        sync's OSError if it failed (nothing is known durable then)."""
        need = self._started + 1  # the next sync to start is the first that covers us
        while self._finished < need:
            if self._running is not None:
                await self._running.wait()  # it may have started before our commits
                continue
            self._started += 1
            number, self._running = self._started, trio.Event()
            try:
                await trio.to_thread.run_sync(self.meta.sync, limiter=self.limiter)
                self._finished = max(self._finished, number)
            finally:
                ended, self._running = self._running, None
                ended.set()
