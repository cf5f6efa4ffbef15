"""Bucket outages through the mount, for a bucket that refuses connections and for
one that accepts them and never answers (a fault file steers the daemon's store).

Whatever the bucket does: hot reads and metadata keep working, a cold read fails
with EIO within --cold-timeout, writers wait for room on a full hot tier only up
to --write-wait and then get ENOSPC, `sync --wait` says what it waits for and
gives up at --timeout, `umount` says what is not uploaded, and everything uploads
by itself once the bucket is back. No assertion here is about time: a hang shows
up as a call that does not return while the fault is still on.
"""
from __future__ import annotations

import errno
import json
import mmap
import os
import subprocess
import sys

import pytest

from tests.fuse.test_durability import s3env, s3m  # noqa: F401  (fixtures)
from tests.fuse.test_tiering import pattern, status
from tests.harness import drop_page_cache, read_file, wait_until, write_file

MiB = 1 << 20

FAULTS = {"refusing": {"outage": True}, "hanging": {"hang": True}}

# Writes 1 MiB at a time until the mount refuses; exit 0 with the errno it got,
# 2 if all of it was accepted (the hot tier never filled: the test is void).
FILLER = r"""
import os, sys
path, total = sys.argv[1], int(sys.argv[2])
chunk = os.urandom(1 << 20)
try:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for i in range(total >> 20):
            os.write(fd, chunk)
        os.fsync(fd)
    finally:
        os.close(fd)
except OSError as e:
    print(e.errno)
    sys.exit(0)
sys.exit(2)
"""


