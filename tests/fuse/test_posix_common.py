"""Shared fixtures and helpers of the POSIX tests (test_posix_*.py); no tests here.

Most POSIX tests only need an empty directory on a mounted tierfs, so each test
module shares one mount (`shared_mnt`, once per mount configuration) and every
test gets a fresh directory in it (`d`). The daemon log is still checked after
every test. Tests that remount or kill the daemon use the per-test `mnt` fixture.
Modules import `d` and `shared_mnt` from here so that pytest finds them.
"""
from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
import time

import lmdb
import pytest

from tests.harness import Mount, in_child_as, wait_until
from tierfs.meta import MetaStore, schema

MiB = 1 << 20
E = 4 * MiB  # the default extent size of a new filesystem

_libc = ctypes.CDLL(None, use_errno=True)

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def renameat2(old: str, new: str, flags: int) -> None:
    _libc.renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int,
                                ctypes.c_char_p, ctypes.c_uint]
    if _libc.renameat2(_AT_FDCWD, os.fsencode(old), _AT_FDCWD, os.fsencode(new), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), old)


_SYS_GETDENTS64 = {"x86_64": 217, "aarch64": 61}[platform.machine()]


def getdents(fd: int, bufsize: int = 32768) -> list[tuple[bytes, int, int]]:
    """One getdents64 call: (name, d_ino, d_off) of the entries it returned."""
    buf = ctypes.create_string_buffer(bufsize)
    n = _libc.syscall(ctypes.c_long(_SYS_GETDENTS64), ctypes.c_int(fd), buf,
                      ctypes.c_size_t(bufsize))
    if n < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    raw = buf.raw[:n]
    out = []
    pos = 0
    while pos < n:
        ino, off, reclen = struct.unpack_from("<QqH", raw, pos)
        out.append((raw[pos + 19:pos + reclen].split(b"\0", 1)[0], ino, off))
        pos += reclen
    return out


def raw_dirents(path: str) -> list[tuple[bytes, int]]:
    """(name, d_ino) of every entry getdents64 returns, '.' and '..' included
    (os.listdir hides those, and with them the server's idea of the parent)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    out = []
    try:
        while True:
            batch = getdents(fd)
            if not batch:
                return out
            out += [(name, ino) for name, ino, _off in batch]
            assert len(out) < 10_000_000, f"listing of {path} does not end"
    finally:
        os.close(fd)


def errno_of(fn, *args, **kwargs) -> int:
    """Run fn; return 0 on success or the errno of the OSError it raised."""
    try:
        fn(*args, **kwargs)
    except OSError as e:
        return e.errno
    return 0


def assert_errno(expected: int, fn, *args, **kwargs) -> None:
    got = errno_of(fn, *args, **kwargs)
    assert got == expected, (f"{getattr(fn, '__name__', fn)}{args}: expected "
                             f"{errno.errorcode.get(expected, expected)}, got "
                             f"{errno.errorcode.get(got, got) if got else 'success'}")


def eventually(cond, timeout: float = 10.0, what: str = "condition") -> None:
    """Poll for something the daemon does asynchronously (release, forget)."""
    wait_until(cond, timeout, what)


def clock_past(ns: int, margin_ns: int = 25_000_000) -> None:
    """Wait until the wall clock is clearly past a timestamp, so the next change
    gets a larger one. The kernel stamps ctime from a coarse clock (one tick, up
    to 10 ms, behind), so back-to-back changes can share a timestamp. This is
    not a sleep for the daemon: it waits on the clock only (a few ms)."""
    while time.time_ns() < ns + margin_ns:
        time.sleep(0.002)


def as_user(uid: int, gid: int, cwd: str, ops: dict) -> dict:
    """Run each callable of `ops` in a forked child that has dropped root to
    uid/gid, working in `cwd` (entered while still root, so the test's private
    temp dirs above the mount do not get in the way). Returns name -> 0 on
    success, the errno of an OSError, or the callable's return value if it is
    not None."""
    def run_all() -> dict:
        out = {}
        for name, fn in ops.items():
            try:
                value = fn()
                out[name] = 0 if value is None else value
            except OSError as e:
                out[name] = e.errno
        return out

    return in_child_as(uid, gid, [], run_all, cwd)


def read_uncached(path: str) -> bytes:
    """The file's bytes as the daemon serves them: flush, then drop the kernel's
    cached pages so the reads go to the daemon and not the page cache."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        size = os.fstat(fd).st_size
        chunks = []
        pos = 0
        while pos < size:
            chunk = os.pread(fd, min(8 * MiB, size - pos), pos)
            if not chunk:
                break
            chunks.append(chunk)
            pos += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def hot_files(m: Mount, ino: int) -> list[str]:
    """Hot tier files of an inode (layout of tierfs.hot.HotStore.path)."""
    sub = os.path.join(m.cache_dir, "hot", f"{ino & 0xff:02x}")
    try:
        return sorted(n for n in os.listdir(sub) if n.split(".")[0] == f"{ino:x}")
    except FileNotFoundError:
        return []


