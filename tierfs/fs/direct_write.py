"""Direct writes: a client that opened a file for writing through the mount gets
descriptors of its hot extent files and writes them with pwrite, no FUSE round trip
per request (client: tierfs/direct_writer.py).

The client opens the file on the mount itself, so the kernel does everything open(2)
does there (permissions, O_CREAT/O_EXCL/O_TRUNC, umask, setgid directories), and
names that descriptor in its first request. The daemon reads its /proc/PID/fdinfo
(the peer's pid comes from SO_PEERCRED): in one read, the access mode, the mount it
was opened through and the inode; it must be open for writing and be a regular file
of this mount. Holding it proves the open. The daemon never holds a
descriptor of its own mount: closing one as it dies (kill -9) would ask itself to
flush and never exit.

Request:  {"cmd": "direct_write", "op": "open", "fd": n, "keep": true}
          {"cmd": "direct_write", "session": S, "release": [k, ...],
           "hold": [first, last], "close": false, "keep": true}
Reply:    for "open": {"ok": true, "session": S, "ino": N, "extent_size": E}
          for a hold: {"direct": [{"extents": [[k, "fd"], ...]}], "fds": n} with its n
          descriptors (a prefix of [first, last]; at least `first`), then
          {"ok": true, "size": file size}
"release" lists extents whose descriptors the client has closed; "close" releases
all and ends the session. A connection that ends (the client exited or was killed)
ends its sessions the same way: what was written stays written. Whenever extents
are released for good, the kernel is told the new size and drops its cached pages
of the file (the client, at close, also sets mtime through its descriptor: with the
writeback cache the kernel keeps its own).
"""
from __future__ import annotations

import errno
import itertools
import logging
import os
import signal
import socket
import stat
import struct

import pyfuse3
import trio

from ..errors import FsError, TierfsError
from ..tier.direct_write import DirectWrites
from .direct import MAX_FDS, SHARED_NAMESPACE, _Line

log = logging.getLogger(__name__)

KERNEL_TIMEOUT = 30.0  # seconds for telling the kernel (it may write pages back first)
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux 6.5: the connector's pidfd


class _Session:
    __slots__ = ("sid", "ino", "readable", "held")

    def __init__(self, sid: int, ino: int, readable: bool):
        self.sid, self.ino, self.readable = sid, ino, readable
        self.held: set[int] = set()


class DirectWrite:
    """The daemon's side of tierfs.open() for writing."""

    def __init__(self, daemon):
        self.daemon = daemon
        self.engine = daemon.engine
        self.meta = daemon.meta
        self.stats = self.engine.stats
        self.holds = DirectWrites(self.engine)
        self._ids = itertools.count(1)
        self._mount_dev: int | None = None

    async def cmd_direct_write(self, req, reply):
        if self.daemon.shared is not None:
            raise TierfsError(SHARED_NAMESPACE)
        sessions = reply.conn.get("write_sessions")
        if sessions is None:
            sessions = reply.conn["write_sessions"] = {}
            reply.conn.setdefault("on_close", []).append(self._end_all)
        if req.get("op") == "open":
            return await self._open(req, reply, sessions)
        try:
            session = sessions[int(req["session"])]
        except (KeyError, TypeError, ValueError):
            raise FsError(errno.EBADF, "no such direct write session") from None
        ino = session.ino
        released = [i for i in _extent_numbers(req.get("release") or [], "release")
                    if i in session.held]
        if released:
            session.held.difference_update(released)
            self.holds.release(ino, released)
        # Its later reads through the mount must see them; so must writes through the
        # mount ("tell": the writer handed out its descriptor on the mount).
        if (released and session.readable) or req.get("tell"):
            await self._tell_kernel(ino)
        if req.get("close"):
            await self._end(session, sessions)
            return {"size": self.meta.get_inode(ino).size}
        hold = req.get("hold")
        if not hold:
            return {"size": self.meta.get_inode(ino).size}
        if len(_extent_numbers(hold, "hold")) != 2:
            raise TierfsError('bad request: "hold" must be [first, last] extent numbers')
        first, last = hold
        last = min(last, first + MAX_FDS - 1)
        flags = os.O_RDWR if session.readable else os.O_WRONLY
        granted = await self.holds.hold(ino, first, last, flags)
        fds = [fd for _i, fd in granted]
        session.held.update(i for i, _fd in granted)
        self.stats.inc("direct_write_extents", len(granted))
        line = _Line(reply.stream)
        try:
            await line.add({"extents": [[i, "fd"] for i, _fd in granted]}, fds)
            await line.flush(final={"ok": True, "size": self.meta.get_inode(ino).size})
            reply.finished = True
        finally:
            line.close()
        return None

    async def _open(self, req, reply, sessions) -> dict:
        try:
            fd = int(req["fd"])
        except (KeyError, TypeError, ValueError):
            raise TierfsError("direct_write open needs the number of the client's "
                              "descriptor of the file on the mount") from None
        pid, uid = _peer_pid(reply.stream.socket)
        if pid <= 0:  # the kernel could not name it in our pid namespace
            raise TierfsError("the daemon cannot see the writing process (it runs in another "
                              "pid namespace): direct writes need a daemon that shares the "
                              "host's pid namespace (hostPID in Kubernetes)")
        try:
            access, dev, ino = await trio.to_thread.run_sync(
                _look_at_peer, reply.stream.socket, pid, uid, fd)
        except FileNotFoundError:
            raise FsError(errno.EBADF, "no such descriptor in the client") from None
        except PermissionError:
            raise FsError(errno.EPERM, "the daemon may not read /proc/PID/fdinfo of the "
                                       "writer (another user's process, or one with "
                                       "capabilities the daemon lacks): it needs "
                                       "CAP_SYS_PTRACE (docker run --cap-add SYS_PTRACE)"
                          ) from None
        except KeyError:
            raise TierfsError("the kernel does not show which file a descriptor is "
                              "(/proc/PID/fdinfo without ino: Linux 5.14 or later)") from None
        if access == os.O_RDONLY:
            raise FsError(errno.EBADF, "the descriptor is not open for writing")
        if dev != await self._our_dev():
            raise FsError(errno.EXDEV, "not a file of this mount")
        self.engine.state.check_writable()
        if not stat.S_ISREG(self.meta.get_inode(ino).mode):
            raise FsError(errno.EBADF, "not a regular file")
        session = _Session(next(self._ids), ino, access == os.O_RDWR)
        sessions[session.sid] = session
        self.stats.inc("direct_write_files")
        return {"session": session.sid, "ino": ino, "extent_size": self.engine.E}

    async def _our_dev(self) -> int:
        if self._mount_dev is None:
            st = await trio.to_thread.run_sync(os.stat, self.daemon.cfg.mountpoint)
            self._mount_dev = st.st_dev
        return self._mount_dev

    async def _end_all(self, conn: dict) -> None:
        """The client's connection ended: end its sessions, keeping what it wrote."""
        sessions = conn.get("write_sessions") or {}
        for session in list(sessions.values()):
            log.debug("direct writer of inode %d went away; keeping what it wrote",
                      session.ino)
            await self._end(session, sessions)

    async def _end(self, session: _Session, sessions: dict) -> None:
        """Release every extent of a session and tell the kernel."""
        sessions.pop(session.sid, None)
        if session.held:
            self.holds.release(session.ino, sorted(session.held))
            session.held.clear()
        await self._tell_kernel(session.ino)

    async def _tell_kernel(self, ino: int) -> None:
        """Drop the kernel's cached pages and attributes of a file and grow its idea of
        the size (with the writeback cache it trusts its own). Off this thread: the
        kernel may first write dirty pages back through us. Bounded: a kernel that does
        not take it is logged, not waited for."""
        with trio.CancelScope(shield=True), trio.move_on_after(KERNEL_TIMEOUT) as scope:
            try:
                size = self.meta.get_inode(ino).size
                # The kernel grows its size only for stored bytes: give it the last one.
                last = bytes(await self.engine.read(ino, size - 1, 1)) if size else b""
            except FsError:
                return  # purged (nothing to tell), or its last extent unreadable
            await trio.to_thread.run_sync(_notify_kernel, ino, size, last,
                                          abandon_on_cancel=True)
        if scope.cancelled_caught:
            log.warning("inode %d: the kernel did not take the size a direct writer "
                        "left within %.0fs", ino, KERNEL_TIMEOUT)


