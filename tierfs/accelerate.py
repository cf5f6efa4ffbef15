"""tierfs.accelerate(): the builtin open() of files below a tierfs mount goes through
tierfs.open, so unmodified dataset and checkpoint code (PIL, torchvision's
ImageFolder, torch.load of a path) uses the direct path.

    import tierfs
    tierfs.accelerate()          # or TIERFS_ACCELERATE=1 in the environment
    DataLoader(ds, num_workers=8, worker_init_fn=lambda _: tierfs.accelerate())

Only binary modes of paths whose absolute form lies below a tierfs mount point of this
process (from /proc/self/mountinfo, read again at most every two seconds) are routed,
and of those not appends ("a"): a direct writer appends at the end it knows, while code
written for open() may append to one file from many processes (a shared log), which
only the kernel's O_APPEND keeps from overwriting each other;
everything else, and anything tierfs.open cannot serve, is the builtin open() as before.
A path reaching a mount through a symlink from outside is not routed (it is opened as
usual). accelerate(False) puts the builtin back.
"""
from __future__ import annotations

import builtins
import io
import os
import threading
import time

from .mount_table import TABLE

POINTS_TTL = 2.0  # seconds a list of tierfs mount points is kept

_builtin_open = io.open
_lock = threading.Lock()
_points: tuple[float, tuple[str, ...]] = (0.0, ())


def accelerate(enable: bool = True) -> bool:
    """Route (or stop routing) builtins.open through tierfs.open for files on tierfs
    mounts. Returns whether it was routed before."""
    was = builtins.open is routed_open
    builtins.open = routed_open if enable else _builtin_open
    return was


def _tierfs_points() -> tuple[str, ...]:
    global _points
    when, points = _points
    now = time.monotonic()
    if now - when < POINTS_TTL:
        return points
    found = tuple(p.rstrip("/") or "/" for p in TABLE.points_of_type("fuse.tierfs"))
    with _lock:
        _points = (now, found)
    return _points[1]


def on_tierfs(path: str) -> bool:
    """Is this path (absolute, '..' resolved by name) below a tierfs mount point?"""
    points = _tierfs_points()
    if not points:
        return False
    full = os.path.normpath(path if path.startswith("/") else os.path.join(os.getcwd(), path))
    return any(full == p or full.startswith(p + "/") for p in points)


def routed_open(file, mode="r", buffering=-1, encoding=None, errors=None, newline=None,
                closefd=True, opener=None):
    if ("b" in mode and "a" not in mode and encoding is None and errors is None
            and newline is None and closefd and opener is None
            and not isinstance(file, int)):
        try:
            path = os.fsdecode(os.fspath(file))
        except TypeError:
            path = None
        if path is not None and on_tierfs(path):
            from .direct import open as direct_open  # loaded once, on the first such open
            return direct_open(file, mode, buffering)
    return _builtin_open(file, mode, buffering, encoding, errors, newline, closefd, opener)
