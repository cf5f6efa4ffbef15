"""Sessions of a shared namespace: this mount's heartbeat, and the end of other
nodes' sessions once theirs stops.

Every mount of a shared engine registers a session (MetaStore.open_session) and
renews its heartbeat every timeout/3. Any node that finds another's heartbeat
older than the timeout ends that session: the files it held open after their
last name was gone are purged, its unfinished uploads go to gc, and what it
never uploaded is reported (those files read as EIO, naming the node). A mount
whose own session was ended meanwhile (it was away longer than the timeout) is
fenced: its state no longer counts, so it refuses changes.
"""
from __future__ import annotations

import logging

import trio

from ..errors import FsError, SessionLost
from .state import NodeState

log = logging.getLogger(__name__)


class SessionKeeper:
    def __init__(self, shared, state: NodeState, *, timeout: float):
        self.shared = shared
        self.state = state
        self.timeout = timeout
        self.sid = shared.session
        self._limiter = trio.CapacityLimiter(1)

    async def _call(self, fn, *args):
        # A limiter of its own: a heartbeat must not queue behind other worker threads.
        return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=True,
                                             limiter=self._limiter)

    async def run(self) -> None:
        while not self.state.fenced:
            await trio.sleep(self.timeout / 3)
            try:
                await self._call(self.shared.heartbeat)
                await self.end_expired()
            except SessionLost as e:
                self.state.fence(f"another node ({e})")
                return
            except FsError as e:  # the database is away: the engine already waited
                log.warning("session %d: heartbeat failed (%s); trying again", self.sid, e)

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
            purged, intents = await self._call(self.shared.end_session, session.sid)
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
