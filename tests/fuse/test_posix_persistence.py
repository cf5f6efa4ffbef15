"""What survives the daemon: a clean remount keeps every byte and attribute; a
kill -9 keeps everything that was fsynced, and the next mount cleans up the
stale mount by itself."""
from __future__ import annotations

import errno
import os
import stat

import pytest

from tests.fuse.test_posix_common import (E, MiB, assert_errno, errno_of, hot_files,
                                          meta_has_inode, raw_dirents)

ATTRS = ("st_mode", "st_uid", "st_gid", "st_size", "st_mtime_ns", "st_nlink", "st_ino",
         "st_rdev")


def pattern(n: int, seed: int) -> bytes:
    block = bytes((i * 13 + seed) % 253 for i in range(253))
    return (block * (n // 253 + 1))[:n]


def snapshot(root: str) -> dict:
    """Every path under root -> attributes, content / link target, xattrs."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [""] + dirnames + filenames:
            p = os.path.join(dirpath, name) if name else dirpath
            rel = os.path.relpath(p, root)
            if name == "" and rel in out:
                continue
            st = os.lstat(p)
            rec = {a: getattr(st, a) for a in ATTRS}
            if stat.S_ISLNK(st.st_mode):
                rec["target"] = os.readlink(p)
            else:
                rec["xattrs"] = {x: os.getxattr(p, x) for x in sorted(os.listxattr(p))}
                if stat.S_ISREG(st.st_mode):
                    with open(p, "rb") as f:
                        rec["data"] = f.read()
                elif stat.S_ISDIR(st.st_mode):
                    rec["dirents"] = sorted(raw_dirents(p))
            out[rel] = rec
    return out


def build_tree(root: str) -> None:
    os.makedirs(os.path.join(root, "a", "b", "c"))
    os.mkdir(os.path.join(root, "empty"), 0o700)
    with open(os.path.join(root, "small"), "wb") as f:
        f.write(b"small file\n")
    with open(os.path.join(root, "a", "multi"), "wb") as f:
        f.write(pattern(2 * E + 4321, 1))
    with open(os.path.join(root, "a", "b", "sparse"), "wb") as f:
        f.seek(3 * E + 5)
        f.write(b"end")
    with open(os.path.join(root, "a", "b", "c", "empty_file"), "wb"):
        pass
    os.symlink("../small", os.path.join(root, "a", "rel_link"))
    os.symlink("/nonexistent/target", os.path.join(root, "dangling"))
    os.link(os.path.join(root, "small"), os.path.join(root, "a", "b", "hard"))
    os.link(os.path.join(root, "small"), os.path.join(root, "hard2"))
    os.mkfifo(os.path.join(root, "fifo"), 0o600)
    os.mknod(os.path.join(root, "a", "null"), stat.S_IFCHR | 0o600, os.makedev(1, 3))
    os.chmod(os.path.join(root, "a", "multi"), 0o640)
    os.chown(os.path.join(root, "a", "multi"), 1000, 2000)
    os.lchown(os.path.join(root, "a", "rel_link"), 3, 4)
    os.chmod(os.path.join(root, "a", "b"), 0o2750)
    os.setxattr(os.path.join(root, "small"), "user.color", b"blue")
    os.setxattr(os.path.join(root, "a"), "user.dir", b"\x00\x01")
    os.setxattr(os.path.join(root, "a", "multi"), "user.big", pattern(30000, 2))
    os.utime(os.path.join(root, "a", "b", "sparse"), ns=(123, 456_789))
    # A rename and an exchange-like shuffle, so that cookies and '..' moved.
    os.rename(os.path.join(root, "a", "b", "c"), os.path.join(root, "moved_c"))
    os.rename(os.path.join(root, "hard2"), os.path.join(root, "moved_c", "hard3"))


def test_tree_survives_remount(mnt):
    build_tree(mnt.mountpoint)
    before = snapshot(mnt.mountpoint)
    assert before["small"]["st_nlink"] == 3
    assert before["moved_c"]["dirents"][1][1] == before["."]["st_ino"]  # '..'
    mnt.remount()
    after = snapshot(mnt.mountpoint)
    assert sorted(after) == sorted(before)
    for path in before:
        for key in before[path]:
            assert after[path][key] == before[path][key], (path, key)
    # And it still works as a filesystem afterwards.
    assert_errno(errno.ENOTEMPTY, os.rmdir, mnt.path("a"))
    os.unlink(mnt.path("small"))
    assert os.stat(mnt.path("a", "b", "hard")).st_nlink == 2
    mnt.remount()
    assert os.stat(mnt.path("moved_c", "hard3")).st_nlink == 2
    with open(mnt.path("moved_c", "hard3"), "rb") as f:
        assert f.read() == b"small file\n"


@pytest.mark.lmdb_only  # shared: purged when the session expires (test_many_nodes.py)
def test_unlinked_open_file_purged_by_next_mount(mnt):
    # Unlinked while open when the daemon dies: the next mount purges it.
    p = mnt.path("f")
    with open(p, "wb") as f:
        f.write(b"x" * MiB)
    fd = os.open(p, os.O_RDONLY)
    ino = os.fstat(fd).st_ino
    os.unlink(p)
    mnt.kill9()
    try:
        os.close(fd)
    except OSError:
        pass  # the release cannot reach a dead daemon
    mnt.start()
    assert os.listdir(mnt.mountpoint) == []
    assert not meta_has_inode(mnt, ino)
    assert hot_files(mnt, ino) == []


def test_kill9_keeps_fsynced_files(mnt):
    synced = {}
    for i in range(5):
        name = f"synced{i}"
        data = pattern(i * MiB + 1000 * i + 1, i)
        fd = os.open(mnt.path(name), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        synced[name] = data
    os.mkdir(mnt.path("dir"))
    with open(mnt.path("dir", "inner"), "wb") as f:
        f.write(b"inner file")
        f.flush()
        os.fsync(f.fileno())
    synced[os.path.join("dir", "inner")] = b"inner file"
    # An fsynced file that is then partly overwritten without fsync: either
    # version of the overwritten range may survive, the rest must.
    fd = os.open(mnt.path("synced1"), os.O_WRONLY)
    os.pwrite(fd, b"U" * 100, 50)
    os.close(fd)
    for i in range(3):
        with open(mnt.path(f"unsynced{i}"), "wb") as f:
            f.write(pattern(300_000, 9))
    mnt.kill9()
    assert mnt.mounted  # the dead daemon's mount is still there
    # Linux answers ENOTCONN, or ECONNABORTED (newer kernels), for a dead daemon.
    assert errno_of(os.listdir, mnt.mountpoint) in (errno.ENOTCONN, errno.ECONNABORTED)
    res = mnt.start()
    assert "stale mount" in res.stdout + res.stderr
    for name, data in synced.items():
        with open(mnt.path(name), "rb") as f:
            got = f.read()
        if name == "synced1":
            assert len(got) == len(data)
            assert got[50:150] in (data[50:150], b"U" * 100)
            assert got[:50] == data[:50] and got[150:] == data[150:]
        else:
            assert got == data, name
    assert os.stat(mnt.path("dir")).st_nlink == 2
    # The unsynced files may be anywhere between absent and complete, but the
    # filesystem is consistent: they can be read, rewritten and removed.
    for i in range(3):
        p = mnt.path(f"unsynced{i}")
        if os.path.exists(p):
            with open(p, "rb") as f:
                got = f.read()
            assert len(got) <= 300_000
            os.unlink(p)
    mnt.remount()
    assert sorted(os.listdir(mnt.mountpoint)) == ["dir"] + sorted(k for k in synced if "/" not in k)
