"""A mount with --no-xattr: the kernel stops asking for xattrs, and the control
tools still find the daemon (through the registry in /run/tierfs)."""
import errno
import json
import os

import pytest

from tests.harness import read_file, write_file
from tierfs import registry


def fuse_ops(m) -> dict:
    return json.loads(m.cli("status", m.mountpoint, "--json", check=True).stdout)["fuse_ops"]


def test_no_xattr_mount_skips_xattr_round_trips(mount_factory):
    m = mount_factory(args=("--no-xattr",))
    p = m.path("f")
    with open(p, "wb") as f:
        for _ in range(200):  # each write(2) would cost a security.capability query
            f.write(b"x" * 4096)
            f.flush()
    for call, args in ((os.setxattr, (p, "user.a", b"1")), (os.getxattr, (p, "user.a")),
                       (os.listxattr, (p,)), (os.removexattr, (p, "user.a"))):
        with pytest.raises(OSError) as e:
            call(*args)
        assert e.value.errno == errno.EOPNOTSUPP, call.__name__
    ops = fuse_ops(m)
    # The first refusal is remembered by the kernel for the whole connection.
    assert ops.get("getxattr", 0) <= 1 and ops.get("setxattr", 0) <= 1
    assert read_file(p) == b"x" * 4096 * 200


def test_control_tools_work_without_xattrs(mount_factory):
    m = mount_factory(args=("--no-xattr",))
    write_file(m.path("g"), b"y" * 100_000)
    st = json.loads(m.cli("status", m.path("g"), "--json", check=True).stdout)
    assert st["pid"] == m.daemon_pid() and st["file"]["dirty"] == 100_000
    m.cli("sync", m.mountpoint, "--wait", check=True)
    m.cli("release", m.path("g"), check=True)
    st = json.loads(m.cli("status", m.path("g"), "--json", check=True).stdout)
    assert st["file"]["hot"] == 0 and st["file"]["cold"] == 100_000
    assert read_file(m.path("g")) == b"y" * 100_000
    entry = os.path.join(registry.run_dirs()[0],
                         f"dev-{os.major(os.stat(m.mountpoint).st_dev)}-"
                         f"{os.minor(os.stat(m.mountpoint).st_dev)}.json")
    pid = m.daemon_pid()
    assert registered_pid(entry) == pid
    m.umount()
    # Gone, or another mount's: a test running beside this one may have been given the
    # device number just freed, and registered under it.
    assert registered_pid(entry) != pid
    assert not m.mounted


def registered_pid(entry: str) -> int | None:
    """The daemon a registry entry names, None if there is no entry."""
    try:
        with open(entry) as f:
            return json.load(f)["pid"]
    except FileNotFoundError:
        return None


def test_default_mount_still_serves_xattrs(mnt):
    p = mnt.path("h")
    write_file(p, b"z")
    os.setxattr(p, "user.k", b"v")
    assert os.getxattr(p, "user.k") == b"v"
    assert json.loads(os.getxattr(p, "user.tierfs.state"))["size"] == 1
