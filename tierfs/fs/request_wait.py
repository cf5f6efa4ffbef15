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
"""
from __future__ import annotations

import select
import types

import pyfuse3
import trio

MAX_STREAK = 64


class RequestWaiter:
    def __init__(self, stats) -> None:
        self.stats = stats
        self._polls: dict[int, select.poll] = {}
        self._streak = 0

    async def wait_readable(self, fd) -> None:
        if self._streak < MAX_STREAK:
            poll = self._polls.get(fd)
            if poll is None:
                poll = self._polls[fd] = select.poll()
                poll.register(fd, select.POLLIN)
            if poll.poll(0):
                self._streak += 1
                self.stats.inc("fuse_requests_queued")
                return
        self._streak = 0
        await trio.lowlevel.wait_readable(fd)


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
