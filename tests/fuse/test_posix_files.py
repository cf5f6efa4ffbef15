"""POSIX behaviour of file data through the mount: read/write, truncate, holes,
big offsets, open flags, fallocate, fsync, statfs, unlink while open."""
from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import signal
import stat
import subprocess

import pytest

from tests.fuse.test_posix_common import (E, MOUNT_CONFIGS, MiB, assert_errno, d,  # noqa: F401
                                          eventually, hot_files, meta_has_inode,
                                          read_uncached, shared_mnt)
from tests.harness import wait_until

GiB = 1 << 30


def pattern(n: int, seed: int = 0) -> bytes:
    """A 251-byte period: data landing at a wrong (page-aligned) offset never matches."""
    block = bytes((i * 7 + seed) % 251 for i in range(251))
    return (block * (n // 251 + 1))[:n]


def test_regular_file_write_read_overwrite(d):
    p = os.path.join(d, "f")
    with open(p, "wb") as f:
        assert f.write(b"hello world") == 11
    st = os.stat(p)
    assert stat.S_ISREG(st.st_mode) and st.st_size == 11 and st.st_nlink == 1
    with open(p, "r+b") as f:
        f.seek(6)
        f.write(b"WORLD!!")
    assert open(p, "rb").read() == b"hello WORLD!!"
    assert read_uncached(p) == b"hello WORLD!!"
    assert os.stat(p).st_size == 13


def test_write_across_extent_boundaries(d):
    p = os.path.join(d, "f")
    data = pattern(2 * E + 12345)
    with open(p, "wb") as f:
        f.write(data)
    assert os.stat(p).st_size == len(data)
    assert read_uncached(p) == data
    # An unaligned overwrite that straddles the first boundary.
    fd = os.open(p, os.O_RDWR)
    try:
        os.pwrite(fd, b"X" * 1000, E - 500)
    finally:
        os.close(fd)
    expect = data[:E - 500] + b"X" * 1000 + data[E + 500:]
    assert read_uncached(p) == expect


def _check_truncate(d, trunc):
    p = os.path.join(d, "f")
    data = pattern(E + 2 * MiB)  # 6 MiB: extent 0 full, extent 1 half
    with open(p, "wb") as f:
        f.write(data)
    trunc(p, E + MiB)        # shrink inside extent 1
    assert os.stat(p).st_size == E + MiB
    trunc(p, E - 100)        # shrink across the boundary: extent 1 goes
    assert os.stat(p).st_size == E - 100
    trunc(p, 2 * E + 7)      # grow again: everything past E-100 reads as zeros
    assert os.stat(p).st_size == 2 * E + 7
    expect = data[:E - 100] + bytes(E + 107)
    assert open(p, "rb").read() == expect
    assert read_uncached(p) == expect
    trunc(p, E)              # shrink onto the boundary exactly, then grow
    trunc(p, E + 10)
    assert read_uncached(p) == data[:E - 100] + bytes(110)
    trunc(p, 0)
    assert os.stat(p).st_size == 0 and open(p, "rb").read() == b""


def test_truncate_grow_shrink_across_extents(d):
    _check_truncate(d, os.truncate)


def test_ftruncate_grow_shrink_across_extents(d):
    def ftrunc(p, n):
        fd = os.open(p, os.O_RDWR)
        try:
            os.ftruncate(fd, n)
        finally:
            os.close(fd)
    _check_truncate(d, ftrunc)


def test_shrink_then_grow_zeroes_tail_within_extent(d):
    p = os.path.join(d, "f")
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"A" * 10000)
        os.ftruncate(fd, 100)
        os.ftruncate(fd, 10000)
        assert os.pread(fd, 10000, 0) == b"A" * 100 + bytes(9900)
        # Writing past the end after a shrink must not resurrect old bytes either.
        os.ftruncate(fd, 50)
        os.pwrite(fd, b"Z", 5000)
        assert os.pread(fd, 6000, 0) == b"A" * 50 + bytes(4950) + b"Z"
    finally:
        os.close(fd)
    assert read_uncached(p) == b"A" * 50 + bytes(4950) + b"Z"


def test_mmap_shared_write(d):
    import mmap
    p = os.path.join(d, "f")
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.ftruncate(fd, E + MiB)
        with mmap.mmap(fd, E + MiB) as m:
            m[100:110] = b"0123456789"
            m[E - 2:E + 2] = b"ABCD"  # across the extent boundary
            m.flush()
        os.pwrite(fd, b"after", E + 10)
    finally:
        os.close(fd)
    expect = bytearray(E + MiB)
    expect[100:110] = b"0123456789"
    expect[E - 2:E + 2] = b"ABCD"
    expect[E + 10:E + 15] = b"after"
    assert read_uncached(p) == bytes(expect)


def test_sparse_file_holes_read_zero_and_few_blocks(d):
    p = os.path.join(d, "sparse")
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, b"head", 0)
        os.pwrite(fd, b"tail", 5 * E + 3)
        os.fsync(fd)
    finally:
        os.close(fd)
    size = 5 * E + 7
    st = os.stat(p)
    assert st.st_size == size
    assert st.st_blocks * 512 < size // 2, st.st_blocks
    data = read_uncached(p)
    assert len(data) == size
    assert data[:4] == b"head" and data[-4:] == b"tail"
    assert data[4:-4].count(0) == size - 8


