"""Cheaper waits for the next FUSE request.

pyfuse3's request loop asks trio to wait until /dev/fuse is readable before it
reads every request. Through trio's epoll each wait costs an epoll_ctl, an
epoll_wait and a trip through the scheduler: about a third of the daemon's CPU
when small requests stream in. When requests are already queued, a zero-timeout
poll says so for one cheap syscall and the wait can return at once; trio's own
wait runs only when the queue is empty, and at least every MAX_STREAK requests
so that background tasks (uploads, timers) keep their turn. docs/architecture.md
(Round trips) has the profile and the measured effect.

pyfuse3 looks `trio` up in its module globals at call time, so the faster wait
is given to pyfuse3 alone through a copy of the trio namespace; every other
user of trio is untouched. If a pyfuse3 release stops looking it up that way,
this simply has no effect.

The waiter also lets background work on the trio thread give way to requests
(give_way): installing the hot copies of a run of fetched files, or planning the
next hinted GET, costs milliseconds per step, and a request that arrives meanwhile
waits for every such step the scheduler runs before it. At the start of a cold
epoch, while the hinted GETs bring in most of the data set at once, a data loader's
first batch waited that way for files already hot.
"""
from __future__ import annotations

import select
import types

import pyfuse3
import trio

MAX_STREAK = 64
GIVE_WAY_MAX_S = 0.05


class RequestWaiter:
    def __init__(self, stats) -> None:
        self.stats = stats
        self._polls: dict[int, select.poll] = {}
        self._streak = 0
        self._drained = trio.Event()  # set each time the queue is found empty

    async def wait_readable(self, fd) -> None:
        poll = self._polls.get(fd)
        if poll is None:
            poll = self._polls[fd] = select.poll()
            poll.register(fd, select.POLLIN)
        if self._streak < MAX_STREAK:
            if poll.poll(0):
                self._streak += 1
                self.stats.inc("fuse_requests_queued")
                return
            self._drained.set()
            self._drained = trio.Event()
        self._streak = 0
        await trio.lowlevel.wait_readable(fd)

    def requests_queued(self) -> bool:
        """Whether FUSE requests wait unread (a zero-timeout poll; a closed device, at
        unmount, holds none)."""
        return any(events & select.POLLIN
                   for poll in self._polls.values() for _fd, events in poll.poll(0))

    async def give_way(self) -> None:
        """Called by background work on the trio thread before each of its steps:
        while requests wait unread, wait until they are all read (GIVE_WAY_MAX_S at
        most, so that background work goes on under a steady stream of requests)."""
        if self.requests_queued():
            self.stats.inc("background_gave_way")
            with trio.move_on_after(GIVE_WAY_MAX_S):
                await self._drained.wait()


def install(stats) -> RequestWaiter:
    """Give pyfuse3 (only) the fast request wait; requests found already queued
    are counted in `stats` as fuse_requests_queued."""
    waiter = RequestWaiter(stats)
    lowlevel = types.ModuleType("trio.lowlevel")
    lowlevel.__dict__.update(trio.lowlevel.__dict__)
    lowlevel.wait_readable = waiter.wait_readable
    shim = types.ModuleType("trio")
    shim.__dict__.update(trio.__dict__)
    shim.lowlevel = lowlevel
    pyfuse3.trio = shim
    return waiter
