"""Checks of the mount point and the FUSE environment, with one-line errors."""
from __future__ import annotations

import errno
import os
import shutil
import subprocess
import threading
import time

from . import registry
from .mount_table import unescape
from .errors import UserError

# What a mount whose daemon died answers (kernels differ).
DEAD_MOUNT = (errno.ENOTCONN, errno.ECONNABORTED)
# How long a FUSE mount gets to answer statfs before it is taken to hang.
ANSWER_WAIT_S = 5.0
FUSECTL = "/sys/fs/fuse/connections"


def mounts() -> dict[str, str]:
    """mount point -> filesystem type, from /proc/self/mounts."""
    out = {}
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3:
                out[unescape(parts[1])] = parts[2]
    return out


def unmount_lazy(path: str) -> None:
    subprocess.run(["fusermount3", "-u", "-z", path], capture_output=True, check=False)


def check_fuse_available() -> None:
    if shutil.which("fusermount3") is None:
        raise UserError("fusermount3 not found: install FUSE 3 (apt-get install fuse3)")
    if not os.path.exists("/dev/fuse"):
        raise UserError("/dev/fuse does not exist: load the fuse module (modprobe fuse) "
                        "or, in Docker, run with --device /dev/fuse --cap-add SYS_ADMIN")
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        raise UserError("no access to /dev/fuse: run as root or give this user read/write "
                        "access to /dev/fuse")


def mount_device(path: str) -> int | None:
    """Device number of the mount at `path` (from mountinfo: the mount is not asked)."""
    found = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 4 and unescape(parts[4]) == path:
                major, minor = parts[2].split(":")
                found = os.makedev(int(major), int(minor))  # the last one is on top
    return found


def answers(path: str, timeout: float = ANSWER_WAIT_S) -> bool:
    """Whether the FUSE mount at `path` answers statfs within `timeout` (never from
    kernel caches). OSError (ENOTCONN: its daemon died) is raised as it comes. The
    asking thread is left behind if the mount hangs: it returns once the mount's
    connection is aborted."""
    done = threading.Event()
    error: list[OSError] = []

    def ask():
        try:
            os.statvfs(path)
        except OSError as e:
            error.append(e)
        done.set()

    threading.Thread(target=ask, name="tierfs-statfs", daemon=True).start()
    if not done.wait(timeout):
        return False
    if error:
        raise error[0]
    return True


def abort_connection(dev: int) -> None:
    """Abort the FUSE connection of device `dev`: every request waiting on it fails
    with ENOTCONN, so the threads stuck in them go on (through the fusectl
    filesystem, mounted if it is not)."""
    if not os.path.isdir(os.path.join(FUSECTL, str(os.minor(dev)))):
        subprocess.run(["mount", "-t", "fusectl", "fusectl", FUSECTL], capture_output=True)
    with open(os.path.join(FUSECTL, str(os.minor(dev)), "abort"), "w") as f:
        f.write("1")


def release_hung_mount(path: str) -> str:
    """A mount at `path` that does not answer: if its daemon died (killed while a
    thread of it was stuck in the kernel, which keeps the connection open), abort
    the connection and unmount it; return a note. Raise UserError if the mount
    hangs with its daemon alive, or nothing says which daemon it had."""
    dev = mount_device(path)
    pid = registry.dead_daemon(dev, path) if dev is not None else None
    minor = os.minor(dev) if dev is not None else "N"
    if pid is None:
        raise UserError(f"{path} is mounted and does not answer within {ANSWER_WAIT_S:g}s: "
                        f"if its daemon is gone, run echo 1 > {FUSECTL}/{minor}/abort, then "
                        f"fusermount3 -u -z {path}")
    try:
        abort_connection(dev)
    except OSError as e:
        raise UserError(f"{path} hangs: its daemon {pid} died with the mount's connection "
                        f"open, and aborting it failed ({e.strerror}): run echo 1 > "
                        f"{FUSECTL}/{minor}/abort as root, then fusermount3 -u -z {path}") from None
    unmount_lazy(path)
    # Its stuck thread now goes on and the process ends, letting go of its cache dir.
    deadline = time.monotonic() + ANSWER_WAIT_S
    while not registry.exited(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return (f"aborted the hung mount at {path}: its daemon {pid} had died with a thread "
            f"stuck in the kernel")


def check_mountpoint(path: str) -> list[str]:
    """Validate a mount point; clean up a stale mount of a dead daemon.
    Returns notes to tell the user (e.g. that a stale mount was removed)."""
    notes = []
    path = os.path.abspath(path)
    try:
        if mounts().get(path, "").startswith("fuse") and not answers(path):
            notes.append(release_hung_mount(path))
        st = os.stat(path)
    except FileNotFoundError:
        raise UserError(f"mount point {path} does not exist: create it with mkdir -p {path}") from None
    except OSError as e:
        if e.errno not in DEAD_MOUNT:
            raise UserError(f"cannot use mount point {path}: {e.strerror}") from None
        unmount_lazy(path)  # a daemon died (kill -9) and left its mount behind
        notes.append(f"removed a stale mount at {path} left by a daemon that died")
        try:
            st = os.stat(path)
        except OSError as e2:
            raise UserError(f"stale mount at {path} could not be removed ({e2.strerror}): "
                            f"run fusermount3 -u -z {path} and retry") from None
    import stat as _stat
    if not _stat.S_ISDIR(st.st_mode):
        raise UserError(f"mount point {path} is not a directory: give an empty directory")
    fstype = mounts().get(path)
    if fstype is not None and fstype.startswith("fuse"):
        raise UserError(f"{path} is already mounted ({fstype}): unmount it first "
                        f"(tierfs umount {path})")
    if os.listdir(path):
        raise UserError(f"mount point {path} is not empty: use an empty directory")
    return notes


def check_outside_mount(mountpoint: str, cache_dir: str, cold_dir: str | None) -> None:
    """The cache dir and a file:// cold location must not lie in the mount point: once
    mounted, the daemon would reach them through its own mount and wait on itself."""
    mp = os.path.realpath(mountpoint)
    for what, path, fix in (("cache dir", cache_dir, "--cache-dir"),
                            ("cold location", cold_dir, "file:// location")):
        if path is None:
            continue
        real = os.path.realpath(path)
        if os.path.commonpath([mp, real]) != mp:
            continue
        where = "is the mount point" if real == mp else f"is inside the mount point {mp}"
        raise UserError(f"{what} {path} {where}, which the mount would hide from its own "
                        f"daemon: choose a {fix} outside {mp}")
