"""A daemon that dies while its FUSE connection stays open leaves a mount that hangs
instead of failing with ENOTCONN. That happens when a thread of the daemon is stuck in
the kernel as it is killed (on a shared namespace, invalidating a name in a directory
whose lock a writer on the mount holds while it waits for the daemon): the thread, and
with it the connection, waits for a reply nobody will send. A new mount on the same
mount point and `tierfs umount` must see that, abort the connection and go on, never
hang. The tests hold the connection open with a copy of the daemon's /dev/fuse
descriptor (pidfd_getfd), which keeps it alive exactly as the stuck thread does."""
from __future__ import annotations

import ctypes
import os
import platform
import signal

import pytest

from tests.harness import read_file, write_file
from tierfs.mountpoint import answers

# pidfd_getfd(2): the same number on every architecture that has the generic table.
SYS_PIDFD_GETFD = {"x86_64": 438, "aarch64": 438}.get(platform.machine())


def hold_connection(pid: int) -> int:
    """A copy, in this process, of the daemon's /dev/fuse descriptor."""
    if SYS_PIDFD_GETFD is None:
        pytest.skip(f"pidfd_getfd's number is not known here ({platform.machine()})")
    target = next(int(fd) for fd in os.listdir(f"/proc/{pid}/fd")
                  if os.readlink(f"/proc/{pid}/fd/{fd}") == "/dev/fuse")
    try:
        pidfd = os.pidfd_open(pid)
    except OSError as e:  # an old kernel, or a seccomp filter (some containers)
        pytest.skip(f"pidfd_open failed: {e.strerror}")
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.syscall(SYS_PIDFD_GETFD, pidfd, target, 0)
        if fd < 0:
            pytest.skip(f"pidfd_getfd failed: {os.strerror(ctypes.get_errno())}")
        return fd
    finally:
        os.close(pidfd)


@pytest.fixture
def hung(mount_factory):
    """A mount whose daemon was killed while its connection stayed open."""
    m = mount_factory()
    write_file(m.path("f"), b"kept")
    m.cli("sync", m.mountpoint, "--wait", check=True)
    held = hold_connection(m.pid)
    try:
        m.kill9()
        assert m.mounted and not answers(m.mountpoint, timeout=1), \
            "the dead daemon's mount should hang, not fail"
        yield m
    finally:
        os.close(held)


def test_a_new_mount_aborts_the_hung_mount_a_killed_daemon_left(hung):
    res = hung.start()
    assert "aborted the hung mount" in res.stdout, res.stdout
    assert read_file(hung.path("f")) == b"kept"
    hung.umount()


def test_umount_removes_the_hung_mount_a_killed_daemon_left(hung):
    res = hung.cli("umount", hung.mountpoint)
    assert res.returncode == 0, res.stderr
    assert "aborted the hung mount" in res.stdout
    assert not hung.mounted


def test_a_mount_that_hangs_with_its_daemon_alive_is_left_alone(mount_factory):
    """A stopped daemon is not a dead one: umount says what is wrong and gives up
    after a bounded wait; the mount works again once the daemon runs."""
    m = mount_factory()
    write_file(m.path("f"), b"kept")
    os.kill(m.pid, signal.SIGSTOP)
    try:
        res = m.cli("umount", m.mountpoint)
        assert res.returncode != 0
        assert "does not answer" in res.stderr and "/abort" in res.stderr, res.stderr
        assert m.mounted
    finally:
        os.kill(m.pid, signal.SIGCONT)
    assert read_file(m.path("f")) == b"kept"
