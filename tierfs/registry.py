"""Which daemon serves a mount, known without asking the mount.

Normally the virtual xattr `user.tierfs.control` answers that. A mount with
`--no-xattr` cannot answer any xattr, and a mount whose daemon died may not answer
at all, so every daemon also writes the same JSON to
`<run dir>/dev-<major>-<minor>.json`, named after the mount's device number (the
st_dev every path inside the mount reports), and removes it when its FUSE session
ends. A client trusts an entry only if its mount point still has that device number
and its daemon is alive, so entries left by a killed daemon are ignored; `tierfs mount`
and `tierfs umount` read them to tell a mount whose daemon died (dead_daemon).

The kernel gives a device number to the next mount as soon as a mount ends, while
its daemon may still be uploading for a while: a daemon removes only an entry that
still names it, under a lock that registering takes too, so it never removes the
entry of a mount that got its device number meanwhile.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os


def run_dirs() -> list[str]:
    """Where entries may be: the system-wide dir (root's daemons), then the user's."""
    dirs = ["/run/tierfs"]
    user = os.environ.get("XDG_RUNTIME_DIR")
    if user:
        dirs.append(os.path.join(user, "tierfs"))
    return dirs


def _entry(directory: str, dev: int) -> str:
    return os.path.join(directory, f"dev-{os.major(dev)}-{os.minor(dev)}.json")


@contextlib.contextmanager
def _locked(directory: str):
    """Registering and unregistering, one at a time in this run dir."""
    fd = os.open(os.path.join(directory, ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def register(dev: int, info: dict) -> str:
    """Write the entry for the mount with device number `dev` (info names the daemon's
    pid; its start time is added, so a reused pid is not taken for it); return its path."""
    directory = run_dirs()[0] if os.geteuid() == 0 else run_dirs()[-1]
    os.makedirs(directory, mode=0o755, exist_ok=True)
    path = _entry(directory, dev)
    tmp = f"{path}.{os.getpid()}"
    with _locked(directory):
        with open(tmp, "w") as f:
            json.dump(dict(info, started=start_time(info["pid"])), f)
        os.replace(tmp, path)
    return path


def unregister(path: str, pid: int | None = None) -> None:
    """Remove the entry at `path` if it still names the daemon `pid` (this process
    by default): another mount may have its device number and its entry by now."""
    pid = os.getpid() if pid is None else pid
    try:
        with _locked(os.path.dirname(path)):
            with open(path) as f:
                info = json.load(f)
            if info.get("pid") == pid and info.get("started") in (None, start_time(pid)):
                os.unlink(path)
    except (OSError, ValueError, AttributeError):
        pass  # gone, or unreadable: leave it; readers check it against live processes


def lookup(dev: int) -> dict | None:
    """The live daemon serving the mount with device number `dev`, if registered."""
    for directory in run_dirs():
        try:
            with open(_entry(directory, dev)) as f:
                info = json.load(f)
            if os.stat(info["mountpoint"]).st_dev != dev or not _runs_as(info):
                continue
        except (OSError, ValueError, KeyError, TypeError):
            continue
        return info
    return None


def registered(dev: int, mountpoint: str) -> dict | None:
    """The entry for the mount at `mountpoint` with device number `dev`, whether its
    daemon runs or not (the mount is not asked)."""
    for directory in run_dirs():
        try:
            with open(_entry(directory, dev)) as f:
                info = json.load(f)
            if _same_point(info["mountpoint"], mountpoint) and isinstance(info["pid"], int):
                return info
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def parent_resolved(path: str) -> str:
    """`path` with the symlinks of the directories above it resolved, as the mount
    table spells a mount point; the last name is never stat'ed (a mount point's
    daemon may hang)."""
    parent, name = os.path.split(path)
    return os.path.join(os.path.realpath(parent), name)


def _same_point(registered_as: str, mountpoint: str) -> bool:
    """Whether the mount point an entry names (as it was given to tierfs mount) is
    `mountpoint` as the mount table spells it, with every symlink resolved."""
    return registered_as == mountpoint or parent_resolved(registered_as) == mountpoint


def serving(dev: int, mountpoint: str) -> dict | None:
    """The registered daemon of this mount if it runs, found without asking the
    mount (which may be slow to answer while its metadata database is away)."""
    info = registered(dev, mountpoint)
    return info if info is not None and _runs_as(info) else None


def dead_daemon(dev: int, mountpoint: str) -> int | None:
    """The pid of the daemon registered for this mount if it has died (gone, or its
    main thread exited while a thread of it is stuck in the kernel); None if it
    runs or nothing says which daemon the mount had."""
    info = registered(dev, mountpoint)
    return info["pid"] if info is not None and not _runs_as(info) else None


def _runs_as(info: dict) -> bool:
    """Whether the entry's daemon runs: its pid's main thread runs and, for entries
    that recorded it, started when the daemon did (not a later process on its pid)."""
    pid = info["pid"]
    return main_thread_runs(pid) and info.get("started") in (None, start_time(pid))


def start_time(pid: int) -> int | None:
    """When the process (or thread) `pid` started, in clock ticks after boot
    (/proc/PID/stat field 22); None if there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def main_thread_runs(pid: int) -> bool:
    """Whether the process runs: its main thread has not exited (a killed daemon's
    main thread is a zombie even while another thread of it is stuck in the kernel)."""
    return _runs(f"/proc/{pid}/stat")


def exited(pid: int) -> bool:
    """Whether every thread of the process has exited (so its files are closed)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    return not any(_runs(f"/proc/{pid}/task/{tid}/stat") for tid in tids)


def _runs(stat_path: str) -> bool:
    """Whether the task of this /proc stat file exists and is not a zombie."""
    try:
        with open(stat_path) as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False
