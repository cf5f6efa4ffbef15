"""Evicted hot files are reused as spares, never while anyone still has them open.

On a real directory: the store's files are the thing under test."""
from __future__ import annotations

import collections
import os
import subprocess
import sys

import pytest

from tierfs.hot.store import HotStore


def put(store: HotStore, ino: int, data: bytes) -> int:
    """Write and install extent (ino, 0); its inode number."""
    store.install_temp(store.write_temp(ino, 0, data), ino, 0)
    return os.stat(store.path(ino, 0)).st_ino


def drop(store: HotStore, ino: int) -> None:
    """Evict extent (ino, 0) and wait until the trash has emptied its file."""
    store.remove(ino, 0)
    assert store.trash.settle(timeout=60)


def spares(store: HotStore) -> list[os.stat_result]:
    return [os.stat(os.path.join(store.spare_dir, n)) for n in os.listdir(store.spare_dir)]


def test_an_evicted_file_becomes_an_empty_spare_and_is_reused(tmp_path):
    store = HotStore(str(tmp_path / "hot"))
    first = put(store, 1, b"a" * 70_000)
    drop(store, 1)
    if not store.leases:
        pytest.skip("the kernel refuses file leases here: evicted files are unlinked")
    assert not os.path.exists(store.path(1, 0))
    [spare] = spares(store)
    assert (spare.st_ino, spare.st_size, spare.st_blocks) == (first, 0, 0)  # no space held
    assert put(store, 2, b"b" * 1000) == first
    with open(store.path(2, 0), "rb") as f:
        assert f.read() == b"b" * 1000  # nothing of the evicted file's bytes
    assert spares(store) == []


def test_a_file_someone_has_open_is_unlinked_not_reused(tmp_path):
    store = HotStore(str(tmp_path / "hot"))
    first = put(store, 1, b"a" * 5000)
    fd = os.open(store.path(1, 0), os.O_RDONLY)  # as a descriptor the direct path handed out
    try:
        drop(store, 1)
        assert not os.path.exists(store.path(1, 0))
        assert spares(store) == []
        assert put(store, 2, b"b" * 5000) != first
        assert os.pread(fd, 10_000, 0) == b"a" * 5000  # the reader keeps its bytes
    finally:
        os.close(fd)


def test_a_new_store_takes_over_the_spares_left_behind(tmp_path):
    old = HotStore(str(tmp_path / "hot"))
    inos = {put(old, i, b"x" * 100) for i in range(1, 4)}
    for i in range(1, 4):
        drop(old, i)
    old.close()
    if not old.leases:
        pytest.skip("the kernel refuses file leases here: evicted files are unlinked")
    new = HotStore(str(tmp_path / "hot"))
    assert {put(new, i, b"y") for i in range(10, 13)} == inos
    assert list(new.scan()) and all(size == 1 for _i, _x, size, _m in new.scan())


def test_a_spare_can_be_taken_only_once_its_lease_is_gone(tmp_path):
    """A fetch that took a spare while the evictor still held its lease would break
    the evictor's own lease: the spare's name is published after the lease goes."""
    store = HotStore(str(tmp_path / "hot"))
    if not store.leases:
        pytest.skip("the kernel refuses file leases here: evicted files are unlinked")
    published = []

    class Spares(collections.deque):
        def append(self, name):
            path = os.path.join(store.spare_dir, name)
            try:  # refused at once (EWOULDBLOCK) while someone holds a lease on it
                os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
                published.append("free")
            except BlockingIOError:
                published.append("leased")
            super().append(name)

    store._spares = Spares(store._spares)
    put(store, 1, b"a" * 5000)
    drop(store, 1)
    assert published == ["free"]


LEASE_BREAK = """
import fcntl, os, sys, threading, time
from tierfs.hot import store as hot_store

store = hot_store.HotStore(sys.argv[1])
if not store.leases:
    print("no leases"); sys.exit(0)
store.install_temp(store.write_temp(1, 0, b"a" * 5000), 1, 0)
real_ftruncate = os.ftruncate

def ftruncate_while_someone_opens(fd, length):
    # Someone opens the file while _make_spare holds its lease: the kernel starts
    # breaking the lease (and signals this process) before the truncate goes on.
    path = os.readlink(f"/proc/self/fd/{fd}")  # in the trash by now
    threading.Thread(target=lambda: os.close(os.open(path, os.O_RDONLY)), daemon=True).start()
    deadline = time.monotonic() + 30
    while fcntl.fcntl(fd, fcntl.F_GETLEASE) == fcntl.F_WRLCK:  # until the break begins
        assert time.monotonic() < deadline, "the lease was never broken"
        time.sleep(0.001)
    real_ftruncate(fd, length)

hot_store.os.ftruncate = ftruncate_while_someone_opens
store.remove(1, 0)
assert store.trash.settle(60)
print("alive")
"""