def test_file_larger_than_4_gib(d):
    p = os.path.join(d, "big")
    off = 5 * GiB
    with open(p, "wb") as f:
        f.seek(off)
        f.write(b"far away")
    st = os.stat(p)
    assert st.st_size == off + 8
    assert st.st_blocks * 512 < 64 * MiB
    fd = os.open(p, os.O_RDWR)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert os.pread(fd, 100, off - 2) == b"\0\0far away"
        assert os.pread(fd, 4096, 4 * GiB + 12345) == bytes(4096)
        assert os.pread(fd, 10, off + 8) == b""
        os.pwrite(fd, b"!", off + 8)
    finally:
        os.close(fd)
    assert os.stat(p).st_size == off + 9


def test_o_append_two_fds_interleave(d):
    p = os.path.join(d, "log")
    a = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    b = os.open(p, os.O_WRONLY | os.O_APPEND)
    try:
        expect = b""
        for i in range(50):
            fd, rec = (a, b"a%03d\n" % i) if i % 2 == 0 else (b, b"b%03d\n" % i)
            os.write(fd, rec)
            expect += rec
        os.lseek(a, 0, os.SEEK_SET)  # a seek does not matter for O_APPEND
        os.write(a, b"end\n")
        expect += b"end\n"
    finally:
        os.close(a)
        os.close(b)
    assert open(p, "rb").read() == expect
    assert read_uncached(p) == expect