def _extent_numbers(value, name: str) -> list[int]:
    """`value`, a list of extent numbers; TierfsError naming `name` where it is none
    (any local user may send a request: a wrong one gets an answer, not a traceback)."""
    if not isinstance(value, list) or not all(
            type(i) is int and 0 <= i < 1 << 63 for i in value):
        raise TierfsError(f'bad request: "{name}" must be a list of extent numbers')
    return value


def _peer_pid(sock) -> tuple[int, int]:
    """(pid, effective uid) of the process that connected, as of its connect."""
    pid, uid, _gid = struct.unpack("iII", sock.getsockopt(
        socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("iII")))
    return pid, uid


def _look_at_peer(sock, pid: int, uid: int, fd: int) -> tuple[int, int | None, int]:
    """_look_at() of the process that connected, and of no other: a pid is a number
    the kernel gives again once its process ended, and the socket may have passed to
    another process meanwhile. The connector must still live (its pidfd, where the
    kernel gives one) after the read, and the process read must be of its user."""
    try:
        pidfd = sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError:
        pidfd = None  # before Linux 6.5: the uid check alone
    try:
        with open(f"/proc/{pid}/status") as f:
            uids = next(line for line in f if line.startswith("Uid:")).split()[1:]
        if int(uids[1]) != uid:  # effective uid
            raise FileNotFoundError(f"process {pid} is not the one that connected")
        out = _look_at(pid, fd)
        if pidfd is not None:
            try:
                signal.pidfd_send_signal(pidfd, 0)
            except ProcessLookupError:
                raise FileNotFoundError(f"process {pid} that connected is gone") from None
        return out
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _look_at(pid: int, fd: int) -> tuple[int, int | None, int]:
    """(access mode, device, inode) of descriptor `fd` of process `pid`, from one read of
    its fdinfo (one view of one open file: swapping the descriptor meanwhile cannot mix
    two files), the device from the mount it was opened through. Nothing is opened."""
    with open(f"/proc/{pid}/fdinfo/{fd}") as f:
        info = dict(line.split(":", 1) for line in f if ":" in line)
    flags, mnt_id, ino = int(info["flags"], 8), int(info["mnt_id"]), int(info["ino"])
    dev = None  # not a mount of its namespace (a pipe, a socket): not ours either
    with open(f"/proc/{pid}/mountinfo") as f:
        for line in f:
            fields = line.split()
            if int(fields[0]) == mnt_id:
                major, minor = fields[2].split(":")
                dev = os.makedev(int(major), int(minor))
                break
    return flags & os.O_ACCMODE, dev, ino


def _notify_kernel(ino: int, size: int, last: bytes) -> None:
    try:
        pyfuse3.invalidate_inode(ino, False)
        if last:
            pyfuse3.notify_store(ino, size - len(last), last)
    except OSError as e:  # ENOENT: the kernel does not know the inode (nothing cached)
        log.debug("telling the kernel about inode %d: %s", ino, e)
