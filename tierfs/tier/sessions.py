"""Sessions of a shared namespace: this mount's heartbeat, and the end of other
nodes' sessions once theirs stops.

Every mount of a shared engine registers a session (MetaStore.open_session) and
renews its heartbeat every timeout/3. Any node that finds another's heartbeat
older than the timeout ends that session: the files it held open after their
last name was gone are purged, its unfinished uploads go to gc, and what it
never uploaded is reported (those files read as EIO, naming the node). A mount
whose own session was ended meanwhile (it was away longer than the timeout) is
fenced: its state no longer counts, so it refuses changes.

An outage of the database stops every heartbeat at once, so when it ends all
of them are as old as the outage. A node therefore judges the others only after
a whole timeout in which its own heartbeats came on time (each within a third
of the timeout): by then every live node has beaten its heart again. The end of
a session re-checks the heartbeat in its own transaction and decides nothing if
the engine held the call up (a new outage), see MetaStore.end_session.
"""
from __future__ import annotations

import functools
import logging
import time

import trio

from ..errors import FsError, SessionLost
from .state import NodeState
from .stats import Stats

log = logging.getLogger(__name__)


class SessionKeeper:
    def __init__(self, shared, state: NodeState, stats: Stats, *, timeout: float):
        self.shared = shared
        self.state = state
        self.stats = stats
        self.timeout = timeout
        self.sid = shared.session
        self._limiter = trio.CapacityLimiter(1)

    async def _call(self, fn, *args):
        # A limiter of its own: a heartbeat must not queue behind other worker threads.
        return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=True,
                                             limiter=self._limiter)

    async def run(self) -> None:
        on_time_since = time.monotonic()  # open_session() has just committed
        while not self.state.fenced:
            await trio.sleep(self.timeout / 3)
            started = time.monotonic()
            try:
                await self._call(self.shared.heartbeat)
                now = time.monotonic()
                if now - started > self.timeout / 3:  # held up: the database was away
                    log.info("session %d: the heartbeat took %.1f s; judging other "
                                "sessions again after %.0f s of heartbeats on time",
                                self.sid, now - started, self.timeout)
                    on_time_since = now
                elif now - on_time_since >= self.timeout:
                    await self.end_expired()
                    self.stats.inc("session_checks")
            except SessionLost as e:
                self.state.fence(f"another node ({e})")
                return
            except FsError as e:  # the database is away: the engine already waited
                log.warning("session %d: heartbeat failed (%s); trying again", self.sid, e)
                on_time_since = time.monotonic()

    def still_mine(self) -> bool:
        """Blocking: whether this session still stands (sync --wait asks before it
        answers that data is durable)."""
        try:
            self.shared.heartbeat()
            return True
        except SessionLost:
            return False

    def release(self) -> None:
        """Blocking: end this mount's session (a clean unmount)."""
        if self.shared.session is not None:
            self.shared.end_session(self.sid)

    async def end_expired(self) -> list[str]:
        """End the sessions whose heartbeat is older than the timeout; one line each."""
        lines = []
        for session in await self._call(self.shared.expired_sessions, self.timeout):
            held = [(ino, n) for ino, sid, n, _node in await self._call(self.shared.held)
                    if sid == session.sid]
            ended = await self._call(functools.partial(
                self.shared.end_session, session.sid, stale_s=self.timeout,
                decide_by=time.monotonic() + self.timeout / 3))
            if ended is None:
                continue  # it beat its heart meanwhile, or the database was away
            purged, intents = ended
            line = (f"ended the expired session {session.sid} of {session.node} "
                    f"(pid {session.pid}, {session.mountpoint}): purged {purged} unlinked "
                    f"open files, collected {intents} unfinished uploads")
            if held:
                line += (f"; it never uploaded {sum(n for _i, n in held)} bytes of "
                         f"{len(held)} files (inodes {', '.join(str(i) for i, _ in held[:10])}"
                         f"{', ...' if len(held) > 10 else ''}), which read as EIO")
                log.error("%s", line)
            else:
                log.warning("%s", line)
            lines.append(line)
        return lines