def set_faults(path, conf: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(conf, f)
    os.replace(tmp, path)  # the daemon never reads half a file


def direct_read(path: str, n: int = 4096) -> bytes:
    """An O_DIRECT read (page-aligned buffer): it always reaches the daemon."""
    buf = mmap.mmap(-1, n)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        got = os.preadv(fd, [buf], 0)
    finally:
        os.close(fd)
    return bytes(buf[:got])


@pytest.fixture(params=sorted(FAULTS))
def broken(request, s3m, tmp_path):  # noqa: F811
    """A mount whose bucket can be broken in the way the parameter names."""
    faults = tmp_path / "faults.json"
    set_faults(faults, {})
    m = s3m("--fault-file", str(faults), "--cold-timeout", "2", "--write-wait", "3",
            "--cache-size", "8M", "--min-free", "0", "--unmount-upload-timeout", "2")
    m.allowed_log += ["cold read of .*", "hot tier full", "upload of .* failed",
                      "injected", "metadata checkpoint failed", "lease renewal failed",
                      "final metadata checkpoint failed", "still dirty at exit",
                      "gc: deleting objects failed"]
    m.faults = faults
    m.fault = FAULTS[request.param]
    return m


@pytest.mark.allow_log_errors
def test_outage_keeps_hot_data_and_metadata_working(broken):
    m = broken
    write_file(m.path("cold"), pattern(2 * MiB, 7))
    write_file(m.path("hot"), pattern(MiB, 8))
    m.cli("sync", m.mountpoint, "--wait", check=True)
    m.cli("release", m.path("cold"), check=True)
    drop_page_cache(m.mountpoint)
    set_faults(m.faults, m.fault)

    # Hot data and metadata never wait for the bucket.
    assert direct_read(m.path("hot")) == pattern(MiB, 8)[:4096]
    assert read_file(m.path("hot")) == pattern(MiB, 8)
    os.mkdir(m.path("d"))
    write_file(m.path("d", "tiny"), b"abc")
    os.rename(m.path("d", "tiny"), m.path("d", "tiny2"))
    assert sorted(os.listdir(m.path("d"))) == ["tiny2"]
    assert read_file(m.path("d", "tiny2")) == b"abc"

    # A cold read gives EIO while the bucket is still broken: the deadline, not the
    # bucket, ended it.
    with pytest.raises(OSError) as err:
        read_file(m.path("cold"))
    assert err.value.errno == errno.EIO
    assert status(m)["counters"]["cold_errors"] >= 1

    # sync --wait gives up at --timeout, exit status 3, naming what is not uploaded.
    write_file(m.path("new"), pattern(3 * MiB, 9))
    res = m.cli("sync", m.mountpoint, "--wait", "--timeout", "3")
    assert res.returncode == 3, res.stderr
    assert "not in the bucket yet" in res.stderr and "\n" == res.stderr[-1]
    assert "Traceback" not in res.stderr

    # The bucket comes back: everything uploads by itself and reads back.
    set_faults(m.faults, {})
    wait_until(lambda: status(m)["dirty_bytes"] == 0, 90, "uploads to resume")
    assert read_file(m.path("cold")) == pattern(2 * MiB, 7)
    assert read_file(m.path("new")) == pattern(3 * MiB, 9)
    m.cli("sync", m.mountpoint, "--wait", "--timeout", "60", check=True)


@pytest.mark.allow_log_errors
def test_full_hot_tier_during_outage_refuses_writes_after_the_bound(broken):
    m = broken
    set_faults(m.faults, m.fault)
    # Written during the outage, "hot" stays dirty, so the full hot tier cannot
    # evict it (a clean file may rightly be evicted to make room, and reading it
    # back would then need the broken bucket).
    write_file(m.path("hot"), pattern(MiB, 8))
    # 32 MiB into an 8 MiB hot tier that cannot upload: the writer must get an
    # error (ENOSPC, or EIO for pages the kernel could not write back) and return.
    res = subprocess.run([sys.executable, "-c", FILLER, m.path("big"), str(32 * MiB)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"all 32 MiB accepted by an 8 MiB hot tier: {res.stderr}"
    assert int(res.stdout) in (errno.ENOSPC, errno.EIO)
    # The refusal is immediate now (the hot tier stays stuck), and hot reads work.
    for i in range(5):
        with pytest.raises(OSError) as err:
            with open(m.path(f"more{i}"), "wb") as f:
                f.write(os.urandom(2 * MiB))
                os.fsync(f.fileno())
        assert err.value.errno in (errno.ENOSPC, errno.EIO)
    # Many refused requests, one log line (repeats are counted, once a minute).
    assert status(m)["counters"]["enospc"] >= 6
    assert m.log().count("returning ENOSPC") == 1, m.log()
    drop_page_cache(m.path("hot"))
    assert direct_read(m.path("hot")) == pattern(MiB, 8)[:4096]
    assert read_file(m.path("hot")) == pattern(MiB, 8)
    assert status(m)["counters"]["enospc"] >= 1
    # Once the bucket is back, writers get room again.
    set_faults(m.faults, {})
    wait_until(lambda: status(m)["dirty_bytes"] == 0, 90, "uploads to resume")
    write_file(m.path("after"), pattern(4 * MiB, 10))
    drop_page_cache(m.path("after"))
    assert read_file(m.path("after")) == pattern(4 * MiB, 10)


@pytest.mark.allow_log_errors
def test_umount_during_outage_says_what_is_not_uploaded(broken):
    m = broken
    write_file(m.path("f"), pattern(2 * MiB + 11, 12))
    set_faults(m.faults, m.fault)
    res = m.cli("umount", m.mountpoint)
    m.pid = None
    assert res.returncode == 3, res.stderr
    assert not m.mounted
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "is not in the bucket yet" in lines[0]
    assert "uploads on the next mount" in lines[0]
    # The next mount, with the bucket back, uploads it.
    set_faults(m.faults, {})
    m.start()
    wait_until(lambda: status(m)["dirty_bytes"] == 0, 60, "the left-over data to upload")
    assert read_file(m.path("f")) == pattern(2 * MiB + 11, 12)
    res = m.cli("umount", m.mountpoint)
    m.pid = None
    assert res.returncode == 0 and "unmounted" in res.stdout
