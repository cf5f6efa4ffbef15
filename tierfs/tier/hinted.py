"""Prefetch of hinted files: a queue worked through in order, many files at a
time, ahead of the data loader that sent the hints."""
from __future__ import annotations

import collections
import logging

import trio

from ..errors import TierfsError
from . import actions

log = logging.getLogger(__name__)


class HintQueue:
    # More files in flight than a data loader's workers read at once: that is
    # what hints buy against a bucket's latency.
    def __init__(self, engine, parallel: int = 32):
        self.engine = engine
        self.parallel = parallel
        self.queue: collections.deque[int] = collections.deque()
        self._wake = trio.Event()
        self.done = 0

    def add(self, inos: list[int], replace: bool) -> None:
        if replace:
            self.queue.clear()
        self.queue.extend(inos)
        self._wake.set()

    async def run(self) -> None:
        limiter = trio.Semaphore(self.parallel)  # released by the task it hands off to
        async with trio.open_nursery() as nursery:
            while True:
                if not self.queue:
                    self._wake = trio.Event()
                    await self._wake.wait()
                    continue
                await limiter.acquire()
                if not self.queue:
                    limiter.release()
                    continue
                nursery.start_soon(self._one, self.queue.popleft(), limiter)

    async def _one(self, ino: int, limiter) -> None:
        try:
            await actions.prefetch(self.engine, ino, parallel=1, for_write=False)
            self.done += 1
            self.engine.stats.inc("hinted_files")
        except TierfsError as e:
            log.debug("hinted prefetch of inode %d failed: %s", ino, e)
        finally:
            limiter.release()
