"""Tiering through the mount against a moto S3 server: upload, release, cold
reads, eviction under a small hot tier, writes to cold data, gc, control CLI."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import threading
import time

import boto3

from tests.harness import cached_pages, drop_page_cache, read_file, wait_until, write_file
import pytest

MiB = 1 << 20


def status(m, path=None) -> dict:
    res = m.cli("status", path or m.mountpoint, "--json", check=True)
    return json.loads(res.stdout)


def pattern(n: int, seed: int) -> bytes:
    """Deterministic, incompressible-looking test data."""
    out = bytearray()
    counter = 0
    while len(out) < n:
        out += hashlib.sha256(f"{seed}:{counter}".encode()).digest() * 64
        counter += 1
    return bytes(out[:n])


def bucket_client(m):
    return boto3.client("s3", endpoint_url=m.env["AWS_ENDPOINT_URL"],
                        aws_access_key_id="testing", aws_secret_access_key="testing",
                        region_name="us-east-1")


def data_objects(m) -> list[str]:
    bucket, prefix = m.cold_url[5:].split("/", 1)
    pages = bucket_client(m).get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=f"{prefix}/data/")
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


def make_cold(m, *paths: str) -> None:
    """Upload, then drop the hot copies and the page cache: reads must come from S3."""
    m.cli("sync", m.mountpoint, "--wait", check=True)
    m.cli("release", *paths, check=True)
    drop_page_cache(m.mountpoint)


@pytest.fixture
def s3m(mount_factory, s3_url, s3_endpoint):
    from tests.moto_server import s3_env
    env = dict(os.environ, **s3_env(s3_endpoint))

    def make(*args):
        return mount_factory(cold_url=s3_url, env=env, args=("--extent-size", "1M", *args))
    return make


def test_write_sync_release_read_back(s3m):
    m = s3m()
    data = pattern(5 * MiB + 123, 1)
    write_file(m.path("f"), data)
    assert status(m)["dirty_bytes"] > 0
    out = m.cli("sync", m.mountpoint, "--wait", check=True).stdout
    assert "everything is in the bucket" in out
    assert status(m)["dirty_bytes"] == 0
    assert len(data_objects(m)) == 6
    res = m.cli("release", m.path("f"), check=True)
    assert "released 5.0 MiB" in res.stdout
    assert status(m)["cold_bytes"] == len(data)
    st = status(m, m.path("f"))["file"]
    assert st["hot"] == 0 and st["cold"] == len(data)
    assert {e["where"] for e in st["extents"]} == {"cold"}
    drop_page_cache(m.mountpoint)
    assert read_file(m.path("f")) == data

    def hot_again() -> bool:  # a read's extents are installed right after it has them
        state = json.loads(os.getxattr(m.path("f"), "user.tierfs.state"))
        return state["hot"] == len(data) and state["cold"] == 0
    wait_until(hot_again, 30, "the extents read to be hot again")


def test_the_state_xattr_of_a_file_of_many_extents_fits_the_kernel(mount_factory):
    """The kernel takes no xattr value above 64 KiB (E2BIG): for a file of 1,500
    extents `user.tierfs.state` gives its totals and says where the list is."""
    m = mount_factory(args=("--extent-size", "64K"))
    fd = os.open(m.path("f"), os.O_WRONLY | os.O_CREAT)
    try:
        for i in range(1500):
            os.pwrite(fd, b"x", i * 64 * 1024)
    finally:
        os.close(fd)
    state = json.loads(os.getxattr(m.path("f"), "user.tierfs.state"))
    assert state["size"] == 1499 * 64 * 1024 + 1
    assert state["extents_omitted"] == 1500 and "extents" not in state
    assert "tierfs status" in state["extents_hint"]
    assert len(status(m, m.path("f"))["file"]["extents"]) == 1500


def test_small_hot_tier_holds_much_more_data(s3m):
    """A 32 MiB hot tier takes 256 MiB: writers wait for uploads, reads fetch back."""
    m = s3m("--cache-size", "32M", "--min-free", "0")
    chunk = pattern(4 * MiB, 2)
    with open(m.path("big"), "wb") as f:
        for i in range(64):
            f.write(chunk[i % 7:] + chunk[:i % 7])
    st = status(m)
    assert st["hot_bytes"] <= 32 * MiB
    drop_page_cache(m.mountpoint)
    with open(m.path("big"), "rb") as f:
        for i in range(64):
            assert f.read(4 * MiB) == chunk[i % 7:] + chunk[:i % 7], f"block {i}"
    st = status(m)
    assert st["hot_bytes"] <= 32 * MiB
    assert st["counters"]["evictions"] > 0


def test_writes_to_cold_files(s3m):
    m = s3m()
    a, b, c, d = (pattern(3 * MiB + 77, i) for i in range(4))
    for name, data in zip("abcd", (a, b, c, d)):
        write_file(m.path(name), data)
    make_cold(m, *(m.path(n) for n in "abcd"))
    # partial overwrite in the middle of a cold extent
    with open(m.path("a"), "r+b") as f:
        f.seek(MiB + 1000)
        f.write(b"X" * 5000)
    expect_a = a[:MiB + 1000] + b"X" * 5000 + a[MiB + 6000:]
    # append to a cold file
    with open(m.path("b"), "ab") as f:
        f.write(b"tail")
    # truncate a cold file inside an extent, then grow it again
    os.truncate(m.path("c"), 2 * MiB + 10)
    os.truncate(m.path("c"), 3 * MiB)
    expect_c = c[:2 * MiB + 10] + bytes(3 * MiB - 2 * MiB - 10)
    os.rename(m.path("d"), m.path("d2"))
    drop_page_cache(m.mountpoint)
    assert read_file(m.path("a")) == expect_a
    assert read_file(m.path("b")) == b + b"tail"
    assert read_file(m.path("c")) == expect_c
    assert read_file(m.path("d2")) == d
    # and the same after everything went cold once more
    make_cold(m, *(m.path(n) for n in ("a", "b", "c", "d2")))
    assert read_file(m.path("a")) == expect_a
    assert read_file(m.path("c")) == expect_c
    os.unlink(m.path("d2"))
    assert not os.path.exists(m.path("d2"))


def test_concurrent_readers_share_gets(s3m):
    m = s3m()
    data = pattern(8 * MiB, 5)
    write_file(m.path("shared"), data)
    make_cold(m, m.path("shared"))
    before = status(m)["counters"].get("cold_reads", 0)
    results, errors = [], []

    def reader():
        try:
            with open(m.path("shared"), "rb", buffering=0) as f:
                results.append(f.read())
        except OSError as e:
            errors.append(e)

    threads = [threading.Thread(target=reader) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert results == [data] * 8
    # One GET per extent however many readers missed on it together.
    assert status(m)["counters"]["cold_reads"] - before == 8



def test_sequential_cold_read_fetches_ahead_once_per_extent(s3m):
    m = s3m()
    data = pattern(24 * MiB, 6)
    write_file(m.path("seq"), data)
    make_cold(m, m.path("seq"))
    before = status(m)["counters"]
    with open(m.path("seq"), "rb", buffering=0) as f:
        got = b"".join(iter(lambda: f.read(256 * 1024), b""))
    assert got == data
    after = status(m)["counters"]
    # The reader found extents already on their way, and none was fetched twice.
    assert after.get("readahead_extents", 0) - before.get("readahead_extents", 0) > 0
    assert after["cold_reads"] - before.get("cold_reads", 0) == 24

@pytest.mark.allow_log_errors
def test_corrupted_object_gives_eio(s3m):
    m = s3m()
    m.allowed_log.append("checksum mismatch")
    data = pattern(2 * MiB, 6)
    write_file(m.path("f"), data[:MiB])  # extent 0 gets the first object id
    m.cli("sync", m.mountpoint, "--wait", check=True)
    with open(m.path("f"), "ab") as f:
        f.write(data[MiB:])
    make_cold(m, m.path("f"))
    bucket = m.cold_url[5:].split("/", 1)[0]
    client = bucket_client(m)
    key = sorted(data_objects(m))[0]
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[100] ^= 0xFF
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    # The second extent is intact; the first must never come back as data.
    with open(m.path("f"), "rb") as f:
        f.seek(MiB)
        assert f.read(MiB) == data[MiB:]
    with open(m.path("f"), "rb") as f:
        with pytest.raises(OSError) as err:
            f.read(MiB)
    assert err.value.errno == errno.EIO
    assert status(m)["counters"]["checksum_errors"] >= 1


def test_gc_removes_unreferenced_objects(s3m):
    # Keep one metadata checkpoint: objects only an older checkpoint references may go.
    m = s3m("--checkpoint-keep", "1")
    write_file(m.path("a"), pattern(3 * MiB, 7))
    write_file(m.path("b"), pattern(2 * MiB, 8))
    m.cli("sync", m.mountpoint, "--wait", check=True)
    assert len(data_objects(m)) == 5
    os.unlink(m.path("a"))
    write_file(m.path("b"), pattern(MiB, 9))  # O_TRUNC + rewrite: 2 old objects go
    m.cli("sync", m.mountpoint, "--wait", check=True)
    wait_until(lambda: len(data_objects(m)) == 1, 30,
               "gc to delete the 4 objects nothing references any more")
    assert read_file(m.path("b")) == pattern(MiB, 9)


def test_control_commands_output_and_exit_codes(s3m):
    m = s3m()
    os.makedirs(m.path("ds/sub"))
    files = {f"ds/sub/f{i}": pattern(300_000 + i, i) for i in range(5)}
    for name, data in files.items():
        write_file(m.path(name), data)
    res = m.cli("sync", m.path("ds"), "--wait")
    assert res.returncode == 0 and "everything is in the bucket" in res.stdout
    res = m.cli("release", m.path("ds"))
    assert res.returncode == 1 and "is a directory: add -r" in res.stderr
    res = m.cli("release", "-r", m.path("ds"), check=True)
    assert "in 5 files" in res.stdout
    res = m.cli("prefetch", "-r", "-j", "3", m.path("ds"), check=True)
    assert res.stdout.startswith("prefetched 5 files: 1.4 MiB fetched, 0 B already hot")
    res = m.cli("prefetch", "-r", m.path("ds"), check=True)
    assert "0 B fetched, 1.4 MiB already hot" in res.stdout
    res = m.cli("pin", m.path("ds/sub/f0"), check=True)
    assert res.stdout.startswith("pinned 1 file (1 extent changed)")
    res = m.cli("release", m.path("ds/sub/f0"), check=True)
    assert "kept 1 pinned extent\n" in res.stdout
    assert status(m, m.path("ds/sub/f0"))["file"]["pinned"] == len(files["ds/sub/f0"])
    assert status(m)["pinned_bytes"] >= len(files["ds/sub/f0"])
    res = m.cli("unpin", m.path("ds/sub/f0"), check=True)
    assert res.stdout.startswith("unpinned 1 file (1 extent changed)")
    res = m.cli("status", m.mountpoint, check=True)
    assert "hot " in res.stdout and "hit rate" in res.stdout
    res = m.cli("status", "/")
    assert res.returncode == 1 and "not inside a tierfs mount" in res.stderr
    res = m.cli("prefetch", m.path("missing"))
    assert res.returncode == 1 and "No such file" in res.stderr
    for name, data in files.items():
        assert read_file(m.path(name)) == data



def test_uploads_wait_while_the_mount_is_written(s3m):
    m = s3m("--upload-delay", "2")  # uploads wait at most 4 x 2 s while writes go on
    write_file(m.path("first"), pattern(MiB, 13))
    t0 = time.monotonic()
    # Another file keeps being written for 5 s, one append every 0.1 s: this sleep
    # paces the workload, it waits for nothing. (This test is about a time-based
    # policy: it needs a 2 s delay to pass unnoticed, against a cap at 8 s.)
    while time.monotonic() - t0 < 5:
        with open(m.path("log"), "ab") as f:
            f.write(b"x" * 4096)
        time.sleep(0.1)
    assert status(m, m.path("first"))["file"]["dirty"] == MiB
    wait_until(lambda: status(m, m.path("first"))["file"]["dirty"] == 0, 30,
               "the first file to upload once the writes stopped")


def test_open_starts_the_disk_read_of_a_hot_file(mnt):
    """Opening a hot file asks the disk for its first MiB, so the first read
    request finds it cached and is served without a thread hop."""
    write_file(mnt.path("f"), pattern(256 * 1024, 14))
    mnt.cli("sync", mnt.mountpoint, "--wait", check=True)  # the upload reads it too
    ino = os.stat(mnt.path("f")).st_ino
    hot_file = os.path.join(mnt.cache_dir, "hot", f"{ino & 0xff:02x}", f"{ino:x}.0")
    drop_page_cache(hot_file)
    assert cached_pages(hot_file) == 0
    fd = os.open(mnt.path("f"), os.O_RDONLY)  # open only: nothing is read
    try:
        wait_until(lambda: cached_pages(hot_file) == 64, 10,
                   "the daemon to read the hot file's 64 pages into the page cache")
    finally:
        os.close(fd)


def minor_faults(pid: int) -> int:
    """Page faults a process took so far that needed no disk read (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def test_large_requests_reuse_the_daemons_memory(mount_factory):
    """Write buffers and read replies of 1 MiB come from memory the daemon reuses.
    Fresh pages fault once each (256 per MiB), which costs more CPU than copying
    the data (docs/architecture.md § Memory). No uploads meanwhile: an upload reads
    whole extents into fresh mmapped buffers, as it may."""
    m = mount_factory(args=("--upload-delay", "3600"))
    data = pattern(32 * MiB, 17)
    fresh = len(data) // 4096  # what 1 MiB buffers fault if each is new memory

    def write_and_read(name: str) -> tuple[int, int, int]:
        """Minor faults before, after the writes reached the daemon, after the read."""
        before = minor_faults(m.pid)
        with open(m.path(name), "wb") as f:
            f.write(data)
            os.fsync(f.fileno())  # the kernel's cached writes reach the daemon now
        written = minor_faults(m.pid)
        drop_page_cache(m.path(name))  # the hot file stays cached: the daemon reads inline
        assert read_file(m.path(name)) == data
        return before, written, minor_faults(m.pid)

    write_and_read("warm-up")  # the heap grows to what this traffic needs, once
    before, written, read = write_and_read("f")
    assert written - before < fresh // 8, f"{written - before} faults writing 32 MiB"
    assert read - written < fresh // 8, f"{read - written} faults reading 32 MiB"


def test_remount_keeps_hot_data_hot(s3m):
    m = s3m()
    data = pattern(3 * MiB, 11)
    write_file(m.path("f"), data)
    m.cli("sync", m.mountpoint, "--wait", check=True)
    m.remount()
    st = status(m, m.path("f"))
    assert st["file"]["hot"] == len(data) and st["file"]["dirty"] == 0
    assert read_file(m.path("f")) == data
    assert status(m)["counters"].get("cold_reads", 0) == 0


def test_dirty_data_uploads_after_remount(s3m):
    m = s3m("--upload-delay", "3600")
    data = pattern(2 * MiB, 12)
    write_file(m.path("f"), data)
    os.sync()
    assert status(m)["dirty_bytes"] == 2 * MiB
    m.kill9()
    m.start()  # cleans the stale mount; dirty extents found at mount upload right away
    wait_until(lambda: status(m)["dirty_bytes"] == 0, 30,
               "the dirty extents found at mount to upload")
    st = status(m)
    assert st["dirty_bytes"] == 0 and st["counters"]["uploads"] == 2
    make_cold(m, m.path("f"))
    assert read_file(m.path("f")) == data


def test_no_replace_policy_keeps_first_fill(s3m):
    m = s3m("--cache-size", "8M", "--min-free", "0", "--cache-policy", "no-replace")
    data = pattern(24 * MiB, 13)
    write_file(m.path("f"), data)
    make_cold(m, m.path("f"))
    assert read_file(m.path("f")) == data
    wait_until(lambda: status(m)["fetches_in_flight"] == 0, 30, "the fetched extents' installs")
    first = {e["index"] for e in status(m, m.path("f"))["file"]["extents"] if e["where"] != "cold"}
    assert 0 < len(first) <= 8
    drop_page_cache(m.mountpoint)
    assert read_file(m.path("f")) == data
    wait_until(lambda: status(m)["fetches_in_flight"] == 0, 30, "the fetched extents' installs")
    again = {e["index"] for e in status(m, m.path("f"))["file"]["extents"] if e["where"] != "cold"}
    assert again == first
    assert status(m)["counters"]["fetch_not_cached"] > 0


def test_release_pin_unpin_and_prefetch_of_trees_on_two_mounts(mount_factory):
    """release, pin, unpin and prefetch send a request per BATCH_FILES files, never one
    per file; each request goes to the daemon of the path it came from, so the files
    of two mounts named in one command are each handled by their own."""
    from tierfs.cli.tiering import BATCH_FILES
    a, b = mount_factory(name="a"), mount_factory(name="b")
    n = BATCH_FILES + 7
    os.makedirs(a.path("ds"))
    for i in range(n):
        write_file(a.path(f"ds/f{i:05d}"), b"%d" % i)
    write_file(b.path("g"), b"on b")
    for m in (a, b):
        m.cli("sync", m.mountpoint, "--wait", check=True)
    both = (a.path("ds"), b.path("g"))

    def hot(m, path) -> int:
        st = status(m, path)
        return (st.get("directory") or st["file"])["hot"]
    size = sum(len(b"%d" % i) for i in range(n))

    res = a.cli("release", "-r", *both, check=True)
    assert f"in {n + 1} files" in res.stdout, res.stdout
    assert hot(a, a.path("ds")) == 0 and hot(b, b.path("g")) == 0
    res = a.cli("pin", "-r", *both, check=True)
    assert f"pinned {n + 1} files ({n + 1} extents changed)" in res.stdout, res.stdout
    assert hot(a, a.path("ds")) == size and hot(b, b.path("g")) == 4
    res = a.cli("release", "-r", *both, check=True)
    assert f"kept {n + 1} pinned extents" in res.stdout, res.stdout
    res = a.cli("unpin", "-r", *both, check=True)
    assert f"unpinned {n + 1} files ({n + 1} extents changed)" in res.stdout, res.stdout
    a.cli("release", "-r", *both, check=True)
    assert hot(a, a.path("ds")) == 0 and hot(b, b.path("g")) == 0
    res = a.cli("prefetch", "-r", *both, check=True)
    assert f"prefetched {n + 1} files" in res.stdout, res.stdout
    assert hot(a, a.path("ds")) == size and hot(b, b.path("g")) == 4
    # Two requests of each command for a's 1,031 files, one for b's file.
    for m, per_command in ((a, 2), (b, 1)):
        asked = {k.split(":", 1)[1]: v for k, v in status(m)["counters"].items()
                 if k.startswith("control_requests:")}
        for cmd, times in (("release_many", 3), ("prefetch_many", 2), ("unpin_many", 1)):
            assert asked.get(cmd) == per_command * times, asked
        assert "release" not in asked and "unpin" not in asked, asked


def test_sync_wait_of_a_large_tree_waits_for_every_part_of_it(mount_factory, monkeypatch):
    """sync --wait of a directory sends its files' inode numbers SYNC_INOS a request
    (a million of them would pass the daemon's limit on a request's length) and
    returns once every part is in the bucket; files elsewhere stay dirty."""
    import argparse
    from tierfs.cli import tiering
    m = mount_factory(args=("--upload-delay", "3600"))
    os.makedirs(m.path("ds/sub"))
    names = [f"ds/f{i}" if i % 2 else f"ds/sub/f{i}" for i in range(5)]
    for name in names:
        write_file(m.path(name), pattern(1000, len(name)))
    write_file(m.path("other"), b"elsewhere")
    monkeypatch.setattr(tiering, "SYNC_INOS", 2)
    assert tiering.cmd_sync(argparse.Namespace(path=m.path("ds"), wait=True, timeout=60.0)) == 0
    assert status(m)["counters"]["control_requests:sync"] == 3  # 5 files, 2 a request
    assert status(m, m.path("ds"))["directory"]["dirty"] == 0
    assert status(m, m.path("other"))["file"]["dirty"] == len(b"elsewhere")


def test_pin_of_a_file_larger_than_the_hot_tier_says_so_and_pins_nothing(mount_factory):
    """A file larger than the hot tier cannot be kept hot. `tierfs pin` of one used to
    say "pinned 1 file (12 extents changed)", exit 0, and pin every extent, the cold
    ones too: the hot copies it could hold then filled the tier with pinned data, and
    every write of the mount failed with ENOSPC. Now it pins nothing and says why."""
    m = mount_factory(args=("--extent-size", "1M", "--cache-size", "4M", "--min-free", "0"))
    data = pattern(12 * MiB, 21)
    write_file(m.path("big"), data)
    make_cold(m, m.path("big"))
    res = m.cli("pin", m.path("big"))
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert "pin failed: not pinned" in res.stderr and "--cache-size" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert status(m)["pinned_bytes"] == 0
    assert status(m, m.path("big"))["file"]["pinned"] == 0
    write_file(m.path("small"), b"still writable")
    write_file(m.path("more"), pattern(3 * MiB, 22))
    assert read_file(m.path("big")) == data
    res = m.cli("pin", m.path("small"), check=True)  # one that fits is pinned as before
    assert "pinned 1 file (1 extent changed)" in res.stdout, res.stdout


def test_prefetch_of_a_file_larger_than_the_hot_tier_says_what_did_not_fit(mount_factory):
    """A prefetch of a file larger than the hot tier evicts its own first extents to
    make room for the last. It said only "4.0 MiB fetched" of a 12 MiB file, as if
    that were all there was; now it says how much did not fit."""
    m = mount_factory(args=("--extent-size", "1M", "--cache-size", "4M", "--min-free", "0"))
    write_file(m.path("big"), pattern(12 * MiB, 23))
    write_file(m.path("small"), b"small")
    make_cold(m, m.path("big"), m.path("small"))
    res = m.cli("prefetch", m.path("big"), check=True)
    left = re.search(r"; ([\d.]+) MiB did not fit in the hot tier \(raise --cache-size\)",
                     res.stdout)
    assert left and float(left.group(1)) >= 8.0, res.stdout
    res = m.cli("prefetch", m.path("small"), check=True)
    assert "did not fit" not in res.stdout, res.stdout
