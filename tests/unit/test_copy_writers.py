"""Runs of fetched copies written by the hot store's copy writer processes, and what
the store does where one cannot: write in its own thread, all or nothing."""
from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from tests.harness import wait_until

from tierfs.hot import copy_writers
from tierfs.hot.store import HotStore
from tierfs.registry import exited as gone


@pytest.fixture
def store(tmp_path):
    s = HotStore(str(tmp_path / "hot"), copy_writers=1)
    s.copy_writers.start()
    yield s
    s.close()


def helpers(store: HotStore) -> list:
    return list(store.copy_writers._idle)


def read(store: HotStore, ino: int, idx: int) -> bytes:
    with open(store.path(ino, idx), "rb") as f:
        return f.read()


def install(store: HotStore, items, temps) -> None:
    for (ino, idx, _data), tmp in zip(items, temps):
        store.install_temp(tmp, ino, idx)


def written_by_helper(store, items) -> bool:
    """Whether write_temps(items) went to the helper: it is away meanwhile."""
    seen = []
    inner = store.write_temp
    store.write_temp = lambda *args: seen.append(args) or inner(*args)
    try:
        install(store, items, store.write_temps(items))
    finally:
        del store.write_temp
    return not seen


def test_a_run_is_written_by_a_helper_process(store):
    items = [(ino, 0, os.urandom(1000 + ino)) for ino in range(1, 40)]
    assert written_by_helper(store, items), "the run was written in the thread"
    for ino, idx, data in items:
        assert read(store, ino, idx) == data


def test_a_store_without_started_helpers_writes_in_its_thread(tmp_path):
    s = HotStore(str(tmp_path / "hot"))
    try:
        items = [(1, 0, b"one"), (2, 0, b"two")]
        assert not written_by_helper(s, items)
        assert read(s, 1, 0) == b"one" and read(s, 2, 0) == b"two"
    finally:
        s.close()


def test_a_run_larger_than_the_shared_buffer_goes_in_parts(store):
    third = copy_writers.BUFFER_BYTES // 3 + 1
    items = [(ino, 0, os.urandom(third)) for ino in range(1, 5)]  # 4/3 of the buffer
    assert written_by_helper(store, items)
    for ino, idx, data in items:
        assert read(store, ino, idx) == data


def test_a_copy_larger_than_the_buffer_is_written_in_the_thread(store):
    items = [(1, 0, os.urandom(copy_writers.BUFFER_BYTES + 1)), (2, 0, b"small")]
    assert not written_by_helper(store, items)
    assert read(store, 1, 0) == items[0][2] and read(store, 2, 0) == b"small"


def test_spares_are_written_over_and_cut_to_the_new_size(store):
    store.install_temp(store.write_temp(9, 0, b"x" * 5000), 9, 0)
    store.remove(9, 0)
    assert store.trash.settle(10)
    if not store._spares:
        pytest.skip("no leases here: no spares")
    spare = store._spares[-1]
    with open(os.path.join(store.spare_dir, spare), "wb") as f:
        f.write(b"left behind" * 100)  # a spare someone else left non-empty
    items = [(10, 0, b"new")]
    temps = store.write_temps(items)
    assert temps == [os.path.join(store.spare_dir, spare)]
    install(store, items, temps)
    assert read(store, 10, 0) == b"new"


def test_a_run_written_in_the_thread_goes_into_the_spares_it_was_given(tmp_path):
    s = HotStore(str(tmp_path / "hot"))  # no helpers: the thread writes every run
    try:
        s.install_temp(s.write_temp(9, 0, b"x" * 5000), 9, 0)
        s.remove(9, 0)
        assert s.trash.settle(10)
        if not s._spares:
            pytest.skip("no leases here: no spares")
        spare = os.path.join(s.spare_dir, s._spares[-1])
        items = [(10, 0, b"new")]
        temps = s.write_temps(items)
        assert temps == [spare], "the spare was dropped, a new file written instead"
        install(s, items, temps)
        assert read(s, 10, 0) == b"new"
    finally:
        s.close()


def test_the_run_of_a_helper_that_died_is_written_in_the_thread(store, caplog):
    (helper,) = helpers(store)
    helper.proc.kill()
    helper.proc.wait()
    second = [(ino, 0, b"data %d" % ino) for ino in range(2, 10)]
    assert not written_by_helper(store, second)
    for ino, idx, data in second:
        assert read(store, ino, idx) == data
    assert "a hot copy writer process ended" in caplog.text
    assert helpers(store) == []  # not replaced: the threads write from now on
    third = [(20, 0, b"three")]
    assert not written_by_helper(store, third)
    assert read(store, 20, 0) == b"three"