def meta_url(m: Mount) -> str | None:
    """The shared namespace's URL of a mount with --meta-url, else None."""
    return m.args[m.args.index("--meta-url") + 1] if "--meta-url" in m.args else None


def meta_has_inode(m: Mount, ino: int) -> bool:
    """Whether the live daemon's metadata still holds the inode (LMDB allows a
    second process to read while the daemon writes; PostgreSQL any number)."""
    url = meta_url(m)
    if url:
        store = MetaStore(url)
        try:
            return store.kv.get(schema.inode_key(ino)) is not None
        finally:
            store.close()
    env = lmdb.open(os.path.join(m.cache_dir, "meta"), readonly=True, subdir=True,
                    max_dbs=0)
    try:
        with env.begin() as txn:
            return txn.get(schema.inode_key(ino)) is not None
    finally:
        env.close()


# Mount options the shared-mount tests run under: the default (the kernel's
# writeback cache keeps sizes and times itself) and without it (the daemon's
# own size, mtime and O_APPEND handling are what the tests see).
# The third runs the battery on a namespace in PostgreSQL (--meta-url; no writeback
# cache there).
MOUNT_CONFIGS = {"writeback": [], "no-writeback": ["--no-writeback-cache"], "postgres": None}


def start_shared(tmp_path_factory, args=()):
    root = tmp_path_factory.mktemp("posix")
    m = Mount(str(root), f"file://{root}/m-cold", args=args)
    m.start()
    return m


def stop_shared(m: Mount) -> None:
    m.cleanup()
    bad = m.unexpected_log_lines()
    if bad:
        pytest.fail("daemon logged unexpected errors:\n" + "\n".join(bad[:20]))


@pytest.fixture(scope="module", params=list(MOUNT_CONFIGS))
def shared_mnt(tmp_path_factory, request):
    """One mount per test module and mount configuration."""
    args = MOUNT_CONFIGS[request.param]
    if args is None:
        args = ["--meta-url", request.getfixturevalue("postgres").new_schema()]
    m = start_shared(tmp_path_factory, args)
    yield m
    stop_shared(m)


@pytest.fixture
def d(shared_mnt, request):
    """A fresh empty directory on the module's shared mount."""
    assert shared_mnt.mounted, "an earlier test left the shared mount dead"
    before = len(shared_mnt.log())
    path = shared_mnt.path(request.node.name.replace("/", "_")[:200])
    os.mkdir(path)
    yield path
    new = shared_mnt.log()[before:]
    bad = [line for line in new.splitlines()
           if "ERROR" in line or "Traceback" in line or "CRITICAL" in line]
    if bad:
        pytest.fail("daemon logged unexpected errors:\n" + "\n".join(bad[:20]))
