"""The connection guard: a small process beside every daemon that aborts the
daemon's FUSE connection if the daemon dies while a thread of it is stuck in the
kernel.

A killed daemon normally leaves a mount that fails with ENOTCONN: the kernel aborts
the connection when the daemon's /dev/fuse descriptor closes. If a thread of the
daemon is blocked in the kernel as it is killed (invalidating a name in a directory
whose lock a caller holds while it waits for the daemon), the process cannot finish
exiting, the descriptor stays open, and the caller and the thread wait on each other
for ever: the mount hangs. The kernel wakes the guard when the daemon's main thread
exits (PR_SET_PDEATHSIG; it also looks once a second); the guard then aborts the
connection, which fails the waiting calls with ENOTCONN and lets the stuck thread
finish. The mount is then what any killed daemon leaves, and the next `tierfs mount`
replaces it.

The daemon starts it from its main thread once mounted and stops it before it
unmounts: `python -m tierfs.guard PID MAJOR MINOR MOUNTPOINT LOG`.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

from .mountpoint import abort_connection, mount_device
from .registry import main_thread_runs

PR_SET_PDEATHSIG = 1
LOOK_EVERY_S = 1.0


def guard(pid: int, dev: int, mountpoint: str, log_path: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a foreground mount's Ctrl-C is the daemon's
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    # Sent when the thread that started this process, the daemon's main thread, exits.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGHUP)
    while main_thread_runs(pid):
        signal.sigtimedwait({signal.SIGHUP}, LOOK_EVERY_S)
    # A clean exit stops the guard before it unmounts; the device number is only
    # trusted while the daemon's mount still holds it.
    if mount_device(mountpoint) != dev:
        return
    try:
        abort_connection(dev)
        note = ("the daemon was killed; its FUSE connection was aborted, so calls on the "
                "mount fail with ENOTCONN instead of waiting (mount it again)")
    except OSError as e:
        note = (f"the daemon was killed and aborting its FUSE connection failed "
                f"({e.strerror}): if {mountpoint} hangs, run tierfs umount {mountpoint}")
    now = time.time()  # the daemon log's own format
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)) + f",{int(now % 1 * 1000):03d}"
    with open(log_path, "a") as log:
        log.write(f"{stamp} WARNING tierfs.guard: {note}\n")


def start(pid: int, dev: int, mountpoint: str, log_path: str):
    """Start the guard of daemon `pid`. Call it from the daemon's main thread: the
    kernel tells the guard when the thread that started it exits."""
    with open(log_path, "a") as log:  # a guard that fails says why in the daemon's log
        return subprocess.Popen(  # -P: a /tierfs folder must not shadow the package
            [sys.executable, "-P", "-m", "tierfs.guard", str(pid), str(os.major(dev)),
             str(os.minor(dev)), mountpoint, log_path],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log, cwd="/")


def stop(process) -> None:
    process.terminate()
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


if __name__ == "__main__":
    _pid, _major, _minor, _mountpoint, _log = sys.argv[1:6]
    guard(int(_pid), os.makedev(int(_major), int(_minor)), _mountpoint, _log)