def test_a_failed_write_raises_and_leaves_no_temp_files(store):
    store._spares.clear()  # new temp files, beside the extents' places
    ino = 0x105  # its directory, "05", is a file: no copy can be made there
    with open(os.path.join(store.root, f"{ino & 0xff:02x}"), "wb"):
        pass
    items = [(0x104, 0, b"fine"), (ino, 0, b"cannot"), (0x106, 0, b"fine too")]
    with pytest.raises(OSError) as raised:
        store.write_temps(items)
    assert raised.value.errno in (errno.ENOTDIR, errno.EEXIST)
    left = [os.path.join(d, f) for d, _s, files in os.walk(store.root) for f in files
            if ".tmp" in f]
    assert left == []


def test_helpers_hold_nothing_of_the_daemon_and_stop_on_close(tmp_path):
    keep = os.open(tmp_path, os.O_RDONLY)  # stands for the FUSE connection and the rest
    s = HotStore(str(tmp_path / "hot"), copy_writers=1)
    s.copy_writers.start()
    try:
        (helper,) = helpers(s)
        # A run written proves the helper has started: while it still loads its
        # modules, it holds the shared libraries it opens for a moment.
        assert written_by_helper(s, [(1, 0, b"ready")])
        fds = {int(fd): os.readlink(f"/proc/{helper.proc.pid}/fd/{fd}")
               for fd in os.listdir(f"/proc/{helper.proc.pid}/fd")}
        assert keep not in fds
        others = {fd: target for fd, target in fds.items() if fd > 2}
        assert list(others.values()) and all("tierfs-copies" in t for t in others.values()), fds
    finally:
        s.close()
        os.close(keep)
    assert helper.proc.poll() is not None, "close() left the helper running"


def test_helpers_die_with_the_daemon(tmp_path):
    """A helper that wrote on after a kill -9 of its daemon could write into a spare
    the next daemon took for empty: it dies with the daemon's main thread, also where
    its stdin does not end with the daemon (here a process that outlives the daemon
    holds it, as a helper busy with a run would not read it)."""
    code = ("import subprocess, sys, time\n"
            "from tierfs.hot.store import HotStore\n"
            "s = HotStore(sys.argv[1], copy_writers=2)\n"
            "s.copy_writers.start()\n"
            "helpers = s.copy_writers._idle\n"
            "keeper = subprocess.Popen(['sleep', '600'],\n"
            "                          pass_fds=[h.proc.stdin.fileno() for h in helpers])\n"
            "print(keeper.pid, *(h.proc.pid for h in helpers), flush=True)\n"
            "time.sleep(600)\n")
    daemon = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "hot")],
                              stdout=subprocess.PIPE, text=True)
    keeper = None
    try:
        keeper, *pids = [int(p) for p in daemon.stdout.readline().split()]
        assert len(pids) == 2
        for pid in pids:
            assert not gone(pid)
        daemon.kill()
        daemon.wait()
        wait_until(lambda: all(gone(pid) for pid in pids), 30, "the helpers to die")
    finally:
        daemon.kill()
        daemon.wait()
        if keeper is not None:
            os.kill(keeper, 9)


def test_the_pieces_of_one_span_are_copied_to_the_helper_at_once(store, monkeypatch):
    """The pieces of a fetched span (views of one buffer, in any order, with gaps
    between them) go to the helper in one copy of the stretch that holds them all,
    each file written with its own bytes; pieces of different buffers piece by piece."""
    span = bytearray(os.urandom(3 << 20))
    view = memoryview(span)
    cuts = [(200_000, 65_536), (0, 65_536), (70_000, 100_000), (1 << 20, 2 << 20)]
    items = [(ino, 0, view[start:start + length]) for ino, (start, length) in
             enumerate(cuts, start=1)]
    copies = []
    monkeypatch.setattr(copy_writers.ctypes, "memmove",
                        lambda dst, src, n, inner=copy_writers.ctypes.memmove:
                        copies.append(n) or inner(dst, src, n))
    assert written_by_helper(store, items)
    assert copies == [3 << 20], "not one copy of the stretch holding every piece"
    for ino, idx, data in items:
        assert read(store, ino, idx) == bytes(data)

    copies.clear()
    other = [(10, 0, memoryview(bytearray(b"a" * 5000))), (11, 0, view[5:9000]),
             (12, 0, b"read-only bytes")]
    assert written_by_helper(store, other)
    assert copies == [], "views of different buffers were copied as one stretch"
    for ino, idx, data in other:
        assert read(store, ino, idx) == bytes(data)