def test_o_excl_and_o_trunc(d):
    p = os.path.join(d, "f")
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
    os.write(fd, b"x" * 5000)
    os.close(fd)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o640
    assert_errno(errno.EEXIST, os.open, p, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    # O_EXCL with a dangling symlink in the way is EEXIST too (no following).
    os.symlink("nowhere", os.path.join(d, "link"))
    assert_errno(errno.EEXIST, os.open, os.path.join(d, "link"),
                 os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    assert not os.path.lexists(os.path.join(d, "nowhere"))
    fd = os.open(p, os.O_RDWR | os.O_TRUNC)
    try:
        assert os.fstat(fd).st_size == 0
        assert os.read(fd, 10) == b""
        os.write(fd, b"new")
    finally:
        os.close(fd)
    assert read_uncached(p) == b"new"
    # O_CREAT on an existing file (without O_EXCL or O_TRUNC) just opens it.
    os.close(os.open(p, os.O_RDONLY | os.O_CREAT))
    assert read_uncached(p) == b"new"


def test_posix_fallocate_extends_with_zeros(d):
    # pyfuse3 has no fallocate handler: glibc falls back to writing zeros.
    p = os.path.join(d, "f")
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"abc")
        os.posix_fallocate(fd, 0, 3 * MiB)
        assert os.fstat(fd).st_size == 3 * MiB
        os.posix_fallocate(fd, E - 10, 20)  # across the extent boundary
        assert os.fstat(fd).st_size == E + 10
        os.posix_fallocate(fd, 0, 100)      # inside the file: size unchanged
        assert os.fstat(fd).st_size == E + 10
    finally:
        os.close(fd)
    data = read_uncached(p)
    assert data == b"abc" + bytes(E + 7)


def hot_extent_bytes(m, ino: int, idx: int) -> bytes:
    """An extent's bytes as they are in the daemon's hot-tier file (the layout of
    tierfs.hot.HotStore.path), read beside the daemon, not through the mount."""
    with open(os.path.join(m.cache_dir, "hot", f"{ino & 0xff:02x}", f"{ino:x}.{idx:x}"),
              "rb") as f:
        return f.read()


# strace lines: `PID fsync(FD</path>) = 0` (more arguments may follow the path), or
# a call split across threads as `PID fsync(FD</path> <unfinished ...>` ...
# `PID <... fsync resumed>) = 0`.
def _call_patterns(calls):
    names = "|".join(calls)
    return (re.compile(rf"^(\d+)\s+(?:{names})\(\d+<([^>]*)>(.*\)\s+=\s+0|.*<unfinished \.\.\.>)$"),
            re.compile(rf"^(\d+)\s+<\.\.\. (?:{names}) resumed>.*\)\s+=\s+0$"))


@contextlib.contextmanager
def traced_syncs(pid: int, tmp_path, calls=("fsync", "fdatasync")):
    """strace the daemon (all threads) for the duration of the block; yields a
    list that holds, after the block, the path of every file it made one of
    `calls` on (successfully) meanwhile, once per call."""
    if shutil.which("strace") is None:
        pytest.skip("needs strace to see the daemon flush its files")
    out, err = tmp_path / "strace.out", tmp_path / "strace.err"
    with open(err, "wb") as err_f:
        proc = subprocess.Popen(["strace", "-f", "-y", "-e", "trace=" + ",".join(calls),
                                 "-o", str(out), "-p", str(pid)], stderr=err_f)
    synced: list[str] = []
    try:
        wait_until(lambda: b"attached" in err.read_bytes() or proc.poll() is not None, 30,
                   f"strace to attach to the daemon (pid {pid})")
        assert proc.poll() is None, f"strace failed: {err.read_text()}"
        yield synced
    finally:
        proc.send_signal(signal.SIGINT)  # detaches from the daemon, which runs on
        proc.wait(timeout=30)
    call, resumed = _call_patterns(calls)
    unfinished: dict[str, str] = {}
    for line in out.read_text().splitlines():
        line = line.strip()
        if match := call.match(line):
            if "<unfinished ...>" not in match.group(3):
                synced.append(match.group(2))
            else:
                unfinished[match.group(1)] = match.group(2)
        elif (match := resumed.match(line)) and match.group(1) in unfinished:
            synced.append(unfinished.pop(match.group(1)))


@pytest.mark.parametrize("cache", ["writeback", "no-writeback"])
def test_each_filled_extent_starts_its_writeback(mount_factory, tmp_path, cache):
    """The daemon starts the disk write of every extent file written up to its end
    (so a checkpoint's fsync does not have all of it to write), and of no other."""
    from tierfs.hot import pagecache
    if pagecache.sync_file_range is None:
        pytest.skip("this libc has no sync_file_range")
    m = mount_factory(args=("--upload-delay", "3600",
                            *(["--no-writeback-cache"] if cache == "no-writeback" else [])))
    hot_dir = os.path.realpath(os.path.join(m.cache_dir, "hot"))
    data = pattern(3 * E + E // 2)
    p = m.path("ckpt")
    out = tmp_path / "strace.out"
    with traced_syncs(m.pid, tmp_path, calls=("sync_file_range",)) as started:
        with open(p, "wb") as f:
            f.write(data)
        ino = os.stat(p).st_ino
        wait_until(lambda: out.read_text().count("sync_file_range(") >= 3, 30,
                   "the daemon to start the writeback of three extents")
    hot = [os.path.join(hot_dir, f"{ino & 0xff:02x}", f"{ino:x}.{i:x}") for i in range(4)]
    assert sorted(started) == hot[:3], started  # each filled extent once, not the 4th
    assert read_uncached(p) == data


@pytest.mark.parametrize("config", [c for c, args in MOUNT_CONFIGS.items() if args is not None])
def test_fsync_fdatasync_and_dir_fsync(mount_factory, tmp_path, config):
    # A long upload delay keeps the written extents dirty, so that the hot tier is
    # their only copy and the daemon's fsync has to flush it.
    m = mount_factory(args=(*MOUNT_CONFIGS[config], "--upload-delay", "3600"))
    hot_dir = os.path.realpath(os.path.join(m.cache_dir, "hot"))
    meta_file = os.path.realpath(os.path.join(m.cache_dir, "meta", "data.mdb"))
    os.mkdir(m.path("d"))
    p = m.path("d", "f")
    data = pattern(E + 4000)  # two extents
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        ino = os.fstat(fd).st_ino
        hot = [os.path.join(hot_dir, f"{ino & 0xff:02x}", f"{ino:x}.{i:x}") for i in (0, 1)]
        # With the writeback cache these writes may sit in the kernel's page cache;
        # fsync must bring them to the daemon and make the daemon flush its files.
        os.write(fd, data)
        with traced_syncs(m.pid, tmp_path) as synced:
            os.fsync(fd)
        assert hot_extent_bytes(m, ino, 0) == data[:E]
        assert hot_extent_bytes(m, ino, 1) == data[E:]
        assert hot[0] in synced and hot[1] in synced, f"hot files not flushed: {synced}"
        assert meta_file in synced, f"metadata not flushed by fsync: {synced}"
        os.write(fd, b"more")
        with traced_syncs(m.pid, tmp_path) as synced:
            os.fdatasync(fd)
        assert hot_extent_bytes(m, ino, 1) == data[E:] + b"more"
        assert hot[1] in synced, f"hot file not flushed by fdatasync: {synced}"
        assert meta_file in synced, f"metadata not flushed by fdatasync: {synced}"
    finally:
        os.close(fd)
    # fsync of a directory makes its entries durable. Every metadata change is
    # committed to LMDB (sync=False) at once, so a new entry survives a kill -9 of
    # the daemon even without any fsync: only power loss tells the difference, and
    # what guards against it is the flush of the metadata file. So that flush is
    # what this checks, in the daemon's syscalls.
    with open(m.path("d", "new"), "wb") as f:
        f.write(b"x")
    dfd = os.open(m.path("d"), os.O_RDONLY | os.O_DIRECTORY)
    try:
        with traced_syncs(m.pid, tmp_path) as synced:
            os.fsync(dfd)
    finally:
        os.close(dfd)
    assert meta_file in synced, f"metadata not flushed by fsync of a directory: {synced}"
    assert sorted(os.listdir(m.path("d"))) == ["f", "new"]
    assert read_uncached(p) == data + b"more"


def test_statvfs(shared_mnt):
    st = os.statvfs(shared_mnt.mountpoint)
    assert st.f_blocks > 0
    assert st.f_bsize > 0 and st.f_frsize > 0
    assert st.f_bavail <= st.f_bfree <= st.f_blocks
    assert st.f_namemax == 255
    assert st.f_files > 0 and st.f_ffree > 0


def test_unlink_while_open(shared_mnt, d):
    p = os.path.join(d, "f")
    data = pattern(E + 1000)  # two extents, two hot files
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
        ino = os.fstat(fd).st_ino
        assert len(hot_files(shared_mnt, ino)) == 2
        os.unlink(p)
        assert not os.path.lexists(p)
        assert os.listdir(d) == []
        assert os.fstat(fd).st_nlink == 0
        # Still readable and writable through the fd, also from the daemon.
        os.pwrite(fd, b"after unlink", 10)
        data = data[:10] + b"after unlink" + data[22:]
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert os.pread(fd, len(data) + 10, 0) == data
        os.ftruncate(fd, 100)
        assert os.fstat(fd).st_size == 100
        assert meta_has_inode(shared_mnt, ino)
    finally:
        os.close(fd)
    eventually(lambda: not hot_files(shared_mnt, ino), what="hot files removed")
    eventually(lambda: not meta_has_inode(shared_mnt, ino), what="inode purged")


def test_unlink_last_name_of_hard_link_while_open(shared_mnt, d):
    a, b = os.path.join(d, "a"), os.path.join(d, "b")
    with open(a, "wb") as f:
        f.write(b"shared")
    os.link(a, b)
    fd = os.open(b, os.O_RDONLY)
    try:
        ino = os.fstat(fd).st_ino
        os.unlink(a)
        assert os.fstat(fd).st_nlink == 1
        os.unlink(b)
        assert os.fstat(fd).st_nlink == 0
        assert os.pread(fd, 100, 0) == b"shared"
    finally:
        os.close(fd)
    eventually(lambda: not meta_has_inode(shared_mnt, ino), what="inode purged")
    eventually(lambda: not hot_files(shared_mnt, ino), what="hot files removed")


def test_rename_over_open_file_keeps_it_readable(shared_mnt, d):
    a, b = os.path.join(d, "a"), os.path.join(d, "b")
    with open(a, "wb") as f:
        f.write(b"new contents")
    with open(b, "wb") as f:
        f.write(b"old contents")
    fd = os.open(b, os.O_RDONLY)
    try:
        ino = os.fstat(fd).st_ino
        os.rename(a, b)
        assert os.fstat(fd).st_nlink == 0
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert os.pread(fd, 100, 0) == b"old contents"
        assert open(b, "rb").read() == b"new contents"
    finally:
        os.close(fd)
    eventually(lambda: not meta_has_inode(shared_mnt, ino), what="inode purged")
    eventually(lambda: not hot_files(shared_mnt, ino), what="hot files removed")


def test_rmdir_while_open(shared_mnt, d):
    sub = os.path.join(d, "sub")
    os.mkdir(sub)
    fd = os.open(sub, os.O_RDONLY | os.O_DIRECTORY)
    try:
        ino = os.fstat(fd).st_ino
        nlink_parent = os.stat(d).st_nlink
        os.rmdir(sub)
        assert not os.path.lexists(sub)
        assert os.stat(d).st_nlink == nlink_parent - 1
        assert os.fstat(fd).st_nlink == 0
        assert os.listdir(fd) == []
        assert_errno(errno.ENOENT, os.open, "x", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd)
        assert_errno(errno.ENOENT, os.mkdir, "y", dir_fd=fd)
        assert meta_has_inode(shared_mnt, ino)
    finally:
        os.close(fd)
    eventually(lambda: not meta_has_inode(shared_mnt, ino), what="directory inode purged")


def test_unlink_of_inode_known_only_from_readdir(mnt):
    # After a remount the kernel learns about these inodes only from readdir
    # (readdirplus); an O_PATH fd then holds them without any open() or lookup
    # reaching the daemon. Removing them must still leave them stat-able
    # through that fd until it is closed.
    os.mkdir(mnt.path("sub"))
    with open(mnt.path("f"), "wb") as f:
        f.write(b"data")
    mnt.remount()
    assert sorted(os.listdir(mnt.mountpoint)) == ["f", "sub"]
    fds = {name: os.open(mnt.path(name), os.O_PATH) for name in ("f", "sub")}
    try:
        inos = {name: os.fstat(fd).st_ino for name, fd in fds.items()}
        os.unlink(mnt.path("f"))
        os.rmdir(mnt.path("sub"))
        assert os.listdir(mnt.mountpoint) == []
        for name, fd in fds.items():
            st = os.fstat(fd)
            assert st.st_nlink == 0 and st.st_ino == inos[name], name
        assert stat.S_ISREG(os.fstat(fds["f"]).st_mode)
    finally:
        for fd in fds.values():
            os.close(fd)
    for ino in inos.values():
        eventually(lambda: not meta_has_inode(mnt, ino), what=f"inode {ino} purged")


# Takes a lock in another process: prints "held" once it has it, then waits for stdin.
LOCKER = r"""
import fcntl, os, sys
path, kind = sys.argv[1], sys.argv[2]
fd = os.open(path, os.O_RDWR)
if kind == "flock":
    fcntl.flock(fd, fcntl.LOCK_EX)
else:
    fcntl.lockf(fd, fcntl.LOCK_EX, 10, 0)
print("held", flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("kind", ["flock", "fcntl"])
def test_locks_exclude_other_processes_and_go_with_their_holder(d, kind):
    """flock and fcntl record locks work between processes of this node (the kernel
    keeps them for the mount: docs/semantics.md)."""
    import fcntl
    import sys
    p = os.path.join(d, "locked")
    with open(p, "wb") as f:
        f.write(b"x" * 100)
    holder = subprocess.Popen([sys.executable, "-c", LOCKER, p, kind],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        fd = os.open(p, os.O_RDWR)
        try:
            with pytest.raises(OSError) as e:
                if kind == "flock":
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                else:
                    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 10, 0)
            assert e.value.errno in (errno.EAGAIN, errno.EACCES)
            if kind == "fcntl":  # a record lock covers its range only
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 10, 50)
            holder.stdin.close()  # the holder exits: its locks go with it
            assert holder.wait(30) == 0
            if kind == "flock":
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            else:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 10, 0)
        finally:
            os.close(fd)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
