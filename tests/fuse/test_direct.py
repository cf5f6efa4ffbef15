"""tierfs.open: direct reads from the hot extent files, through a real mount.

Every test that claims the direct path checks the daemon's counters, so a silent
fallback to open() fails it. The mount point and cache dir live in a directory any
user can reach (pytest's tmp_path is private to root), for the tests as other users.
"""
from __future__ import annotations

import concurrent.futures
import errno
import io
import json
import logging
import os
import pickle
import shutil
import socket
import subprocess
import threading
import zipfile

import pytest

import tierfs
from tierfs import direct as tdirect
from tierfs import read_pool
from tierfs.client import call
from tierfs.mount_file import MountFile
from tests.harness import cached_pages, in_child_as, short_tmpdir, wait_until, write_file
from tierfs.hot import HotStore, pagecache
from tests.fuse.test_tiering import pattern
from tierfs.mountpoint import mounts

E = 64 << 10  # extent size of these mounts
NOBODY = 65534
STAFF = 4242  # a group only the tests use


DEFAULT_MOUNT_BELOW = tdirect.MOUNT_BELOW


@pytest.fixture
def pub(mount_factory, monkeypatch):
    """make(*mount args) -> a started Mount (64 KiB extents) below a public directory.
    tierfs.open takes the direct path for files of any size here (by default small
    files go through the mount: test_small_files_are_read_through_the_mount)."""
    monkeypatch.setattr(tdirect, "MOUNT_BELOW", 0)
    base = short_tmpdir("tierfs-direct-")
    os.chmod(base, 0o755)
    made = []

    def make(*args, name="m"):
        m = mount_factory(args=("--extent-size", "64K", *args), start=False, name=name)
        m.mountpoint = os.path.join(base, f"{name}-mnt")
        m.cache_dir = os.path.join(base, f"{name}-cache")
        os.makedirs(m.mountpoint)
        made.append(m)
        m.start()
        return m

    yield make
    problems = []
    for m in made:  # before the directory goes (mount_factory's own cleanup is later)
        m.cleanup()
        problems += m.unexpected_log_lines()
    if not any(p.startswith(base + "/") for p in mounts()):
        shutil.rmtree(base, ignore_errors=True)
    if problems:
        pytest.fail("daemon logged unexpected errors:\n" + "\n".join(problems[:20]))


def counters(m) -> dict:
    res = m.cli("status", m.mountpoint, "--json", check=True)
    return json.loads(res.stdout)["counters"]


def grew(before: dict, after: dict, key: str) -> int:
    return after.get(key, 0) - before.get(key, 0)


def file_state(m, path) -> dict:
    return json.loads(m.cli("status", path, "--json", check=True).stdout)["file"]


def hot_file(m, path: str, idx: int) -> str:
    """The hot tier file of extent `idx` of the file at `path`."""
    return HotStore(os.path.join(m.cache_dir, "hot")).path(os.stat(path).st_ino, idx)


def write_sparse(path: str) -> bytes:
    """Extent 0 written, extents 1-2 a hole, extent 3 written in part: 3E + 5000 + 123."""
    head, tail = pattern(E, 1), pattern(5000, 2)
    with open(path, "wb") as f:
        f.write(head)
        f.seek(3 * E + 123)
        f.write(tail)
    return head + bytes(2 * E + 123) + tail


def is_direct(f) -> bool:
    return isinstance(getattr(f, "raw", f), tdirect.DirectFile)


