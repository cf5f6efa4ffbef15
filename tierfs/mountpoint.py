"""Checks of the mount point and the FUSE environment, with one-line errors."""
from __future__ import annotations

import errno
import os
import shutil
import subprocess

from .errors import UserError

# What a mount whose daemon died answers (kernels differ).
DEAD_MOUNT = (errno.ENOTCONN, errno.ECONNABORTED)


def mounts() -> dict[str, str]:
    """mount point -> filesystem type, from /proc/self/mounts."""
    out = {}
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3:
                out[parts[1].replace("\\040", " ")] = parts[2]
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


def check_mountpoint(path: str) -> list[str]:
    """Validate a mount point; clean up a stale mount of a dead daemon.
    Returns notes to tell the user (e.g. that a stale mount was removed)."""
    notes = []
    path = os.path.abspath(path)
    try:
        if mounts().get(path, "").startswith("fuse"):
            os.statvfs(path)  # never answered from kernel caches: ENOTCONN if dead
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
