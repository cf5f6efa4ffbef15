"""Which mount a path is on, told by its name alone, with no stat of the path.

`open_many` asks the daemon for many files at once; the daemon checks each path
itself. Finding the mount by a stat of each file costs a FUSE lookup per file
whenever the kernel has not cached the file's name (after a page cache drop, or a
data set with more files than the dentry cache holds): the reader then waits on the
daemon's event loop once per file, which is what the batch request avoids.

A path is placed by name only when nothing about it needs the kernel's walk:
- it is absolute (or made so from the current directory) and has no '..' (which
  would mean what a symlink's target says);
- the longest mount point in this process's mount table that the path lies below
  is where the mount is (the top one, where several are stacked), so a filesystem
  mounted inside or over it is never skipped; stacked mounts whose top the table
  does not tell leave their paths to a stat;
- the table is the one last read: the kernel marks /proc/self/mountinfo with a
  priority event (POLLPRI) on every mount and unmount in the mount namespace, and it
  is read again then.
Symlinks below the mount point are the daemon's to follow, as for any direct open.
A path that fails any of these is stat()ed as before.

The same table tells where a filesystem is mounted (`roots_of`, for tierfs.open) and
where the tierfs mounts are (`points_of_type`, for accelerate()): `TABLE` is this
process's, read in one place.
"""
from __future__ import annotations

import io
import os
import select
import threading
import weakref

MOUNTINFO = "/proc/self/mountinfo"
_tables: "weakref.WeakSet[MountTable]" = weakref.WeakSet()


class MountTable:
    def __init__(self, path: str = MOUNTINFO) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._file = None
        self._pid = 0  # a forked child opens its own (its /proc/self is another file)
        self._poll = None
        # Every mount: (mount point, st_dev, the directory of its filesystem mounted
        # there, filesystem type); and per mount point, (st_dev, directory) of the top
        # mount there, the points longest first.
        self._entries: list[tuple[str, int, str, str]] = []
        self._points: dict[str, tuple[int, str]] = {}
        self._mounts: dict[int, tuple] = {}  # st_dev -> its mounts (mounts_of)
        self._unclear: set[str] = set()  # points of stacked mounts whose top is unclear
        self._reads = 0  # how often the table was read: a new number after every change
        _tables.add(self)

    def generation(self) -> int | None:
        """A number that changes whenever a filesystem was mounted or unmounted since
        (None: the table cannot be read). What was learnt about a device number holds
        while it stays the same: an unmounted filesystem's number may be given to the
        next one mounted."""
        with self._lock:
            return self._reads if self._fresh() else None

    def mounts_of(self, dev: int) -> tuple | None:
        """What identifies the mounts of the filesystem with device number `dev` now:
        their mount ids, points and directories (None: the table cannot be read). What
        was learnt about a device number holds while this stays the same, whatever is
        mounted elsewhere; a number an unmount freed goes with new mount ids."""
        with self._lock:
            if not self._fresh():
                return None
            return self._mounts.get(dev, ())

    def place(self, path) -> tuple[int, str] | None:
        """(st_dev, path inside that filesystem, from its root) of the mount `path`
        lies below by name, or None where only a stat can tell."""
        return self.place_all([path])[0]

    def place_all(self, paths) -> list:
        """place() of each of `paths`, the table read (if it changed) once for all."""
        with self._lock:
            if not self._fresh():
                return [None] * len(paths)
            return [self._place(path) for path in paths]

    def _place(self, path) -> tuple[int, str] | None:
        path = os.fsdecode(path)
        if ".." in path.split("/"):
            return None
        path = os.path.abspath(path)
        # The nearest mount point at or above the path is the longest one it lies
        # below: one dict lookup per directory level, whatever the number of mounts
        # (a container host has hundreds).
        point = path
        while (top := self._points.get(point)) is None:
            if point in self._unclear or point == "/":
                return None
            point = point[:point.rindex("/")] or "/"
        dev, root = top
        inner = path[len(point):].lstrip("/")
        return dev, os.path.join(root.lstrip("/"), inner).rstrip("/") or "."

    def roots_of(self, dev: int) -> list[tuple[str, str]]:
        """(mount point, directory of the filesystem mounted there) of every mount of
        the filesystem with device number `dev`, longest mount point first."""
        with self._lock:
            if not self._fresh():
                return []
            found = [(p, root) for p, d, root, _t in self._entries if d == dev]
        return sorted(found, key=lambda r: -len(r[0]))

    def points_of_type(self, fstype: str) -> tuple[str, ...]:
        """The mount points of the filesystems of type `fstype` ("fuse.tierfs")."""
        with self._lock:
            if not self._fresh():
                return ()
            return tuple(p for p, _d, _r, kind in self._entries if kind == fstype)

    def _fresh(self) -> bool:
        """Read the table if it changed since the last read (False: unreadable)."""
        try:
            if self._file is None or self._pid != os.getpid():
                self._open()
            elif self._poll.poll(0):
                self._read()
            return True
        except (OSError, ValueError, IndexError):
            self._close()
            return False

    def _open(self) -> None:
        self._close()
        self._file = io.open(self._path, "rb")
        self._pid = os.getpid()
        self._poll = select.poll()
        self._poll.register(self._file.fileno(), select.POLLPRI)
        self._read()

    def _read(self) -> None:
        self._file.seek(0)
        entries = []
        at: dict[str, list] = {}  # mount point -> [(id, parent id, st_dev, root)]
        by_dev: dict[int, list] = {}  # st_dev -> [(id, mount point, root)]
        for line in self._file.read().decode("utf-8", "surrogateescape").splitlines():
            left, _, right = line.partition(" - ")
            parts = left.split()
            major, minor = parts[2].split(":")
            point, root = unescape(parts[4]), unescape(parts[3])
            dev = os.makedev(int(major), int(minor))
            entries.append((point, dev, root, right.split(" ", 1)[0]))
            at.setdefault(point, []).append((parts[0], parts[1], dev, root))
            by_dev.setdefault(dev, []).append((parts[0], point, root))
        points, unclear = {}, set()
        for point, mounts in at.items():
            # Of mounts stacked at one point, the top one is no other's parent.
            under = {parent for _id, parent, _dev, _root in mounts}
            top = [m for m in mounts if m[0] not in under]
            if len(top) == 1:
                points[point] = top[0][2:]
            else:
                unclear.add(point)
        self._entries, self._points, self._unclear = entries, points, unclear
        self._mounts = {dev: tuple(sorted(found)) for dev, found in by_dev.items()}
        self._reads += 1

    def _close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
        self._file = self._poll = None
        self._entries, self._points, self._unclear, self._mounts = [], {}, set(), {}


def _after_fork_in_child() -> None:
    for table in list(_tables):
        table._lock = threading.Lock()  # another thread of the parent may have held it


os.register_at_fork(after_in_child=_after_fork_in_child)
TABLE = MountTable()  # this process's


def unescape(s: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    for code in ("\\040", "\\011", "\\012", "\\134"):
        s = s.replace(code, chr(int(code[1:], 8)))
    return s