def test_a_lease_break_does_not_end_the_process(tmp_path):
    """The kernel announces a lease break with SIGIO, whose default action ends the
    process: a daemon whose evicted file someone opened at that moment died without a
    word. In a child process, so that a failure cannot take the tests down."""
    res = subprocess.run([sys.executable, "-c", LEASE_BREAK, str(tmp_path / "hot")],
                         capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    if res.stdout.strip() == "no leases":
        pytest.skip("the kernel refuses file leases here: evicted files are unlinked")
    assert (res.returncode, res.stdout.strip()) == (0, "alive"), res.stderr


def test_a_fetched_extent_is_written_into_its_spare_and_renamed_once(tmp_path, monkeypatch):
    """The spare is written where it lies: one rename per fetched extent, into place."""
    store = HotStore(str(tmp_path / "hot"))
    first = put(store, 1, b"a" * 5000)
    drop(store, 1)
    if not store.leases:
        pytest.skip("the kernel refuses file leases here: evicted files are unlinked")
    renames = []

    def recording(name):
        real = getattr(os, name)

        def call(src, dst):
            renames.append((name, os.path.dirname(src), os.path.dirname(dst)))
            return real(src, dst)
        return call

    for name in ("rename", "replace"):
        monkeypatch.setattr(os, name, recording(name))
    assert put(store, 257, b"b" * 3000) == first  # into the directory of inode 1's extents
    monkeypatch.undo()
    assert renames == [("replace", store.spare_dir, os.path.dirname(store.path(257, 0)))]
    with open(store.path(257, 0), "rb") as f:
        assert f.read() == b"b" * 3000


def test_spares_a_crash_left_with_bytes_in_them_are_dropped_at_start(tmp_path):
    """A crash between a fetch's write into a spare and its rename into place leaves
    bytes that nothing counts: a new store removes such spares and keeps empty ones.
    What is not a regular file (put there by hand) is left alone and never written."""
    old = HotStore(str(tmp_path / "hot"))
    empty = put(old, 1, b"a" * 100)
    drop(old, 1)
    old.close()
    if not old.leases:
        pytest.skip("the kernel refuses file leases here: evicted files are unlinked")
    spare_dir = tmp_path / "hot.spare"
    (spare_dir / "written-when-it-stopped").write_bytes(b"z" * 9000)
    (spare_dir / "a-directory").mkdir()
    (spare_dir / "a-link").symlink_to(tmp_path / "elsewhere")
    new = HotStore(str(tmp_path / "hot"))
    assert not (spare_dir / "written-when-it-stopped").exists()
    assert put(new, 2, b"b" * 10) == empty
    put(new, 3, b"c" * 10)  # no spare left: a new file, not the link or the directory
    assert not (tmp_path / "elsewhere").exists()
    assert sorted(os.listdir(spare_dir)) == ["a-directory", "a-link"]
    with open(new.path(3, 0), "rb") as f:
        assert f.read() == b"c" * 10


def test_spare_names_never_repeat_across_stores(tmp_path):
    """A new store in the same process (or a later one with the same pid) names its
    spares apart from those left behind: an eviction renamed onto a listed spare would
    swap the file under a fetch writing into it."""
    old = HotStore(str(tmp_path / "hot"))
    put(old, 1, b"a" * 100)
    drop(old, 1)
    old.close()
    if not old.leases:
        pytest.skip("the kernel refuses file leases here: evicted files are unlinked")
    left = set(os.listdir(old.spare_dir))
    new = HotStore(str(tmp_path / "hot"))
    put(new, 2, b"b" * 100)  # takes the spare left behind
    drop(new, 2)
    made = set(os.listdir(new.spare_dir))
    assert made and not made & left


def test_a_failed_write_leaves_no_file_behind(tmp_path):
    """A write that fails (a full disk) takes its temp file with it, spare or new."""
    store = HotStore(str(tmp_path / "hot"))
    put(store, 1, b"a" * 100)
    drop(store, 1)
    view = memoryview(bytearray(100))
    view.release()  # writing it raises ValueError, as a failed write raises OSError
    for _ in range(2):  # first into the spare (if leases work), then into a new file
        with pytest.raises(ValueError):
            store.write_temp(3, 0, view)
    assert spares(store) == []
    assert [n for _r, _d, names in os.walk(store.root) for n in names] == []


def test_a_spare_with_bytes_in_it_keeps_none_of_them(tmp_path, monkeypatch):
    """Spares are emptied when made, so a temp file is opened without O_TRUNC (ext4
    would otherwise push its bytes to the disk at close, in the worker thread); one
    found with bytes in it (put there by hand) is cut to the extent's length."""
    store = HotStore(str(tmp_path / "hot"))
    put(store, 1, b"a" * 100)
    drop(store, 1)
    if not store.leases:
        pytest.skip("the kernel refuses file leases here: evicted files are unlinked")
    [name] = os.listdir(store.spare_dir)
    with open(os.path.join(store.spare_dir, name), "wb") as f:
        f.write(b"z" * 9000)
    opened = []
    real_open = os.open

    def record(path, flags, *args):
        opened.append(flags)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", record)
    put(store, 2, b"b" * 3000)
    monkeypatch.undo()
    with open(store.path(2, 0), "rb") as f:
        assert f.read() == b"b" * 3000
    assert spares(store) == []  # the one left there was used
    assert len(opened) == 1 and not opened[0] & os.O_TRUNC
