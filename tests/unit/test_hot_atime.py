"""Reading a hot copy leaves its atime alone (O_NOATIME). On a relatime mount the first
read of a freshly written copy, which every fetched copy gets, would otherwise dirty its
inode: a journal update per copy, on the thread that reads it."""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from tierfs.checksum import xxh3
from tierfs.hot import store as hot_store
from tierfs.hot.store import HotStore

OLD = 10**18  # ns: 2001-09-09
DATA = os.urandom(70_000)


def aged(path) -> None:
    """atime and mtime set in the past, atime not after mtime: a read under relatime
    (the default mount option) or strictatime then moves the atime to now."""
    os.utime(path, ns=(OLD, OLD))


def atime(path) -> int:
    return os.stat(path).st_atime_ns


@pytest.fixture
def store(tmp_path):
    probe = tmp_path / "probe"
    probe.write_bytes(b"x")
    aged(probe)
    with open(probe, "rb") as f:
        f.read()
    if atime(probe) == OLD:  # no test here could fail on such a filesystem
        pytest.skip("the filesystem of the test directory does not update atimes (noatime)")
    s = HotStore(str(tmp_path / "hot"))
    s.install_temp(s.write_temp(7, 0, DATA), 7, 0)
    aged(s.path(7, 0))
    yield s
    s.close()


def read_private(s: HotStore) -> None:
    fd = s.open_private(7, 0, os.O_RDONLY)  # what the direct path hands a reader
    try:
        assert os.pread(fd, 100, 0) == DATA[:100]
    finally:
        os.close(fd)


def read_dup(s: HotStore) -> None:
    out = bytearray(len(DATA))
    s.read_into(s.dup_fd(7, 0), 0, memoryview(out))  # a worker thread's read
    assert out == DATA


READS = {
    "pread": lambda s: s.pread(7, 0, 0, 100) == DATA[:100] or pytest.fail("wrong bytes"),
    "read_cached": lambda s: s.read_cached(7, 0, 0, bytearray(100)),
    "read_whole_cached": lambda s: s.read_whole_cached(7, 0, 1 << 20),
    "copy_matches": lambda s: s.copy_matches(7, 0, len(DATA), xxh3(DATA)) or pytest.fail("no match"),
    "private descriptor": read_private,
    "dup_fd and read_into": read_dup,
}


@pytest.mark.parametrize("how", READS)
def test_reading_a_hot_copy_keeps_its_atime(store, how):
    READS[how](store)
    assert atime(store.path(7, 0)) == OLD


def test_a_store_that_may_not_use_noatime_opens_without_it():
    """O_NOATIME is refused (EPERM) to a process that neither owns the file nor has
    CAP_FOWNER: such a store opens its copies all the same. Run as `nobody`, in a
    child process, on a file root owns."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to become another user")
    top = tempfile.mkdtemp(dir="/var/tmp")
    try:
        os.chmod(top, 0o755)
        path = os.path.join(top, "copy")
        with open(path, "wb") as f:
            f.write(DATA)
        os.chmod(path, 0o644)
        pid = os.fork()
        if pid == 0:  # the child: exit 0 only if open_copy read the file and gave up the flag
            try:
                os.setgid(65534)
                os.setuid(65534)
                try:
                    os.close(os.open(path, os.O_RDONLY | os.O_NOATIME))
                    os._exit(3)  # not refused: this test would show nothing
                except PermissionError:
                    pass
                fd = hot_store.open_copy(path, os.O_RDONLY)
                ok = os.pread(fd, 10, 0) == DATA[:10] and hot_store._noatime == 0
                os._exit(0 if ok else 1)
            except BaseException:
                os._exit(2)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        shutil.rmtree(top)
