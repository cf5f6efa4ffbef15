"""tierfs.open for writing: data written straight into hot extent files, through a
real mount. Every test that claims the direct path checks the daemon's counters,
so a silent fallback to open() fails it."""
from __future__ import annotations

import errno
import io
import json
import logging
import os
import socket
import subprocess
import sys

import pytest

import tierfs
from tests.fuse.test_direct import NOBODY, E, counters, grew, hot_file
from tests.fuse.test_direct import pub  # noqa: F401,F811 (a fixture)
from tests.fuse.test_outage import set_faults
from tests.fuse.test_tiering import pattern
from tests.harness import drop_page_cache, in_child_as, read_file, wait_until, write_file
from tierfs.direct_writer import DirectWriter

MiB = 1 << 20


def raw(f):
    return f.raw if hasattr(f, "raw") else f


def test_every_write_mode(pub):
    m = pub()
    before = counters(m)
    data = pattern(E * 5 + 123, 1)
    p = m.path("f")
    with tierfs.open(p, "wb") as f:
        assert isinstance(raw(f), DirectWriter) and isinstance(f, io.BufferedWriter)
        for at in range(0, len(data), 10_000):  # many writes, across extent borders
            f.write(data[at:at + 10_000])
        assert f.tell() == len(data)
    assert read_file(p) == data

    with pytest.raises(FileExistsError):
        tierfs.open(p, "xb")
    with tierfs.open(m.path("new"), "xb") as f:
        f.write(b"exclusive")
    assert read_file(m.path("new")) == b"exclusive"

    with tierfs.open(p, "ab") as f:
        f.write(b"tail")
        f.seek(0)
        f.write(b"end")  # append mode: always at the end
    data += b"tailend"
    assert read_file(p) == data

    with tierfs.open(p, "r+b") as f:
        assert isinstance(f, io.BufferedRandom)
        assert f.read(100) == data[:100]
        f.seek(E - 2)
        f.write(b"XXXX")  # across an extent border
        f.seek(E - 4)
        assert f.read(8) == data[E - 4:E - 2] + b"XXXX" + data[E + 2:E + 4]
        f.seek(3 * E)
        assert f.read(10) == data[3 * E:3 * E + 10]  # an extent not held: the mount
        f.seek(E - 4)
        rest = f.read()  # readall() over extents held and not held
    data = data[:E - 2] + b"XXXX" + data[E + 2:]
    assert rest == data[E - 4:]
    assert read_file(p) == data

    with tierfs.open(m.path("rw"), "w+b") as f:
        f.write(b"0123456789")
        f.seek(2)
        assert f.read(3) == b"234"
        f.truncate(4)
        f.seek(0, io.SEEK_END)
        f.write(b"!")
    assert read_file(m.path("rw")) == b"0123!"
    with tierfs.open(m.path("rw"), "a+b") as f:
        f.write(b"?")
        f.seek(0)
        assert f.read() == b"0123!?"

    after = counters(m)
    assert grew(before, after, "direct_write_files") == 6
    assert grew(before, after, "direct_write_extents") >= 6
    with tierfs.open(p, "ab", buffering=0) as w, pytest.raises(io.UnsupportedOperation):
        w.readall()  # write-only


@pytest.mark.parametrize("cache", ["writeback", "no-writeback"])
def test_the_mount_sees_direct_writes_once_closed(pub, cache):
    """Pages and attributes the kernel cached before are dropped at close: a reader
    through the mount never gets stale data, size or mtime."""
    m = pub(*(["--no-writeback-cache"] if cache == "no-writeback" else []))
    p = m.path("f")
    old = pattern(3 * E, 2)
    write_file(p, old)
    assert read_file(p) == old  # now in the kernel's page cache
    mtime = os.stat(p).st_mtime_ns
    new = pattern(5 * E + 7, 3)
    with tierfs.open(p, "r+b") as f:
        f.write(new)
    st = os.stat(p)
    assert st.st_size == len(new) and st.st_mtime_ns > mtime
    assert read_file(p) == new
    with open(p, "rb") as f:  # one more open: keep_cache must not bring them back
        assert f.read() == new