def raw_request(m, req: dict) -> tuple[list, dict]:
    """A direct_open request sent by hand (no client-side checks): its results and
    final line. Descriptors that come along are closed."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(os.path.join(m.cache_dir, "control.sock"))
    sock.sendall(json.dumps({"cmd": "direct_open", **req}).encode() + b"\n")
    buf, results = b"", []
    with sock:
        while True:
            data, anc, _flags, _ = sock.recvmsg(1 << 16, socket.CMSG_SPACE(253 * 4))
            for _level, _kind, cdata in anc:
                for i in range(0, len(cdata) - len(cdata) % 4, 4):
                    os.close(int.from_bytes(cdata[i:i + 4], "little", signed=True))
            if not data:
                raise AssertionError("connection closed without a final line")
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                obj = json.loads(line)
                if "direct" not in obj:
                    return results, obj
                results += obj["direct"]


def as_user(uid: int, gid: int, groups: list[int], fn):
    """Run fn() in a forked child with uid/gid/groups; its JSON-able result, or
    {"errno": e, "type": name} for an OSError."""
    def run():
        try:
            return fn()
        except OSError as e:
            return {"errno": e.errno, "type": type(e).__name__}

    return in_child_as(uid, gid, groups, run)


# ---- contents and the file object --------------------------------------------------------

def test_contents_of_every_shape_of_file(pub):
    m = pub()
    files = {
        "empty": b"",
        "small": pattern(1000, 3),
        "exact": pattern(2 * E, 4),
        "odd": pattern(5 * E + 17, 5),
        "big": pattern(70 * E + 999, 6),   # more than one range of 64 descriptors
    }
    for name, data in files.items():
        write_file(m.path(name), data)
    files["sparse"] = write_sparse(m.path("sparse"))
    before = counters(m)
    for name, data in files.items():
        with tierfs.open(m.path(name), "rb") as f:
            assert is_direct(f), name
            assert f.read() == data, name
            assert f.read() == b""
    after = counters(m)
    assert grew(before, after, "direct_open_files") == len(files)
    # one descriptor per extent that has data: the sparse file's hole has none
    extents = 0 + 1 + 2 + 6 + 71 + 2
    assert grew(before, after, "direct_extents") == extents
    assert grew(before, after, "direct_bytes") == sum(map(len, files.values())) - 2 * E
    assert grew(before, after, "direct_requests") == len(files) + 1  # "big" asked twice
    shown = m.cli("status", m.mountpoint, check=True).stdout
    assert f"direct reads {len(files)} files opened" in shown


def test_small_files_are_read_through_the_mount(pub, monkeypatch):
    """By default tierfs.open reads a file below MOUNT_BELOW through the mount (cheaper
    for the daemon than a control round trip); open_many keeps batches direct."""
    monkeypatch.setattr(tdirect, "MOUNT_BELOW", DEFAULT_MOUNT_BELOW)
    m = pub()
    small, large = pattern(DEFAULT_MOUNT_BELOW - 1, 20), pattern(DEFAULT_MOUNT_BELOW, 21)
    write_file(m.path("small"), small)
    write_file(m.path("large"), large)
    before = counters(m)
    with tierfs.open(m.path("small"), "rb") as f:
        assert isinstance(f.raw, MountFile) and f.read() == small
    with tierfs.open(m.path("large"), "rb") as f:
        assert is_direct(f) and f.read() == large
    after = counters(m)
    assert grew(before, after, "direct_open_files") == 1
    files = tierfs.open_many([m.path("small")])
    try:
        assert is_direct(files[0]) and files[0].read() == small
    finally:
        files[0].close()
    assert grew(after, counters(m), "direct_open_files") == 1


def fuse_ops(m) -> dict:
    """FUSE requests the daemon answered so far, by kind, asked over the control
    socket (finding the daemon through the mount would add requests of its own)."""
    sock = os.path.join(m.cache_dir, "control.sock")
    return call(m.mountpoint, "status", daemon={"socket": sock})["fuse_ops"]


def test_a_small_file_costs_the_daemon_an_open_and_a_release(pub, monkeypatch):
    """open() fstats every file, and on a mount with the writeback cache the block
    count the kernel forgets at every close costs a getattr each time. tierfs.open of
    a small file asks the kernel only what it has cached: the daemon answers an open
    and a release per file, nothing else (the pages are in the page cache)."""
    monkeypatch.setattr(tdirect, "MOUNT_BELOW", DEFAULT_MOUNT_BELOW)
    m = pub()
    data = pattern(3 * E + 5, 22)
    write_file(m.path("f"), data)
    n = 10

    def requests_of(opener, buffering) -> dict:
        before = fuse_ops(m)
        for _ in range(n):
            with opener(m.path("f"), "rb", buffering=buffering) as f:
                assert f.read() == data
        # A release reaches the daemon after close() returns.
        return wait_until(lambda: (d := {op: k - before.get(op, 0) for op, k in
                                         fuse_ops(m).items() if k != before.get(op, 0)}
                                   ).get("release", 0) >= n and d, 30, f"{n} releases")

    for buffering in (-1, 0):
        requests_of(tierfs.open, buffering)  # pages and attributes cached
        assert requests_of(open, buffering).get("getattr", 0) >= n  # what is saved
        assert requests_of(tierfs.open, buffering) == {"open": n, "release": n}


def test_a_mount_elsewhere_does_not_make_tierfs_open_ask_the_daemon_again(pub, tmp_path):
    """tierfs.open keeps what it learnt about a mount while that mount stays: other
    filesystems mounted and unmounted meanwhile (other jobs, other tests) cost the
    daemon no new lookup of its control xattr."""
    m = pub()
    write_file(m.path("f"), pattern(E, 24))
    with tierfs.open(m.path("f"), "rb") as f:
        f.read()  # the mount is known from now on
    before = fuse_ops(m).get("getxattr", 0)
    other = tmp_path / "other"
    other.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tierfs-test", str(other)],
                   check=True)
    try:
        with tierfs.open(m.path("f"), "rb") as f:
            assert f.read() == pattern(E, 24)
    finally:
        subprocess.run(["umount", str(other)], check=True)
    with tierfs.open(m.path("f"), "rb") as f:
        assert f.read() == pattern(E, 24)
    assert fuse_ops(m).get("getxattr", 0) == before


def test_a_small_file_object_behaves_as_open_gives_it(pub, monkeypatch):
    monkeypatch.setattr(tdirect, "MOUNT_BELOW", DEFAULT_MOUNT_BELOW)
    m = pub()
    data = pattern(2 * E + 77, 23)
    write_file(m.path("f"), data)
    with tierfs.open(m.path("f"), "rb", buffering=0) as raw:
        assert isinstance(raw, MountFile)
        assert raw.name == m.path("f") and raw.mode == "rb"
        assert raw.readable() and raw.seekable() and not raw.writable()
        assert raw.read(10) == data[:10] and raw.tell() == 10
        assert os.lseek(raw.fileno(), 0, os.SEEK_CUR) == 10  # its descriptor's offset
        assert raw.seek(-7, io.SEEK_END) == len(data) - 7 and raw.readall() == data[-7:]
        raw.seek(E)
        buf = bytearray(E)
        assert raw.readinto(buf) == E and bytes(buf) == data[E:2 * E]
        assert os.read(raw.fileno(), 5) == data[2 * E:2 * E + 5]
        assert raw.read() == data[2 * E + 5:] and raw.read() == b""
    with pytest.raises(ValueError):
        raw.read(1)
    with tierfs.open(m.path("f"), "rb") as f:
        assert isinstance(f, io.BufferedReader) and f.name == m.path("f")
        assert f.read(100) == data[:100] and f.read() == data[100:]
    with tierfs.open(os.fsencode(m.path("f")), "rb") as f:  # a bytes path stays one
        assert f.name == os.fsencode(m.path("f")) and f.read() == data
    obj = {"weights": list(range(500)), "blob": data[:1000]}
    with open(m.path("obj.pkl"), "wb") as f:
        pickle.dump(obj, f)
    with zipfile.ZipFile(m.path("a.zip"), "w") as z:
        z.writestr("x.bin", data[:E])
    with tierfs.open(m.path("obj.pkl"), "rb") as f:   # libraries read through it
        assert isinstance(f.raw, MountFile) and pickle.load(f) == obj
    with tierfs.open(m.path("a.zip"), "rb") as f, zipfile.ZipFile(f) as z:
        assert isinstance(f.raw, MountFile) and z.read("x.bin") == data[:E]
    os.chmod(m.path("f"), 0o600)  # the kernel checks the open, as for open()

    def read_as_other():
        with tierfs.open(m.path("f"), "rb") as f:
            return f.read().hex()
    assert as_user(NOBODY, NOBODY, [], read_as_other) == {
        "errno": errno.EACCES, "type": "PermissionError"}
    os.chmod(m.path("f"), 0o644)
    assert as_user(NOBODY, NOBODY, [], read_as_other) == data.hex()


def test_seek_tell_read_and_readinto(pub):
    m = pub()
    data = pattern(4 * E + 4321, 7)
    write_file(m.path("f"), data)
    with tierfs.open(m.path("f"), "rb") as f:
        assert f.name == m.path("f") and f.mode == "rb"
        assert f.readable() and f.seekable() and not f.writable()
        assert f.read(10) == data[:10] and f.tell() == 10
        f.seek(E - 5)
        assert f.read(10) == data[E - 5:E + 5]          # across an extent boundary
        assert f.seek(-100, io.SEEK_END) == len(data) - 100
        assert f.read() == data[-100:]
        f.seek(E, io.SEEK_SET)
        assert f.seek(3, io.SEEK_CUR) == E + 3
        buf = bytearray(2 * E)
        assert f.readinto(buf) == 2 * E and bytes(buf) == data[E + 3:3 * E + 3]
        f.seek(len(data) + 10)
        assert f.read(5) == b"" and f.readinto(bytearray(5)) == 0
        with pytest.raises(OSError) as e:
            f.seek(-1)
        assert e.value.errno == errno.EINVAL
        fd = f.fileno()  # the file on the mount (mmap, np.memmap need one)
        assert os.fstat(fd).st_ino == os.stat(m.path("f")).st_ino
        assert os.pread(fd, 10, E - 5) == data[E - 5:E + 5]
        assert f.tell() == len(data) + 10  # its own position is its own
    with pytest.raises(ValueError):
        f.read(1)
    with tierfs.open(m.path("f"), "rb", buffering=0) as raw:  # unbuffered: the raw reader
        assert isinstance(raw, tdirect.DirectFile)
        view = memoryview(bytearray(3 * E))
        assert raw.readinto(view[:E + 7]) == E + 7 and view[:E + 7] == data[:E + 7]
        assert raw.readall() == data[E + 7:]
        # read(n) fills the bytes it returns: all n of them across extents, and no
        # byte past them taken from the file (the next read starts right after).
        raw.seek(E - 3)
        got = raw.read(2 * E + 6)
        assert type(got) is bytes and got == data[E - 3:3 * E + 3] and raw.tell() == 3 * E + 3
        assert raw.read(0) == b"" and raw.read(5) == data[3 * E + 3:3 * E + 8]
        raw.seek(len(data) - 4)
        assert raw.read(100) == data[-4:] and raw.read(100) == b"" and raw.tell() == len(data)


def test_large_reads_read_their_extents_at_once(pub, monkeypatch):
    """A read across several extents reads their files at once (read_pool's threads
    and the reader's own), holes and short tails included, across the boundary of
    the range of descriptors held; a forked child does it with threads of its own."""
    monkeypatch.setattr(read_pool, "PARALLEL_MIN", 1)  # 64 KiB extents: every such read
    readers = []
    real = read_pool.pread_full

    def spy(fd, out, offset):
        readers.append(threading.current_thread().name)
        return real(fd, out, offset)

    monkeypatch.setattr(read_pool, "pread_full", spy)
    m = pub()
    big = pattern(70 * E + 999, 22)  # extents 0-15 come with the open, 16-70 in a range
    write_file(m.path("big"), big)
    sparse = write_sparse(m.path("sparse"))
    with tierfs.open(m.path("big"), "rb", buffering=0) as f:
        buf = bytearray(len(big) + 10)
        assert is_direct(f) and f.readinto(buf) == len(big)
        assert bytes(buf[:len(big)]) == big
    assert len(readers) == 71
    assert any(name.startswith("tierfs-read") for name in readers)
    assert threading.current_thread().name in readers
    with tierfs.open(m.path("sparse"), "rb", buffering=0) as f:
        buf = bytearray(len(sparse))
        assert f.readinto(buf) == len(sparse) and bytes(buf) == sparse
    with tierfs.open(m.path("big"), "rb") as f:
        f.seek(60 * E + 5)
        assert f.read(8 * E) == big[60 * E + 5:68 * E + 5]

    def read_in_child() -> bool:
        with tierfs.open(m.path("big"), "rb") as g:
            return is_direct(g) and g.read() == big

    assert as_user(0, 0, [], read_in_child) is True


def test_a_sequential_reader_gets_the_next_range_before_it_needs_it(pub, monkeypatch):
    """A file opens with its first FIRST_RANGE extents. A reader going through it in
    order has each next range asked for in the background, so its own thread never
    waits for a request of its own; one that seeks away has the range asked for
    ahead dropped and its descriptors closed; a forked child reads on without the
    parent's pending request."""
    asked = []
    real = tdirect._ask

    def spy(mount, req):
        if "ino" in req:  # a range of a file opened before
            asked.append((threading.current_thread().name, req["first_extent"]))
        return real(mount, req)

    monkeypatch.setattr(tdirect, "_ask", spy)
    m = pub()
    big = pattern(100 * E + 123, 31)  # ranges: 0-15 (with the open), 16-79, 80-100
    write_file(m.path("big"), big)
    with tierfs.open(m.path("big"), "rb", buffering=0) as f:
        assert is_direct(f) and (f._lo, f._hi) == (0, tdirect.FIRST_RANGE - 1)
        got = bytearray()
        while chunk := f.read(E // 2):
            got += chunk
    assert bytes(got) == big
    assert [first for _thread, first in asked] == [16, 80]
    assert all(thread.startswith("tierfs-read") for thread, _first in asked), asked

    def open_fds() -> int:
        """Descriptors of hot extent files this process holds (the pool threads'
        connections to the daemon, kept once made, are not counted)."""
        held = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                held += os.readlink(f"/proc/self/fd/{fd}").startswith(m.cache_dir)
            except OSError:
                pass  # the listing's own descriptor, closed since
        return held

    asked.clear()
    baseline = open_fds()
    with tierfs.open(m.path("big"), "rb", buffering=0) as f:
        for k in range(3):  # streaming (two extents entered in a row): 16-79 asked for
            assert f.read(E) == big[k * E:(k + 1) * E]
        _first, _pid, answer = f._next_range
        wait_until(answer.done, timeout=30, what="the range asked for ahead")
        f.seek(90 * E)                         # not where that range starts
        assert f.read(E) == big[90 * E:91 * E]
    assert open_fds() == baseline  # the range never used came and was closed
    assert [first for _thread, first in asked] == [16, 90]
    with tierfs.open(m.path("big"), "rb", buffering=0) as f:  # closed with a range unused
        for k in range(3):
            assert f.read(E) == big[k * E:(k + 1) * E]
        _first, _pid, answer = f._next_range
        wait_until(answer.done, timeout=30, what="the range asked for ahead")
        assert open_fds() >= baseline + 16 + 64  # its descriptors are here
    assert open_fds() == baseline

    with tierfs.open(m.path("big"), "rb") as f:  # buffered: raw reads of two extents
        for k in range(6):
            assert f.read(E) == big[k * E:(k + 1) * E]
        wait_until(lambda: f.raw._next_range is not None, timeout=30,
                   what="a range asked for ahead")

        def read_on_in_child() -> bool:
            return f.read() == big[6 * E:]

        assert as_user(0, 0, [], read_on_in_child) is True
        assert f.read() == big[6 * E:]


def test_libraries_read_through_it(pub):
    m = pub()
    obj = {"weights": list(range(5000)), "blob": pattern(3 * E, 8)}
    with open(m.path("obj.pkl"), "wb") as f:
        pickle.dump(obj, f)
    with zipfile.ZipFile(m.path("a.zip"), "w") as z:
        z.writestr("x.bin", pattern(2 * E, 9))
        z.writestr("y.txt", "hello")
    before = counters(m)
    with tierfs.open(m.path("obj.pkl"), "rb") as f:
        assert pickle.load(f) == obj
    with tierfs.open(m.path("a.zip"), "rb") as f, zipfile.ZipFile(f) as z:
        assert z.read("x.bin") == pattern(2 * E, 9) and z.read("y.txt") == b"hello"
    assert grew(before, counters(m), "direct_open_files") == 2


def test_data_written_through_the_mount_is_seen_after_close(pub):
    m = pub()
    with open(m.path("f"), "wb") as f:
        f.write(pattern(E + 10, 10))
    with open(m.path("f"), "r+b") as f:   # rewrite the middle, then close
        f.seek(E - 3)
        f.write(b"NEW")
    expect = bytearray(pattern(E + 10, 10))
    expect[E - 3:E] = b"NEW"
    with tierfs.open(m.path("f"), "rb") as f:
        assert is_direct(f) and f.read() == bytes(expect)


def test_a_reader_at_the_end_sees_the_file_grow(pub):
    """A direct reader kept the size the file had at open: one following a file that
    another process appends to (a log, a shard still being written) stopped at the old
    end for good, where a reader through the mount reads on. At the end it asks the
    daemon whether the file grew, at most once a second, and reads on from fresh
    descriptors (the old last extent's file included)."""
    m = pub()
    first, more = pattern(E + 100, 21), pattern(3 * E, 22)
    write_file(m.path("log"), first)
    with tierfs.open(m.path("log"), "rb", buffering=0) as f:
        assert is_direct(f) and f.read() == first
        with open(m.path("log"), "ab") as w:
            w.write(more)
        got = bytearray()

        def read_on() -> bool:
            got.extend(f.read(1 << 20))
            return len(got) >= len(more)
        wait_until(read_on, 30, "the reader to see what was appended")
        assert bytes(got) == more
        assert f.seek(0, io.SEEK_END) == len(first) + len(more)
        f.seek(0)
        assert f.read() == first + more


def test_a_reader_at_the_end_of_whole_extents_sees_the_file_grow(pub):
    """The same where the file ended on an extent boundary: what is appended starts
    an extent of its own."""
    m = pub()
    first, more = pattern(2 * E, 24), pattern(E // 2, 25)
    write_file(m.path("log"), first)
    with tierfs.open(m.path("log"), "rb", buffering=0) as f:
        assert is_direct(f) and f.read() == first
        with open(m.path("log"), "ab") as w:
            w.write(more)
        wait_until(lambda: f.seek(0, io.SEEK_END) > len(first), 30,
                   "the reader to see the file grow")
        f.seek(len(first))
        assert f.read() == more


def test_reading_to_the_end_right_after_open_asks_the_daemon_nothing_more(pub):
    """The check for growth is for readers that wait at the end, not one more round
    trip for every file a data loader reads whole."""
    m = pub()
    write_file(m.path("f"), pattern(3 * E, 23))
    before = counters(m)
    with tierfs.open(m.path("f"), "rb", buffering=0) as f:
        assert is_direct(f) and f.read() == pattern(3 * E, 23) and f.read() == b""
    assert grew(before, counters(m), "direct_requests") == 1


def read_batch(paths: list[str], want: list[bytes]) -> None:
    """open_many of `paths`: every file direct, and read whole, `want`."""
    files = tierfs.open_many(paths)
    try:
        assert all(is_direct(f) for f in files)
        assert [f.read() for f in files] == want
    finally:
        for f in files:
            f.close()


def test_open_many_resolves_a_batch_in_one_request(pub):
    m = pub()
    names = [f"s{i:02d}" for i in range(20)]
    for i, name in enumerate(names):
        write_file(m.path(name), pattern(1000 + i, i))
    before = counters(m)
    read_batch([m.path(n) for n in names], [pattern(1000 + i, i) for i in range(20)])
    after = counters(m)
    assert grew(before, after, "direct_requests") == 1
    assert grew(before, after, "direct_open_files") == 20
    with pytest.raises(FileNotFoundError):
        tierfs.open_many([m.path("s00"), m.path("missing")])


def test_open_many_asks_the_kernel_nothing_for_names_it_has_not_cached(pub):
    """After a remount the kernel knows no name of the mount, and a stat of each file
    would be a FUSE lookup: open_many places the paths on the mount it knows by name
    and lets the daemon resolve them (what open() would raise comes from there)."""
    m = pub()
    os.mkdir(m.path("d"))
    names = [f"d/s{i:02d}" for i in range(30)]
    for i, name in enumerate(names):
        write_file(m.path(name), pattern(1000 + i, i))
    tierfs.open_many([m.path(names[0])])[0].close()  # this process knows the mount
    m.remount()
    lookups = fuse_ops(m).get("lookup", 0)
    read_batch([m.path(n) for n in names], [pattern(1000 + i, i) for i in range(30)])
    # The mount's device number may be a new one: finding the mount again may cost
    # a lookup or two, never one per file.
    assert fuse_ops(m).get("lookup", 0) - lookups <= 2
    with pytest.raises(FileNotFoundError):
        tierfs.open_many([m.path("d/s00"), m.path("d/missing")])
    with pytest.raises(IsADirectoryError):
        tierfs.open_many([m.path("d")])
    with pytest.raises(NotADirectoryError):
        tierfs.open_many([m.path("d/s00/x")])


def test_open_many_starts_the_disk_reads_of_a_batch_of_small_files_at_once(pub):
    """The reader takes a batch's small files one after another; their hot copies are
    read from the disk together as soon as the batch is open, not each in its turn."""
    m = pub()
    names = [f"s{i:02d}" for i in range(8)]
    for i, name in enumerate(names):
        write_file(m.path(name), pattern(3 * 4096, i))
    copies = [hot_file(m, m.path(n), 0) for n in names]
    m.cli("sync", m.mountpoint, "--wait", check=True)  # no upload reads them later
    os.sync()
    for copy in copies:  # clean now: the page cache may drop them
        fd = os.open(copy, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    assert all(cached_pages(c) < 3 for c in copies)
    files = tierfs.open_many([m.path(n) for n in names])
    try:
        assert all(is_direct(f) for f in files)
        wait_until(lambda: all(cached_pages(c) == 3 for c in copies), timeout=10,
                   what="the hot copies of the batch in the page cache, none of them read")
        assert [f.read() for f in files] == [pattern(3 * 4096, i) for i in range(8)]
    finally:
        for f in files:
            f.close()


def test_open_many_reads_a_filesystem_mounted_inside_the_mount_from_there(pub):
    """A path below another filesystem mounted inside the tierfs mount is that
    filesystem's file, not the one the daemon has under the same name; once it is
    unmounted the name is tierfs's again."""
    m = pub()
    os.mkdir(m.path("sub"))
    write_file(m.path("sub/f"), b"tierfs")
    tierfs.open_many([m.path("sub/f")])[0].close()  # this process knows the mount
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", m.path("sub")],
                   check=True)
    try:
        write_file(m.path("sub/f"), b"tmpfs")
        [f] = tierfs.open_many([m.path("sub/f")])
        with f:
            assert not is_direct(f) and f.read() == b"tmpfs"
    finally:
        subprocess.run(["umount", m.path("sub")], check=True)
    before = counters(m)
    [f] = tierfs.open_many([m.path("sub/f")])
    with f:
        assert is_direct(f) and f.read() == b"tierfs"
    assert grew(before, counters(m), "direct_open_files") == 1


def test_later_ranges_follow_the_open_file_not_its_name(pub):
    m = pub()
    old, new = pattern(80 * E, 11), pattern(80 * E, 12)
    write_file(m.path("f"), old)
    with tierfs.open(m.path("f"), "rb") as f:
        assert f.read(E) == old[:E]
        os.rename(m.path("f"), m.path("g"))
        write_file(m.path("f"), new)
        os.unlink(m.path("g"))             # unlinked while open: still readable
        f.seek(70 * E)                     # beyond the first range of 64 extents
        assert f.read() == old[70 * E:]


def test_a_file_renamed_over_between_the_answer_and_the_open_is_not_mixed(pub, monkeypatch):
    """The daemon resolved the path to one file; before the library opened the path
    through the mount (for the ranges after the first), another file was renamed over
    it. Reading on would take the old file's first extents and the new file's later
    ones: the library opens the new file whole instead."""
    m = pub()
    old, new = pattern(80 * E, 13), pattern(80 * E, 14)
    write_file(m.path("f"), old)
    write_file(m.path("f.next"), new)
    real_file = tdirect._file

    def renamed_first(*args):
        os.rename(m.path("f.next"), m.path("f"))  # the window after the daemon's answer
        return real_file(*args)
    monkeypatch.setattr(tdirect, "_file", renamed_first)
    with tierfs.open(m.path("f"), "rb") as f:
        assert f.read() == new


def test_descriptors_from_the_daemon_are_close_on_exec(pub):
    """As open() makes its descriptors: a program the reader runs gets none of the hot
    extent files (a child writing into one after the parent's close would go unseen)."""
    import fcntl
    m = pub()
    write_file(m.path("f"), pattern(3 * E, 15))
    with tierfs.open(m.path("f"), "rb") as f:
        assert is_direct(f)
        hot = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{fd}").startswith(m.cache_dir):
                    hot.append(int(fd))
            except FileNotFoundError:
                pass  # the listing's own descriptor
        assert hot
        assert all(fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC for fd in hot)


def test_kept_connection_across_fork_and_remount(pub):
    m = pub()
    write_file(m.path("f"), pattern(E + 1, 19))
    before = counters(m)
    with tierfs.open(m.path("f"), "rb") as f:   # this thread now keeps a connection
        assert is_direct(f)
    child = as_user(0, 0, [], lambda: [is_direct(g) and g.read() == pattern(E + 1, 19)
                                       for g in [tierfs.open(m.path("f"), "rb")]])
    assert child == [True]                       # the child asked on a connection of its own
    with tierfs.open(m.path("f"), "rb") as f:   # and the parent's still works
        assert is_direct(f) and f.read() == pattern(E + 1, 19)
    assert grew(before, counters(m), "direct_open_files") == 3
    m.remount()  # the kept connection now leads to a daemon that is gone
    with tierfs.open(m.path("f"), "rb") as f:
        assert is_direct(f) and f.read() == pattern(E + 1, 19)
    assert counters(m)["direct_open_files"] == 1


# ---- tiering: cold, damaged, evicted -----------------------------------------------------

def test_cold_file_is_fetched_then_read_directly(pub):
    m = pub()
    data = pattern(3 * E + 500, 13)
    write_file(m.path("f"), data)
    m.cli("sync", m.mountpoint, "--wait", check=True)
    m.cli("release", m.path("f"), check=True)
    assert file_state(m, m.path("f"))["hot"] == 0
    before = counters(m)
    with tierfs.open(m.path("f"), "rb") as f:
        assert is_direct(f) and f.read() == data
    after = counters(m)
    # Its four extents are packed together: one GET brings the other three along.
    assert grew(before, after, "cold_reads") + grew(before, after, "read_around_extents") == 4
    assert grew(before, after, "direct_fetched_extents") == 4
    assert grew(before, after, "direct_extents") == 4
    assert file_state(m, m.path("f"))["hot"] == len(data)


def test_damaged_hot_copy_is_detected_and_refetched(pub):
    m = pub()
    m.allowed_log.append("hot copy is damaged")
    data = pattern(2 * E, 14)
    write_file(m.path("f"), data)
    m.cli("sync", m.mountpoint, "--wait", check=True)
    m.remount()  # nothing verified since this mount
    with open(hot_file(m, m.path("f"), 1), "r+b") as f:
        f.seek(10)
        f.write(b"\x00rot\x00")
    before = counters(m)
    with tierfs.open(m.path("f"), "rb") as f:
        assert is_direct(f) and f.read() == data
    after = counters(m)
    assert grew(before, after, "hot_checksum_errors") == 1
    assert grew(before, after, "cold_reads") == 1   # the damaged extent, from the bucket
    assert grew(before, after, "direct_extents") == 2


def test_descriptors_stay_valid_when_the_extents_are_evicted(pub):
    m = pub()
    data = pattern(3 * E, 15)
    write_file(m.path("f"), data)
    m.cli("sync", m.mountpoint, "--wait", check=True)
    with tierfs.open(m.path("f"), "rb") as f:
        assert is_direct(f) and f.read(100) == data[:100]
        m.cli("release", m.path("f"), check=True)
        assert file_state(m, m.path("f"))["hot"] == 0
        assert not os.path.exists(hot_file(m, m.path("f"), 0))
        # Other data fetched meanwhile reuses evicted files: never the ones still open.
        write_file(m.path("g"), pattern(3 * E, 16))
        m.cli("sync", m.mountpoint, "--wait", check=True)
        m.cli("release", m.path("g"), check=True)
        m.cli("prefetch", m.path("g"), check=True)
        before = counters(m)
        assert f.read() == data[100:]
    assert grew(before, counters(m), "cold_reads") == 0  # the old descriptors served it


def test_read_ahead_is_asked_for_extents_the_page_cache_lacks(pub, monkeypatch):
    """A sequential reader starts the kernel's readahead of the extents ahead
    (POSIX_FADV_SEQUENTIAL and a read of their first byte), except of those already
    cached; a read across extents after a seek has them all read (WILLNEED)."""
    m = pub()
    data = pattern(8 * E, 16)
    p = m.path("f")
    write_file(p, data)
    m.cli("sync", m.mountpoint, "--wait", check=True)  # clean pages: evictable below
    advised, streamed = [], []
    real = os.posix_fadvise

    def spy(fd, offset, length, advice):
        if advice == os.POSIX_FADV_WILLNEED:
            advised.append(os.readlink(f"/proc/self/fd/{fd}"))
        elif advice == os.POSIX_FADV_SEQUENTIAL:
            streamed.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd, offset, length, advice)

    monkeypatch.setattr(tdirect.os, "posix_fadvise", spy)

    def read_sequentially() -> bytes:
        with tierfs.open(p, "rb", buffering=0) as f:
            assert is_direct(f)
            return b"".join(iter(lambda: f.read(E // 2), b""))

    assert read_sequentially() == data  # the daemon just wrote them: all cached
    if not pagecache.cachestat_works:
        pytest.skip("this kernel cannot tell what the page cache holds (cachestat, Linux 6.5)")
    assert advised == [] and streamed == []

    files = [hot_file(m, p, i) for i in range(8)]

    def evicted() -> bool:
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)  # only clean pages can be dropped
                real(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return not any(cached_pages(path) for path in files)

    def evict() -> None:  # out of the page cache, as after memory pressure
        wait_until(evicted, 10, "the extent files to leave the page cache")

    evict()
    assert read_sequentially() == data
    assert advised == []  # never whole extents into single pages for a stream
    assert streamed and set(streamed) <= {hot_file(m, p, i) for i in range(1, 8)}
    assert len(streamed) == len(set(streamed))  # each extent once
    # A reader that steps over a few bytes between its reads (torch.load's zip reader
    # skips each record's header) is still sequential: streamed, not advised.
    evict()
    streamed.clear()
    with tierfs.open(p, "rb", buffering=0) as f:
        pos, parts = 0, []
        while pos < len(data):
            parts.append((pos, f.read(E // 3)))
            pos = f.seek(pos + E // 3 + 16)
    assert all(part == data[at:at + E // 3] for at, part in parts)
    assert advised == []
    assert streamed and set(streamed) <= {hot_file(m, p, i) for i in range(1, 8)}
    # After a seek, a read across extents (torch.load reads each tensor so) gets every
    # extent it covers started at once, its first one too.
    evict()
    advised.clear()
    streamed.clear()
    with tierfs.open(p, "rb", buffering=0) as f:
        f.seek(2 * E + 100)
        assert f.read(3 * E) == data[2 * E + 100:5 * E + 100]
    assert sorted(advised) == [hot_file(m, p, i) for i in range(2, 6)]
    assert streamed == []


def test_reads_go_on_after_the_daemon_is_killed(pub):
    m = pub()
    data = pattern(5 * E + 1, 16)
    write_file(m.path("f"), data)
    f = tierfs.open(m.path("f"), "rb")
    try:
        assert is_direct(f) and f.read(10) == data[:10]
        assert counters(m)["direct_extents"] == 6
        m.kill9()
        assert f.read() == data[10:]
        f.seek(0)
        assert f.read(E) == data[:E]
    finally:
        f.close()


# ---- permissions -------------------------------------------------------------------------

def test_permissions_for_other_users(pub):
    m = pub()
    os.makedirs(m.path("private"))
    os.chmod(m.path("private"), 0o700)
    specs = {"public": 0o644, "secret": 0o600, "staff": 0o640, "private/f": 0o644}
    for name, mode in specs.items():
        write_file(m.path(name), name.encode() * 100)
        os.chmod(m.path(name), mode)
    os.chown(m.path("staff"), 0, STAFF)

    def try_open(name):
        def run():
            with tierfs.open(m.path(name), "rb") as f:
                return {"direct": is_direct(f), "data": f.read().decode()}
        return run

    with tierfs.open(m.path("secret"), "rb") as f:  # root's kept connection: the children
        assert is_direct(f)                            # inherit it, and must not use it
    before = counters(m)
    got = {name: as_user(NOBODY, NOBODY, [], try_open(name)) for name in specs}
    assert got["public"] == {"direct": True, "data": "public" * 100}
    assert got["secret"] == {"errno": errno.EACCES, "type": "PermissionError"}
    assert got["staff"] == {"errno": errno.EACCES, "type": "PermissionError"}
    assert got["private/f"] == {"errno": errno.EACCES, "type": "PermissionError"}
    assert as_user(NOBODY, NOBODY, [STAFF], try_open("staff")) == {
        "direct": True, "data": "staff" * 100}
    after = counters(m)
    assert grew(before, after, "direct_open_files") == 2
    # secret and staff: the mode bits refuse, and only the kernel knows whether the
    # caller's capabilities allow, so the daemon sent them to the mount, where the
    # kernel refused; private/f the kernel refused already (the client's stat) ...
    assert grew(before, after, "direct_use_mount") == 2

    # ... and a client that skips its own checks gets no descriptor of them either.
    def ask(names):
        return lambda: ["mount" if "use_mount" in r else r.get("errno", 0)
                        for r in raw_request(m, {"paths": names})[0]]
    assert as_user(NOBODY, NOBODY, [], ask(list(specs))) == [0, "mount", "mount", "mount"]
    assert as_user(NOBODY, NOBODY, [STAFF], ask(["staff", "private/f"])) == [0, "mount"]
    assert ask(list(specs))() == [0, 0, 0, 0]  # root owns them all


def test_continuation_handles_belong_to_their_user(pub):
    m = pub()
    write_file(m.path("f"), pattern(3 * E, 17))
    res, final = raw_request(m, {"paths": ["f"]})
    assert final["ok"] and res[0]["extents"] == [[0, "fd"], [1, "fd"], [2, "fd"]]
    again = {"ino": res[0]["ino"], "token": res[0]["token"], "first_extent": 1,
             "last_extent": 2}
    res2, _ = raw_request(m, again)
    assert res2[0]["first"] == 1 and res2[0]["extents"] == [[1, "fd"], [2, "fd"]]
    stolen = as_user(NOBODY, NOBODY, [], lambda: raw_request(m, again)[1])
    assert stolen["ok"] is False and stolen["errno"] == errno.ESTALE
    forged, final = raw_request(m, {**again, "token": "0" * 32})
    assert final["errno"] == errno.ESTALE


# ---- errors and fallbacks ----------------------------------------------------------------

def test_errors_are_those_of_open(pub):
    m = pub()
    os.makedirs(m.path("d"))
    write_file(m.path("d/f"), b"x")
    with pytest.raises(FileNotFoundError) as e:
        tierfs.open(m.path("d/missing"), "rb")
    assert e.value.filename == m.path("d/missing")
    with pytest.raises(IsADirectoryError):
        tierfs.open(m.path("d"), "rb")
    with pytest.raises(NotADirectoryError):
        tierfs.open(m.path("d/f/x"), "rb")
    # the daemon's own answers, for paths a client sends without looking first
    res, _ = raw_request(m, {"paths": ["d", "d/missing", "d/f/x", "d/f"]})
    assert [r.get("errno", 0) for r in res] == [errno.EISDIR, errno.ENOENT, errno.ENOTDIR, 0]


def test_symlinks(pub, tmp_path):
    m = pub()
    data = pattern(E + 5, 18)
    write_file(m.path("target"), data)
    os.symlink("target", m.path("rel"))
    os.symlink(m.path("target"), m.path("abs"))
    write_file(str(tmp_path / "outside"), b"outside")
    os.symlink(str(tmp_path / "outside"), m.path("out"))
    before = counters(m)
    for name in ("rel", "abs"):
        with tierfs.open(m.path(name), "rb") as f:
            assert is_direct(f) and f.read() == data
    with tierfs.open(m.path("out"), "rb") as f:
        assert not is_direct(f) and f.read() == b"outside"
    after = counters(m)
    assert grew(before, after, "direct_open_files") == 2
    res, _ = raw_request(m, {"paths": ["out", "rel"]})
    assert "use_mount" in res[0] and res[1]["size"] == len(data)


def test_fallbacks_to_the_builtin_open(pub, tmp_path, caplog):
    m = pub()
    local = tmp_path / "local.bin"
    local.write_bytes(b"local data")
    before = counters(m)
    tdirect._noted.clear()  # what this process has logged already
    with caplog.at_level(logging.INFO, logger="tierfs.direct"):
        with tierfs.open(str(local), "rb") as f:
            assert isinstance(f.raw, io.FileIO) and f.read() == b"local data"
        with tierfs.open(local, "rb") as f:   # a PathLike too
            assert f.read() == b"local data"
        with tierfs.open(m.path("w"), "w") as f:  # text modes are the builtin open's
            assert isinstance(f.buffer.raw, io.FileIO)
            f.write("written through the mount")
        with tierfs.open(m.path("w"), "r") as f:
            assert f.read() == "written through the mount"
    assert grew(before, counters(m), "direct_open_files") == 0
    with open(m.path("w"), "rb") as f:
        assert f.read() == b"written through the mount"
    notes = [r.getMessage() for r in caplog.records if r.name == "tierfs.direct"]
    assert sum("not on a tierfs mount" in n for n in notes) == 1   # once per reason
    assert sum("mode 'w'" in n for n in notes) == 1
    assert all(r.levelno < logging.ERROR for r in caplog.records)


def test_no_default_permissions_mount_reads_through_the_mount(pub):
    m = pub("--no-default-permissions")
    write_file(m.path("f"), b"data")
    _res, final = raw_request(m, {"paths": ["f"]})
    assert final["ok"] and "no-default-permissions" in final["use_mount"]
    tdirect._mounts.clear()  # a fresh process's view: no cached answer
    with tierfs.open(m.path("f"), "rb") as f:
        assert not is_direct(f) and f.read() == b"data"
    assert counters(m).get("direct_open_files", 0) == 0


def test_a_device_number_used_before_the_mount_came_is_learnt_again(pub):
    """An unmounted filesystem's device number goes to the next one mounted. What
    this process learnt about the number before the tierfs mount came (here: "not
    a tierfs mount", as a tmpfs mounted and unmounted earlier would leave it) must
    not send the new mount's files to the builtin open()."""
    m = pub()
    write_file(m.path("f"), b"data")
    dev = os.stat(m.mountpoint).st_dev
    before = ()  # the number's mounts then (tierfs.mount_table.TABLE.mounts_of): none
    tdirect._mounts[dev] = (None, float("inf"), before)  # learnt before the mount
    with tierfs.open(m.path("f"), "rb") as f:
        assert is_direct(f) and f.read() == b"data"
    tdirect._mounts[dev] = (None, float("inf"), before)
    [f] = tierfs.open_many([m.path("f")])
    with f:
        assert is_direct(f) and f.read() == b"data"
    assert counters(m).get("direct_open_files") == 2


def test_unreachable_or_older_daemon_reads_through_the_mount(pub, caplog):
    m = pub()
    write_file(m.path("f"), b"data")
    sock = os.path.join(m.cache_dir, "control.sock")
    os.rename(sock, sock + ".away")
    tdirect._noted.clear()
    try:
        tdirect._mounts.clear()
        with caplog.at_level(logging.INFO, logger="tierfs.direct"):
            with tierfs.open(m.path("f"), "rb") as f:          # nobody listens
                assert not is_direct(f) and f.read() == b"data"
            # a daemon of an older version: it does not know the command
            old = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            old.bind(sock)
            old.listen(1)
            with old, concurrent.futures.ThreadPoolExecutor(1) as pool:
                def answer():
                    conn, _ = old.accept()
                    with conn:
                        conn.recv(65536)
                        conn.sendall(b'{"ok": false, "error": "unknown command '
                                     b'\'direct_open\'"}\n')
                served = pool.submit(answer)
                tdirect._mounts.clear()
                with tierfs.open(m.path("f"), "rb") as f:
                    assert not is_direct(f) and f.read() == b"data"
                served.result(timeout=10)
            os.unlink(sock)
    finally:
        os.rename(sock + ".away", sock)
    notes = [r.getMessage() for r in caplog.records if r.name == "tierfs.direct"]
    assert any("cannot reach the tierfs daemon" in n for n in notes)
    assert any("does not offer direct reads" in n for n in notes)
    assert all(r.levelno < logging.ERROR for r in caplog.records)
    tdirect._mounts.clear()
    with tierfs.open(m.path("f"), "rb") as f:
        assert is_direct(f)
    assert counters(m).get("direct_open_files") == 1


def test_a_stopped_daemon_fails_a_direct_open_instead_of_hanging(mount_factory):
    """A daemon that takes the connection and never answers (stopped with SIGSTOP, or
    stuck) left tierfs.open waiting forever, on a path it places by name without
    asking the kernel. Now a call whose answer is late pings the daemon, and fails
    with ETIMEDOUT once that goes unanswered too (both waits shortened here)."""
    import signal
    import sys
    m = mount_factory(args=("--extent-size", "64K"))
    write_file(m.path("f"), pattern(4 * E, 1))
    code = ("import sys, tierfs, tierfs.direct as d\n"
            "d.ANSWER_CHECK_S = d.PING_WAIT_S = 0.5\n"
            "tierfs.open_many([sys.argv[1]])[0].close()  # the mount is known from now on\n"
            "print('ready', flush=True)\n"
            "sys.stdin.readline()\n"
            "try:\n"
            "    tierfs.open_many([sys.argv[1]])\n"
            "except TimeoutError as e:\n"
            "    print('timeout', e.errno, e, flush=True)\n")
    child = subprocess.Popen([sys.executable, "-c", code, m.path("f")], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stopped = False
    try:
        assert child.stdout.readline() == "ready\n", child.stderr.read()
        os.kill(m.pid, signal.SIGSTOP)
        stopped = True
        child.stdin.write("go\n")
        child.stdin.flush()
        out, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
        if stopped:
            os.kill(m.pid, signal.SIGCONT)
    assert out.startswith(f"timeout {errno.ETIMEDOUT} "), (out, err)
    assert "does not answer" in out and m.cache_dir in out, out
    with tierfs.open(m.path("f"), "rb") as f:  # the daemon runs again: all is as before
        assert f.read() == pattern(4 * E, 1)