def test_each_filled_extent_starts_its_writeback(pub, monkeypatch):
    """A checkpoint writer starts the disk write of every extent it fills (so the
    fsync at the end does not have all of it to write), and of no other."""
    from tierfs.hot import pagecache
    if pagecache.sync_file_range is None:
        pytest.skip("this libc has no sync_file_range")
    m = pub()
    started = []

    def spy(fd, offset, nbytes, flags):
        started.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd, offset, nbytes, flags)

    real = pagecache.sync_file_range
    monkeypatch.setattr(pagecache, "sync_file_range", spy)
    data = pattern(3 * E + E // 2, 12)
    p = m.path("ckpt")
    with tierfs.open(p, "wb", buffering=0) as f:
        for at in range(0, len(data), E // 2):  # two writes per extent
            f.write(data[at:at + E // 2])
        os.fsync(f.fileno())
    assert started == [hot_file(m, p, i) for i in range(3)]  # not the half-filled 4th
    assert read_file(p) == data


def test_direct_writes_upload_and_read_back_from_the_bucket(pub):
    m = pub()
    data = pattern(2 * MiB + 5, 4)
    with tierfs.open(m.path("ckpt"), "wb") as f:
        f.write(data)
    m.cli("sync", m.mountpoint, "--wait", check=True)
    state = json.loads(m.cli("status", m.path("ckpt"), "--json", check=True).stdout)["file"]
    assert state["dirty"] == 0 and state["size"] == len(data)
    m.cli("release", m.path("ckpt"), check=True)
    drop_page_cache(m.path("ckpt"))
    before = counters(m)
    assert read_file(m.path("ckpt")) == data  # from the bucket, checksums verified
    after = counters(m)
    assert grew(before, after, "cold_reads") > 0 and after.get("checksum_errors", 0) == 0


def test_fsync_survives_the_daemon_killed_and_close_then_fails(pub):
    m = pub()
    data = pattern(MiB + 3, 5)
    f = tierfs.open(m.path("ckpt"), "wb")
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
    m.kill9()
    with pytest.raises(OSError) as err:
        f.close()
    assert err.value.errno == errno.EIO and "may be lost" in str(err.value)
    m.start()  # removes the killed daemon's mount
    assert read_file(m.path("ckpt")) == data


def test_row_direct_close_returned_survives_kill9(pub):
    m = pub()
    data = pattern(2 * MiB + 9, 10)
    with tierfs.open(m.path("ckpt"), "wb") as f:
        f.write(data)
    m.kill9()
    m.start()  # removes the killed daemon's mount
    assert read_file(m.path("ckpt")) == data


WRITER = r"""
import os, sys
sys.path.insert(0, sys.argv[3])
import tierfs
f = tierfs.open(sys.argv[1], "wb")
f.write(bytes(range(256)) * (int(sys.argv[2]) // 256))
f.flush()
print("written", flush=True)
sys.stdin.read()  # killed while waiting here, the file still open
"""


def test_a_writer_killed_keeps_what_it_wrote(pub):
    m = pub()
    p, n = m.path("partial"), 3 * E + 256
    proc = subprocess.Popen([sys.executable, "-c", WRITER, p, str(n),
                             os.path.dirname(os.path.dirname(tierfs.__file__))],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "written\n"
        assert counters(m).get("direct_write_extents", 0) >= 1
        proc.kill()
        proc.wait(30)
    finally:
        proc.kill()
        proc.wait(30)
    # The daemon ends the session when the connection goes: size and data appear.
    wait_until(lambda: os.stat(p).st_size == n, 30, "the size the writer left")
    assert read_file(p) == bytes(range(256)) * (n // 256)
    m.cli("sync", m.mountpoint, "--wait", "--timeout", "60", check=True)


def test_a_file_larger_than_the_hot_tier(pub):
    """Held extents are released as the writer moves on, so uploads make room and the
    writer waits for them (never ENOSPC) while its descriptors stay valid."""
    m = pub("--cache-size", "2M", "--min-free", "0", "--upload-delay", "0")
    data = pattern(8 * MiB, 6)
    with tierfs.open(m.path("big"), "wb") as f:
        for at in range(0, len(data), MiB):
            f.write(data[at:at + MiB])
    c = counters(m)
    assert c.get("direct_write_extents", 0) >= len(data) // E
    assert c.get("evictions", 0) > 0
    assert read_file(m.path("big")) == data


def test_full_hot_tier_during_an_outage_gives_enospc(pub, tmp_path):
    """As through the mount: the writer waits up to --write-wait for uploads that
    cannot happen, then gets ENOSPC; once the bucket is back, writing works again."""
    faults = tmp_path / "faults.json"
    set_faults(faults, {})
    m = pub("--cache-size", "2M", "--min-free", "0", "--upload-delay", "0",
            "--write-wait", "2", "--fault-file", str(faults))
    m.allowed_log += ["hot tier full", "upload of .* failed", "injected",
                      "metadata checkpoint failed", "lease renewal failed",
                      "gc: deleting objects failed"]
    set_faults(faults, {"outage": True})
    f = tierfs.open(m.path("big"), "wb")
    with pytest.raises(OSError) as err:
        for _ in range(8):
            f.write(pattern(MiB, 7))
            f.flush()
    assert err.value.errno == errno.ENOSPC
    f.close()
    set_faults(faults, {})
    m.cli("sync", m.mountpoint, "--wait", "--timeout", "60", check=True)  # room again
    with tierfs.open(m.path("after"), "wb") as g:
        g.write(pattern(3 * MiB, 8))
    assert read_file(m.path("after")) == pattern(3 * MiB, 8)
    m.cli("sync", m.mountpoint, "--wait", "--timeout", "60", check=True)


def test_writes_are_checked_as_the_kernel_checks_them(pub):
    m = pub()
    write_file(m.path("roots"), b"root's")
    os.chmod(m.path("roots"), 0o644)
    os.chmod(m.mountpoint, 0o1777)

    def as_nobody():
        try:
            tierfs.open(m.path("roots"), "r+b")
            return "opened"
        except PermissionError:
            pass
        with tierfs.open(m.path("mine"), "wb") as f:
            f.write(b"nobody's")
        return "refused, then wrote its own"

    before = counters(m)
    assert in_child_as(NOBODY, NOBODY, [], as_nobody) == "refused, then wrote its own"
    # Without CAP_SYS_PTRACE (a container's default) the daemon may not read another
    # user's fdinfo: the writer falls back to the mount, where the kernel checks too.
    expected = 1 if _has_cap_sys_ptrace() else 0
    assert grew(before, counters(m), "direct_write_files") == expected
    assert read_file(m.path("mine")) == b"nobody's"
    assert os.stat(m.path("mine")).st_uid == NOBODY
    assert read_file(m.path("roots")) == b"root's"


def _has_cap_sys_ptrace(pid: int | str = "self") -> bool:
    """Whether a process (by default this one, and so the daemon it starts as the same
    user) has CAP_SYS_PTRACE, which reading /proc/PID/fdinfo of another user's process
    needs."""
    with open(f"/proc/{pid}/status") as f:
        caps = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    return bool(caps >> 19 & 1)  # CAP_SYS_PTRACE is capability 19


def _without_cap_sys_ptrace() -> None:
    """preexec_fn: what this process execs (and so the daemon it starts) runs without
    CAP_SYS_PTRACE, as in a container started without it."""
    import ctypes
    PR_CAPBSET_DROP, CAP_SYS_PTRACE = 24, 19
    if ctypes.CDLL(None, use_errno=True).prctl(PR_CAPBSET_DROP, CAP_SYS_PTRACE, 0, 0, 0):
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_a_daemon_without_cap_sys_ptrace_leaves_other_users_writes_to_the_mount(pub):
    """Another user's descriptor can be read in /proc only with CAP_SYS_PTRACE: without
    it that user's tierfs.open writes through the mount, and nothing is lost."""
    m = pub()
    m.umount()
    m.start(preexec_fn=_without_cap_sys_ptrace)
    assert not _has_cap_sys_ptrace(m.pid), "the daemon still has CAP_SYS_PTRACE"
    os.chmod(m.mountpoint, 0o1777)

    def as_nobody():
        with tierfs.open(m.path("theirs"), "wb") as f:
            f.write(b"nobody's")
        return True

    before = counters(m)
    assert in_child_as(NOBODY, NOBODY, [], as_nobody)
    assert grew(before, counters(m), "direct_write_files") == 0
    assert read_file(m.path("theirs")) == b"nobody's"
    assert os.stat(m.path("theirs")).st_uid == NOBODY


def _ask(m, req: dict) -> dict:
    """One direct_write request on a new connection; its answer."""
    sock_path = json.loads(os.getxattr(m.mountpoint, "user.tierfs.control"))["socket"]
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(sock_path)
        s.sendall(json.dumps({"cmd": "direct_write", **req}).encode() + b"\n")
        return json.loads(s.makefile().readline())


def test_the_daemon_hands_out_nothing_for_a_descriptor_that_proves_nothing(pub, tmp_path):
    """The daemon looks at the asking process's own descriptor: it must be open for
    writing, on this mount, and exist at all."""
    m = pub()
    write_file(m.path("f"), b"data")
    ro = os.open(m.path("f"), os.O_RDONLY)
    local = os.open(tmp_path / "local", os.O_WRONLY | os.O_CREAT)
    unused = 999_999  # beyond any descriptor of this process
    try:
        assert _ask(m, {"op": "open", "fd": ro})["errno"] == errno.EBADF      # read-only
        assert _ask(m, {"op": "open", "fd": local})["errno"] == errno.EXDEV   # elsewhere
        pipe_r, pipe_w = os.pipe()
        try:
            assert _ask(m, {"op": "open", "fd": pipe_w})["errno"] == errno.EXDEV  # no file
        finally:
            os.close(pipe_r)
            os.close(pipe_w)
        assert _ask(m, {"op": "open", "fd": unused})["errno"] == errno.EBADF  # none
        assert "descriptor" in _ask(m, {"op": "open"})["error"]
        assert _ask(m, {"session": 1, "hold": [0, 0]})["errno"] == errno.EBADF  # not its own
    finally:
        os.close(ro)
        os.close(local)
    assert counters(m).get("direct_write_files", 0) == 0


def test_outside_a_mount_it_is_the_builtin_open(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tierfs.direct")
    with tierfs.open(tmp_path / "x", "wb") as f:
        assert isinstance(f, io.BufferedWriter) and isinstance(f.raw, io.FileIO)
        f.write(b"plain")
    assert (tmp_path / "x").read_bytes() == b"plain"
    with tierfs.open(tmp_path / "x", "ab") as f:
        f.write(b"!")
    assert (tmp_path / "x").read_bytes() == b"plain!"


def test_fsspec_urls_read_and_write_the_hot_tier_directly(pub):
    fsspec = pytest.importorskip("fsspec")
    m = pub()
    fs = fsspec.filesystem("tierfs")
    url = "tierfs://" + m.path("ckpt", "shard-0.bin")
    before = counters(m)
    fs.mkdirs("tierfs://" + m.path("ckpt"), exist_ok=True)
    data = pattern(3 * E + 1, 9)
    with fsspec.open(url, "wb") as f:
        f.write(data)
    with fsspec.open(url, "rb") as f:
        assert f.read() == data
    with fsspec.open("tierfs://" + m.path("ckpt", "meta.json"), "w") as f:  # text, wrapped
        f.write('{"step": 1000}')
    assert fs.cat_file("tierfs://" + m.path("ckpt", "meta.json")) == b'{"step": 1000}'
    after = counters(m)
    assert grew(before, after, "direct_write_files") == 2
    assert grew(before, after, "direct_open_files") == 2
    assert sorted(fs.ls("tierfs://" + m.path("ckpt"), detail=False)) == [
        m.path("ckpt", "meta.json"), m.path("ckpt", "shard-0.bin")]
    assert fs.info(url)["size"] == len(data)
    fs.mv(url, "tierfs://" + m.path("ckpt", "shard-0.done"))
    assert read_file(m.path("ckpt", "shard-0.done")) == data
    fs.rm("tierfs://" + m.path("ckpt"), recursive=True)
    assert not os.path.exists(m.path("ckpt"))



def test_fsspec_appends_land_at_the_end_another_appender_left(pub):
    """An fsspec append goes through the mount, so it lands after what another process
    appended while the file was open (a direct writer would write where it began)."""
    fsspec = pytest.importorskip("fsspec")
    m = pub()
    write_file(m.path("log"), b"first\n")
    with fsspec.open("tierfs://" + m.path("log"), "ab") as f:
        f.write(b"mine\n")
        f.flush()
        with open(m.path("log"), "ab") as other:
            other.write(b"theirs\n")
        f.write(b"mine again\n")
    assert read_file(m.path("log")) == b"first\nmine\ntheirs\nmine again\n"


def test_fsspec_transactions_write_aside_and_commit_or_discard(pub):
    """Files opened for writing inside fs.transaction are written aside and moved in
    place when it ends, or dropped if it fails. tierfs:// wrote them in place at
    once, and the end of the transaction then failed (AttributeError: no commit())."""
    fsspec = pytest.importorskip("fsspec")
    m = pub()
    fs = fsspec.filesystem("tierfs")
    kept, dropped = m.path("kept.bin"), m.path("dropped.bin")
    data = pattern(3 * E + 1, 7)
    with fs.transaction:
        with fs.open("tierfs://" + kept, "wb") as f:
            f.write(data)
        assert not os.path.exists(kept), "written in place before the commit"
    assert read_file(kept) == data
    with pytest.raises(RuntimeError):
        with fs.transaction:
            with fs.open("tierfs://" + dropped, "wb") as f:
                f.write(data)
            raise RuntimeError("the job fails before its commit")
    assert sorted(os.listdir(m.mountpoint)) == ["kept.bin"]


APPENDER = r"""
import os, sys
sys.path.insert(0, sys.argv[3])
import tierfs  # TIERFS_ACCELERATE=1: builtins.open is routed from here on
tierfs.direct.MOUNT_BELOW = 0
path, me = sys.argv[1], sys.argv[2]
for n in range(300):
    with open(path, "ab") as f:  # a shared log: open, append a line, close
        f.write(f"{me} {n:04d}\n".encode())
"""


def test_accelerated_appenders_to_one_file_lose_nothing(pub):
    """Unmodified code appending to one file from many processes relies on O_APPEND:
    accelerate() leaves appends to the mount, where the kernel keeps each at the end."""
    m = pub()
    log_path = m.path("shared.log")
    before = counters(m)
    procs = [subprocess.Popen([sys.executable, "-c", APPENDER, log_path, who,
                               os.path.dirname(os.path.dirname(tierfs.__file__))],
                              env={**os.environ, "TIERFS_ACCELERATE": "1"},
                              stderr=subprocess.PIPE, text=True)
             for who in ("a", "b", "c")]
    for p in procs:
        _out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    lines = read_file(log_path).decode().splitlines()
    assert sorted(lines) == sorted(f"{who} {n:04d}" for who in "abc" for n in range(300))
    assert grew(before, counters(m), "direct_write_files") == 0


ACCELERATED = r"""
import os, sys
sys.path.insert(0, sys.argv[3])
import tierfs  # TIERFS_ACCELERATE=1: builtins.open is routed from here on
tierfs.direct.MOUNT_BELOW = 0  # the direct path for this small file too
mnt, local = sys.argv[1], sys.argv[2]
with open(os.path.join(mnt, "w.bin"), "wb") as f:
    f.write(b"written with open()")
with open(os.path.join(mnt, "w.bin"), "rb") as f:
    got = f.read()
with open(os.path.join(mnt, "w.bin")) as f:   # text: the builtin
    text = f.read()
with open(local, "wb") as f:                  # not on a mount: the builtin
    f.write(b"local")
os.chdir(mnt)
with open("w.bin", "rb") as f:                # relative to a directory on the mount
    rel = type(f.raw).__name__
was = tierfs.accelerate(False)
with open("w.bin", "rb") as f:
    off = type(f.raw).__name__
print(got.decode(), text, rel, was, off, sep="|")
"""


def test_accelerate_routes_the_builtin_open_of_mount_paths(pub, tmp_path):
    m = pub()
    before = counters(m)
    res = subprocess.run([sys.executable, "-c", ACCELERATED, m.mountpoint,
                          str(tmp_path / "local"),
                          os.path.dirname(os.path.dirname(tierfs.__file__))],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "TIERFS_ACCELERATE": "1"})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == ("written with open()|written with open()|DirectFile|True|"
                                  "FileIO")
    after = counters(m)
    assert grew(before, after, "direct_write_files") == 1
    assert grew(before, after, "direct_open_files") == 2
    assert (tmp_path / "local").read_bytes() == b"local"


def test_sync_wait_names_extents_held_by_an_open_writer(pub):
    m = pub()
    f = tierfs.open(m.path("open"), "wb")
    try:
        f.write(pattern(E + 5, 11))
        f.flush()
        res = m.cli("sync", m.mountpoint, "--wait", "--timeout", "1")
        assert res.returncode == 3, res.stderr
        assert "open for direct writing" in res.stderr
    finally:
        f.close()
    m.cli("sync", m.mountpoint, "--wait", "--timeout", "60", check=True)


def test_bytes_a_writer_puts_past_its_extent_are_dropped_at_close(pub):
    """A client that writes into its extent file past the extent's end (tierfs's own
    library never does) would put bytes in the next extent's place, past the hot
    tier's limit: they are cut at close, and the file ends at the extent's end."""
    m = pub()
    with tierfs.open(m.path("f"), "wb") as f:
        f.write(b"a" * 100)
        f.flush()
        os.pwrite(raw(f)._held[0], b"beyond", E + 5)  # the descriptor it holds
    assert os.stat(m.path("f")).st_size == E
    data = read_file(m.path("f"))
    assert data[:100] == b"a" * 100 and data[100:] == bytes(E - 100)
    assert "wrote 11 bytes past the extent's end" in m.log()
    assert counters(m)["direct_write_files"] == 1
    m.cli("sync", m.mountpoint, "--wait", "--timeout", "60", check=True)


def fsync_by_name(path: str) -> None:
    """fsync of a file through a descriptor of its own: the daemon settles what direct
    writers of it hold, as for the writer's own fsync."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def test_writes_through_the_descriptor_keep_what_was_written_directly(pub):
    """What numpy's tofile and np.save do to a file object: write a header through
    it, flush, then write through a duplicate of fileno() at the object's position,
    and go on through the object. With the writeback cache the kernel took the page
    of the header for zeros (it never saw the direct write) and wrote it back so."""
    m = pub()
    p = m.path("npy")
    head, body, tail = b"HEAD" * 32, pattern(3 * E + 1000, 14), b"tail"
    with tierfs.open(p, "wb") as f:
        f.write(head)
        f.flush()
        fd = os.dup(f.fileno())
        try:
            os.lseek(fd, f.tell(), os.SEEK_SET)
            os.write(fd, body)
            end = os.lseek(fd, 0, os.SEEK_CUR)
        finally:
            os.close(fd)
        f.seek(end)
        f.write(tail)
    assert read_file(p) == head + body + tail
    m.cli("sync", m.mountpoint, "--wait", check=True)
    m.cli("release", p, check=True)  # and as the bucket has it
    drop_page_cache(p)
    assert read_file(p) == head + body + tail


def test_numpy_through_accelerate_saves_and_maps_files(pub):
    """np.save, np.load(mmap_mode), np.memmap and np.fromfile of files on the mount
    with accelerate() routing their open()."""
    np = pytest.importorskip("numpy")
    m = pub()
    res = subprocess.run([sys.executable, "-c", NUMPY_ACCELERATED, m.mountpoint,
                          os.path.dirname(os.path.dirname(tierfs.__file__))],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TIERFS_ACCELERATE": "1"})
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["123", "123", "123", "123"]
    want = np.arange(3 << 18, dtype=np.uint32)
    assert np.array_equal(np.load(m.path("a.npy")), want)
    assert read_file(m.path("raw.bin")) == want.tobytes()


NUMPY_ACCELERATED = r"""
import os, sys
sys.path.insert(0, sys.argv[2])
import numpy as np
import tierfs  # TIERFS_ACCELERATE=1: builtins.open is routed from here on
tierfs.direct.MOUNT_BELOW = 0
mnt = sys.argv[1]
a = np.arange(3 << 18, dtype=np.uint32)
np.save(os.path.join(mnt, "a.npy"), a)
with open(os.path.join(mnt, "raw.bin"), "wb") as f:
    a.tofile(f)
print(np.load(os.path.join(mnt, "a.npy"), mmap_mode="r")[123])
print(np.load(os.path.join(mnt, "a.npy"))[123])
print(np.memmap(os.path.join(mnt, "raw.bin"), dtype=np.uint32, mode="r")[123])
print(np.fromfile(os.path.join(mnt, "raw.bin"), dtype=np.uint32)[123])
"""


def test_bytes_written_after_the_last_fsync_never_surface_after_a_kill(pub):
    """The daemon killed after a writer's fsync: what the writer put in its extent
    files since then lies past the recorded end of the file. It must not come back
    as the file's bytes when the file is extended later (a hole reads as zeros)."""
    m = pub()
    p = m.path("ckpt")
    synced, later = pattern(100, 11), pattern(E, 12)
    f = tierfs.open(p, "wb", buffering=0)
    f.write(synced)
    fsync_by_name(p)  # not by fileno(): from then on the writer would use the mount
    f.write(later)  # the rest of extent 0 (released when the writer moves on) and
    m.kill9()       # the start of extent 1 (held when the daemon dies)
    with pytest.raises(OSError):
        f.close()
    m.start()  # removes the killed daemon's mount
    size = os.stat(p).st_size
    assert len(synced) <= size <= E
    os.truncate(p, 2 * E)
    assert read_file(p) == (synced + later)[:size] + bytes(2 * E - size)
    m.cli("sync", m.mountpoint, "--wait", "--timeout", "60", check=True)


@pytest.mark.parametrize("how", ["ftruncate", "o_trunc"])
def test_a_truncate_through_the_mount_cuts_what_a_writer_wrote(pub, how):
    """What a direct writer has written is the file's, as on a local disk: a truncate
    through the mount (ftruncate of fileno(), or an open with O_TRUNC) cuts it, also
    where the writer has not released it yet; its later writes land after the cut."""
    m = pub()
    p = m.path("ckpt")
    data = pattern(2 * E + 5 if how == "ftruncate" else 100, 13)
    with tierfs.open(p, "wb") as f:
        f.write(data)
        f.flush()
        if how == "ftruncate":
            os.ftruncate(f.fileno(), E + 7)
            want = data[:E + 7]
        else:
            os.close(os.open(p, os.O_WRONLY | os.O_TRUNC))
            want = b""
        f.seek(len(want))
        f.write(b"tail")
    assert os.stat(p).st_size == len(want) + 4
    assert read_file(p) == want + b"tail"
