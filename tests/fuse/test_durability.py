"""Durability and recovery through the mount: checkpoints, node loss and
recover, the writer lease, fsck and scrub, bucket outages, damaged hot files,
and kill -9 at random moments of heavy activity."""
from __future__ import annotations

import errno
import os
import random
import shutil
import subprocess
import sys
import time

import pytest

from tests.fuse.test_tiering import bucket_client, data_objects, make_cold, pattern, status
from tests.harness import drop_page_cache, fill_disk, read_file, small_disk, write_file
from tests.moto_server import s3_env

MiB = 1 << 20


@pytest.fixture
def s3env(s3_endpoint):
    return dict(os.environ, **s3_env(s3_endpoint))


@pytest.fixture
def s3m(mount_factory, s3_url, s3env):
    def make(*args, name="m", start=True):
        return mount_factory(cold_url=s3_url, env=s3env, name=name, start=start,
                             args=("--extent-size", "1M", *args))
    return make


def bucket_keys(m, sub: str) -> list[str]:
    bucket, prefix = m.cold_url[5:].split("/", 1)
    pages = bucket_client(m).get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=f"{prefix}/{sub}")
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


def wait_for(predicate, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def fsck(m, *extra):
    return m.cli("fsck", m.cold_url, "--cache-dir", m.cache_dir, *extra)


# ---- checkpoints and gc ------------------------------------------------------------

def test_checkpoints_are_taken_and_pruned(s3m):
    m = s3m("--checkpoint-keep", "2")
    for i in range(4):
        write_file(m.path(f"f{i}"), pattern(1000 + i, i))
        m.cli("sync", m.mountpoint, "--wait", check=True)
    ckpts = bucket_keys(m, "meta/ckpt-")
    assert len(ckpts) == 2
    assert ckpts[-1].endswith(f"{4:016x}")


def test_a_bucket_refusing_to_delete_checkpoints_fails_neither_sync_nor_unmount(s3m, tmp_path):
    """Deleting the oldest checkpoint fails (a bucket policy that denies deletes):
    the new one is in the bucket all the same, so `sync --wait` and unmount say
    so, and the old one is pruned once deletes work again."""
    from tests.fuse.test_outage import set_faults
    faults = str(tmp_path / "faults.json")
    set_faults(faults, {})
    m = s3m("--checkpoint-keep", "1", "--fault-file", faults)
    write_file(m.path("a"), pattern(1000, 1))
    m.cli("sync", m.mountpoint, "--wait", check=True)
    set_faults(faults, {"refuse_deletes": ["meta/"]})
    write_file(m.path("b"), pattern(1000, 2))
    res = m.cli("sync", m.mountpoint, "--wait", "--timeout", "20")
    assert res.returncode == 0, res.stderr
    assert len(bucket_keys(m, "meta/ckpt-")) == 2
    m.umount()  # exits 0: its final checkpoint landed
    set_faults(faults, {})
    m.start()
    m.cli("sync", m.mountpoint, "--wait", check=True)
    assert len(bucket_keys(m, "meta/ckpt-")) == 1
    assert read_file(m.path("b")) == pattern(1000, 2)


def test_gc_keeps_objects_of_kept_checkpoints(s3m):
    m = s3m("--checkpoint-keep", "2")
    write_file(m.path("old"), pattern(2 * MiB, 1))
    m.cli("sync", m.mountpoint, "--wait", check=True)          # checkpoint 1 has "old"
    objs = set(data_objects(m))
    assert len(objs) == 2
    os.unlink(m.path("old"))
    m.cli("sync", m.mountpoint, "--wait", check=True)          # checkpoint 2
    passes = status(m)["counters"].get("gc_passes", 0)
    wait_for(lambda: status(m)["counters"].get("gc_passes", 0) >= passes + 2,
             what="two gc passes")             # they must hold the objects back
    assert objs <= set(data_objects(m))
    m.cli("sync", m.mountpoint, "--wait", check=True)          # checkpoint 3: 1 pruned
    wait_for(lambda: not objs & set(data_objects(m)), what="gc of objects no checkpoint needs")


def test_overwrites_keep_the_bucket_bounded(s3m):
    """Objects uploaded and superseded between two checkpoints are in no checkpoint:
    they go at once. What stays is the live data plus what kept checkpoints hold."""
    m = s3m("--checkpoint-interval", "0", "--upload-delay", "0")
    write_file(m.path("f"), pattern(4 * MiB, 0))
    m.cli("sync", m.mountpoint, "--wait", check=True)   # a checkpoint holds 4 objects
    for i in range(1, 16):
        write_file(m.path("f"), pattern(4 * MiB, i))
        wait_for(lambda: status(m)["dirty_bytes"] == 0, 30, "the overwrite to upload")
    wait_for(lambda: len(data_objects(m)) <= 8, 30, "gc of objects no checkpoint holds")
    st = status(m)
    assert st["gc_backlog_objects"] == 4 and st["gc_backlog_bytes"] == 4 * MiB
    assert st["counters"]["uploads"] >= 15 * 4
    drop_page_cache(m.path("f"))
    m.cli("release", m.path("f"), check=True)
    assert read_file(m.path("f")) == pattern(4 * MiB, 15)


def test_fsck_verify_data_accepts_holes_at_extent_ends(s3m):
    """A hot file may end before its extent does (a sparse tail, a file grown by
    truncate): the object holds those zeros, and fsck checks it the engine's way."""
    m = s3m()
    with open(m.path("sparse"), "wb") as f:
        f.write(b"x" * 100)
        f.truncate(MiB + 5000)
    write_file(m.path("grown"), b"y" * 5000)
    os.truncate(m.path("grown"), 3 * MiB)
    m.cli("sync", m.mountpoint, "--wait", check=True)
    m.umount()
    res = fsck(m, "--verify-data")
    assert res.returncode == 0, res.stdout + res.stderr


# ---- the durability table of the README, row by row ------------------------------

def test_row_write_returned_survives_kill9_without_writeback_cache(s3m):
    """--no-writeback-cache: write() returned means the hot tier file has it."""
    m = s3m("--no-writeback-cache", "--upload-delay", "3600")
    data = pattern(8 * MiB, 21)
    f = open(m.path("f"), "wb")
    f.write(data)
    f.flush()                       # write(2) returned; the file stays open
    m.kill9()
    try:
        f.close()
    except OSError:
        pass                        # the close cannot reach a dead daemon
    m.start()
    assert read_file(m.path("f")) == data


def test_row_close_returned_survives_kill9_with_writeback_cache(s3m):
    """With the writeback cache, close() returned means the hot tier file has it
    (the kernel writes its cached pages back before close returns)."""
    m = s3m("--upload-delay", "3600")
    data = pattern(8 * MiB, 22)
    write_file(m.path("f"), data)
    assert status(m)["dirty_bytes"] == 8 * MiB  # not uploaded: only the hot tier has it
    m.kill9()
    m.start()
    assert read_file(m.path("f")) == data


# ---- node loss, recover, lease -----------------------------------------------------

@pytest.mark.allow_log_errors
def test_node_loss_then_recover_on_mount(s3m):
    # Periodic checkpoints capture the namespace, including data not uploaded yet.
    a = s3m("--upload-delay", "3600", "--checkpoint-interval", "0.5", name="a")
    os.makedirs(a.path("ds"))
    safe = {f"ds/f{i}": pattern(300_000 * (i + 1), i) for i in range(4)}
    for name, data in safe.items():
        write_file(a.path(name), data)
    write_file(a.path("ckpt.pt"), pattern(3 * MiB, 9))
    a.cli("sync", a.mountpoint, "--wait", check=True)
    with open(a.path("ckpt.pt"), "r+b") as f:   # changed after its upload: reverted
        f.write(b"NEW")
    write_file(a.path("late.bin"), b"never uploaded")  # lost
    os.sync()
    # A checkpoint that starts after both changes sees them: wait for two more.
    done = status(a)["counters"].get("checkpoints", 0)
    wait_for(lambda: status(a)["counters"].get("checkpoints", 0) >= done + 2, 60,
             "two more metadata checkpoints")
    a.kill9()
    shutil.rmtree(a.cache_dir)                  # the node and its NVMe are gone

    b = s3m(name="b", start=False)
    res = b.cli("mount", b.cold_url, b.mountpoint, "--cache-dir", b.cache_dir)
    assert res.returncode == 1 and "is mounted read-write by" in res.stderr
    # The holder looks alive to the bucket: say when it renewed, how often it does,
    # and when a dead holder's lease lapses.
    assert "renewed its lease" in res.stderr and "renews every 20s" in res.stderr
    assert "lapses in" in res.stderr and "--force" in res.stderr
    res = b.start("--force")
    assert "recovered from metadata checkpoint" in res.stdout
    assert "lost: /late.bin" in res.stdout
    assert "reverted: /ckpt.pt" in res.stdout
    for name, data in safe.items():
        assert read_file(b.path(name)) == data
    assert read_file(b.path("ckpt.pt")) == pattern(3 * MiB, 9)
    assert read_file(b.path("late.bin")) == bytes(len(b"never uploaded"))
    b.umount()
    res = fsck(b)
    assert res.returncode == 0, res.stdout


def test_recover_command_into_new_cache_dir(s3m, tmp_path):
    a = s3m(name="a")
    write_file(a.path("f"), pattern(2 * MiB + 5, 3))
    a.umount()                                   # uploads and checkpoints on the way out
    new_cache = str(tmp_path / "new-cache")
    res = a.cli("recover", a.cold_url, "--cache-dir", new_cache, check=True)
    # The report once, on stdout; nothing on stderr.
    assert res.stdout.count("recovered from metadata checkpoint") == 1, res.stdout
    assert res.stdout.count("no data was lost") == 1
    assert res.stderr == ""
    res = a.cli("recover", a.cold_url, "--cache-dir", new_cache)
    assert res.returncode == 1 and res.stdout == ""
    assert res.stderr.count("\n") == 1 and "already holds metadata" in res.stderr
    a.cache_dir = new_cache
    a.start()
    assert read_file(a.path("f")) == pattern(2 * MiB + 5, 3)


@pytest.mark.allow_log_errors  # the refused daemon logs its refusal
def test_second_writer_refused_while_the_lease_is_held(s3m):
    """(Taking over with --force, and what the old mount then does: test_takeover.py.)"""
    a = s3m(name="a")
    b = s3m(name="b", start=False)
    res = b.cli("mount", b.cold_url, b.mountpoint, "--cache-dir", b.cache_dir)
    assert res.returncode == 1
    assert "is mounted read-write by" in res.stderr and a.cache_dir in res.stderr


# ---- fsck and scrub ----------------------------------------------------------------

def hot_files(m) -> list[str]:
    out = []
    for root, _d, files in os.walk(os.path.join(m.cache_dir, "hot")):
        out += [os.path.join(root, f) for f in files]
    return sorted(out)


def test_fsck_clean_then_finds_and_repairs(s3m):
    m = s3m()
    write_file(m.path("a"), pattern(3 * MiB, 1))
    write_file(m.path("b"), pattern(MiB, 2))
    m.umount()
    res = fsck(m)
    assert res.returncode == 0 and "clean" in res.stdout
    os.unlink(hot_files(m)[0])                                   # lost hot copy (clean)
    os.makedirs(os.path.join(m.cache_dir, "hot", "ff"), exist_ok=True)
    with open(os.path.join(m.cache_dir, "hot", "ff", "ff.0"), "wb") as f:  # stray hot file
        f.write(b"junk")
    bucket, prefix = m.cold_url[5:].split("/", 1)
    bucket_client(m).put_object(Bucket=bucket, Key=f"{prefix}/data/{0xfffff:016x}", Body=b"x")
    res = fsck(m)
    assert res.returncode == 4
    assert "hot file is missing" in res.stdout and "stray hot file" in res.stdout
    assert "is not referenced by any file" in res.stdout
    res = fsck(m, "--repair")
    assert res.returncode == 1 and "problems repaired" in res.stdout
    m.start()
    assert read_file(m.path("a")) == pattern(3 * MiB, 1)
    m.umount()  # gc deletes the orphan object on the way
    res = fsck(m, "--verify-data")
    assert res.returncode == 0, res.stdout


def test_fsck_repair_that_leaves_lost_data_exits_4(s3m):
    """An object the bucket damaged, with no good hot copy left, is a problem no
    repair fixes: `fsck --repair` reports it as left and exits 4 (problems left),
    not 1 with every problem counted as repaired."""
    m = s3m()
    write_file(m.path("f"), pattern(3 * MiB, 8))
    make_cold(m, m.path("f"))  # only the bucket has it now
    m.umount()
    bucket, _prefix = m.cold_url[5:].split("/", 1)
    client = bucket_client(m)
    for key in data_objects(m):
        body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
        body[100] ^= 0xFF
        client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    res = fsck(m, "--verify-data", "--repair")
    assert "no good copy: data lost" in res.stdout, res.stdout + res.stderr
    assert res.returncode == 4, res.stdout + res.stderr
    assert res.stdout.splitlines()[-1] == "3 problems left that no repair can fix"


def test_fsck_repair_after_a_power_cut_never_leads_gc_to_new_data(mount_factory, tmp_path):
    """A power cut right after an upload's PUT: the metadata database comes back as
    last synced, without the upload's intent and with its object id counter before
    it, so the object in the bucket is referenced by nothing. `fsck --repair` queues
    it for gc, and the node hands that id out again: gc must never then delete the
    new data written under it."""
    a = mount_factory(name="a", args=("--extent-size", "1M", "--pack-below", "0",
                                      "--checkpoint-keep", "1"))
    write_file(a.path("f1"), pattern(MiB, 1))
    a.umount()                                     # everything synced
    mdb = os.path.join(a.cache_dir, "meta", "data.mdb")
    synced = tmp_path / "synced.mdb"
    shutil.copyfile(mdb, synced)
    a.start()
    cold = os.path.join(str(tmp_path), "a-cold", "data")
    from tierfs.cold.file import TMP_SUFFIX

    def objects() -> set[str]:  # a PUT's temporary file is no object yet
        return {name for name in os.listdir(cold) if not name.endswith(TMP_SUFFIX)}
    before = objects()
    write_file(a.path("f2"), pattern(MiB, 2))
    wait_for(lambda: objects() - before, what="f2's upload")
    a.kill9()
    shutil.copyfile(synced, mdb)                   # the power cut: back to the last sync
    res = fsck(a, "--repair")
    assert res.returncode == 1 and "is not referenced by any file" in res.stdout, res.stdout
    a.start()
    write_file(a.path("f3"), pattern(MiB, 3))
    a.cli("sync", a.mountpoint, "--wait", check=True)  # a newer checkpoint: gc may go on
    wait_for(lambda: status(a)["gc_backlog_objects"] == 0, what="gc to empty its queue")
    a.cli("release", a.path("f3"), check=True)
    drop_page_cache(a.path("f3"))
    assert read_file(a.path("f3")) == pattern(MiB, 3)


@pytest.mark.allow_log_errors
def test_scrub_replaces_damaged_hot_copy(s3m):
    m = s3m()
    m.allowed_log.append("hot copy is damaged")
    data = pattern(2 * MiB, 4)
    write_file(m.path("f"), data)
    m.cli("sync", m.mountpoint, "--wait", check=True)
    path = hot_files(m)[0]
    with open(path, "r+b") as f:
        f.seek(10)
        f.write(b"\x00rot\x00")
    res = m.cli("scrub", m.mountpoint)
    assert res.returncode == 0, res.stderr
    assert "1 damaged hot copy replaced" in res.stdout and "0 damaged objects" in res.stdout
    drop_page_cache(m.mountpoint)
    assert read_file(m.path("f")) == data


@pytest.mark.allow_log_errors
def test_scrub_of_a_damaged_hot_copy_whose_object_is_damaged_too(s3m):
    """Both copies of a file damaged: scrub must not say the hot copy was replaced
    from the bucket (it did, before: the file looked repaired and was lost)."""
    m = s3m()
    m.allowed_log += ["hot copy is damaged", "checksum mismatch"]
    write_file(m.path("f"), pattern(MiB, 4))
    m.cli("sync", m.mountpoint, "--wait", check=True)
    (path,) = hot_files(m)
    with open(path, "r+b") as f:
        f.seek(10)
        f.write(b"\x00rot\x00")
    bucket, _prefix = m.cold_url[5:].split("/", 1)
    client = bucket_client(m)
    (key,) = data_objects(m)
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[100] ^= 0xFF
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    res = m.cli("scrub", m.mountpoint)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "0 damaged hot copies replaced" in res.stdout, res.stdout
    assert "1 damaged hot copy not replaced (object damaged too)" in res.stdout
    assert "1 damaged object" in res.stdout, res.stdout


@pytest.mark.allow_log_errors
def test_damaged_or_deleted_hot_files_behind_our_back(s3m):
    m = s3m("--upload-delay", "3600")
    m.allowed_log += ["hot copy is damaged", "hot file missing"]
    clean = pattern(MiB, 5)
    write_file(m.path("clean"), clean)
    m.cli("sync", m.mountpoint, "--wait", check=True)
    write_file(m.path("dirty"), pattern(MiB, 6))
    os.sync()
    m.kill9()  # unmount would upload the dirty file
    files = hot_files(m)
    assert len(files) == 2
    clean_file, dirty_file = files  # inode order: "clean" was created first
    with open(clean_file, "r+b") as f:
        f.write(b"garbage")
    os.unlink(dirty_file)
    m.start()
    assert read_file(m.path("clean")) == clean       # detected and refetched
    with pytest.raises(OSError) as err:
        read_file(m.path("dirty"))
    assert err.value.errno == errno.EIO


def _cache_whole_file(path: str) -> None:
    """Put every page of a file in the page cache (as open()'s readahead would)."""
    with open(path, "rb") as f:
        while f.read(1 << 20):
            pass


def _reads_nowait(path: str) -> bool:
    """Whether the filesystem of `path` answers reads with RWF_NOWAIT (overlayfs, a
    container's root, may not: EOPNOTSUPP)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.preadv(fd, [bytearray(1)], 0, os.RWF_NOWAIT)
    except BlockingIOError:
        pass
    except OSError as e:
        if e.errno == errno.EOPNOTSUPP:
            return False
        raise
    finally:
        os.close(fd)
    return True


def test_first_read_after_remount_verifies_a_cached_small_extent_inline(s3m):
    m = s3m()
    data = pattern(300_000, 21)
    write_file(m.path("sample"), data)
    m.cli("sync", m.mountpoint, "--wait", check=True)
    m.umount()
    _cache_whole_file(hot_files(m)[0])
    m.start()  # a new mount: nothing verified yet
    assert read_file(m.path("sample")) == data
    c = status(m)["counters"]
    # Only RWF_NOWAIT tells the trio thread that a read will not wait for the disk;
    # without it the copy is checked in a worker thread, as any other.
    inline = _reads_nowait(hot_files(m)[0])
    assert c.get("hot_verified_inline", 0) == int(inline)
    assert c.get("hot_verified_in_thread", 0) == int(not inline)
    assert c.get("hot_checksum_errors", 0) == 0 and c.get("cold_reads", 0) == 0


def test_damaged_cached_small_extent_is_still_caught_after_remount(s3m):
    m = s3m()
    m.allowed_log.append("hot copy is damaged")
    data = pattern(300_000, 22)
    write_file(m.path("sample"), data)
    m.cli("sync", m.mountpoint, "--wait", check=True)
    m.umount()
    path = hot_files(m)[0]
    with open(path, "r+b") as f:
        f.seek(200_000)
        f.write(b"\x00rot\x00")
    _cache_whole_file(path)  # the damaged bytes are what the page cache holds
    m.start()
    assert read_file(m.path("sample")) == data  # from the bucket, not the damaged copy
    c = status(m)["counters"]
    assert c.get("hot_checksum_errors", 0) == 1 and c.get("hot_verified_inline", 0) == 0
    assert c.get("cold_reads", 0) == 1


def test_a_write_into_a_damaged_copy_after_remount_does_not_upload_the_damage(s3m):
    """A hot copy that rotted on the disk while the mount was down, then written in part
    through the new mount (an overwrite of its start, which without the writeback cache
    the kernel sends as it is, with no read of the page first): the copy is checked
    before the write changes it, so the bucket gets the good bytes with the new ones,
    never the rotten ones."""
    m = s3m("--no-writeback-cache")
    m.allowed_log.append("hot copy is damaged")
    data = bytearray(pattern(300_000, 23))
    write_file(m.path("sample"), bytes(data))
    m.cli("sync", m.mountpoint, "--wait", check=True)
    m.umount()
    with open(hot_files(m)[0], "r+b") as f:
        f.seek(200_000)
        f.write(b"\x00rot\x00")
    m.start()
    with open(m.path("sample"), "r+b") as f:
        f.write(b"new start")
    data[:9] = b"new start"
    m.cli("sync", m.mountpoint, "--wait", check=True)
    m.cli("release", m.path("sample"), check=True)  # read back from the bucket
    assert read_file(m.path("sample")) == bytes(data)
    assert status(m)["counters"].get("hot_checksum_errors", 0) == 1


# ---- kill -9 at random moments -----------------------------------------------------

WRITER = r"""
import os, sys, hashlib, time
root, journal, i = sys.argv[1], sys.argv[2], int(sys.argv[3])
with open(journal, "a") as log:
    while True:
        name = f"f{i:05d}"
        size = (i * 7919) % (3 << 20) + 1
        data = hashlib.sha256(name.encode()).digest() * (size // 32 + 1)
        with open(os.path.join(root, name), "wb") as f:
            f.write(data[:size])
            f.flush()
            os.fsync(f.fileno())
        log.write(f"{name} {size}\n")
        log.flush()
        if i % 5 == 4:   # churn: unlinks make gc work (journaled before they happen)
            log.write(f"-f{i - 3:05d}\n")
            log.flush()
            os.unlink(os.path.join(root, f"f{i - 3:05d}"))
        i += 1
"""


def expected_files(journal: str) -> tuple[dict[str, int], set[str]]:
    """Files fsynced and journaled (name -> size), and names journaled for removal."""
    files, removed = {}, set()
    if not os.path.exists(journal):
        return files, removed
    with open(journal) as f:
        for line in f:
            line = line.strip()
            if line.startswith("-"):
                files.pop(line[1:], None)
                removed.add(line[1:])
            elif line:
                name, size = line.split()
                files[name] = int(size)
    return files, removed


@pytest.mark.allow_log_errors
def test_kill9_at_random_points(s3m, tmp_path):
    """Crash-then-verify: fsynced files survive, mounts come back, fsck is clean."""
    import hashlib
    rng = random.Random(20261130)
    m = s3m("--cache-size", "8M", "--min-free", "0", "--checkpoint-interval", "0.7",
            "--upload-delay", "0.2")
    journal = str(tmp_path / "journal")
    crash_points = 0
    for round_ in range(4):
        start = sum(1 for _ in open(journal)) if os.path.exists(journal) else 0
        writer = subprocess.Popen([sys.executable, "-c", WRITER, m.mountpoint, journal,
                                   str(start * 10)])  # fresh names: no rewrites in flight
        try:
            time.sleep(rng.uniform(0.3, 2.0))
            m.kill9()
            crash_points += 1
        finally:
            writer.kill()
            writer.wait()
        m.start()
        expect, removed = expected_files(journal)
        for name, size in expect.items():
            data = hashlib.sha256(name.encode()).digest() * (size // 32 + 1)
            assert read_file(m.path(name)) == data[:size], f"round {round_}: {name}"
        # Also there may be: the file being written at each kill (never journaled)
        # and files whose unlink was journaled but not done.
        unknown = set(os.listdir(m.mountpoint)) - set(expect) - removed
        assert len(unknown) <= round_ + 1, unknown
    m.cli("sync", m.mountpoint, "--wait", check=True)
    m.umount()
    res = fsck(m)
    assert res.returncode == 0, res.stdout
    assert crash_points == 4


CYCLIC_READER = r"""
import os, sys
top = sys.argv[1]
names = sorted(os.listdir(top))
while True:  # every read reaches the daemon: the kernel's copy is dropped after it
    for name in names:
        fd = os.open(os.path.join(top, name), os.O_RDONLY)
        os.read(fd, 1 << 20)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
"""


@pytest.mark.allow_log_errors
def test_kill9_while_the_hot_tier_fills_from_the_bucket(mount_factory):
    """A fetched extent is written into a spare where the spare lies, then renamed
    into place: a crash in between leaves bytes in a spare, which the next start
    removes. Killed at random moments while a reader pulls packed files through a hot
    tier a third of their size (evicting all the time, so spares are made and taken):
    no spare keeps bytes after the restart, every file reads back whole, fsck is clean."""
    rng = random.Random(20261205)
    m = mount_factory(args=("--cache-size", "8M", "--min-free", "0", "--upload-delay", "0.1"))
    top = m.path("ds")
    os.mkdir(top)
    size = 64 << 10
    names = [f"f{i:03d}" for i in range(384)]  # 24 MiB, packed into shared objects
    for i, name in enumerate(names):
        write_file(os.path.join(top, name), pattern(size, i))
    m.cli("sync", m.mountpoint, "--wait", check=True)
    spare_dir = os.path.join(m.cache_dir, "hot.spare")
    for round_ in range(4):
        m.cli("release", "-r", top, check=True)
        made = len(os.listdir(spare_dir))
        reader = subprocess.Popen([sys.executable, "-c", CYCLIC_READER, top])
        try:
            wait_for(lambda: len(os.listdir(spare_dir)) != made, what="spares made or taken")
            time.sleep(rng.uniform(0.05, 0.6))
            m.kill9()
        finally:
            reader.kill()
            reader.wait()
        m.start()
        written = [n for n in os.listdir(spare_dir)
                   if os.path.getsize(os.path.join(spare_dir, n))]
        assert written == [], f"round {round_}: spares with bytes after a restart"
        for i, name in enumerate(names):
            assert read_file(os.path.join(top, name)) == pattern(size, i), f"round {round_}: {name}"
    m.umount()
    res = fsck(m)
    assert res.returncode == 0, res.stdout


def hot_copies(m, ino: int) -> list[str]:
    """The hot tier's extent files of inode `ino` (tierfs reports its own inode numbers)."""
    sub = os.path.join(m.cache_dir, "hot", f"{ino & 0xff:02x}")
    return sorted(n for n in os.listdir(sub) if n.split(".")[0] == f"{ino:x}") \
        if os.path.isdir(sub) else []


def assert_spares_empty(m) -> None:
    spare_dir = os.path.join(m.cache_dir, "hot.spare")
    assert [n for n in os.listdir(spare_dir)
            if os.path.getsize(os.path.join(spare_dir, n))] == []


def test_a_deleted_file_leaves_the_hot_tier_through_the_trash(mount_factory):
    """Deleting a file only hands its hot copies to the trash, whose thread empties
    them (docs/architecture.md: Hot tier layout); the copies go, the trash empties,
    no spare keeps their bytes, and a file written in their place reads back whole."""
    m = mount_factory(args=("--cache-size", "64M", "--min-free", "0"))
    path = m.path("ckpt.bin")
    write_file(path, pattern(5 * 4 * MiB + 123, 1))  # six extents of 4 MiB
    ino = os.stat(path).st_ino
    assert len(hot_copies(m, ino)) == 6
    os.unlink(path)
    wait_for(lambda: not hot_copies(m, ino) and status(m)["trash_files"] == 0,
             what="the deleted file's hot copies emptied")
    assert os.listdir(os.path.join(m.cache_dir, "hot.trash")) == []
    assert status(m)["trash_bytes"] == 0
    assert_spares_empty(m)
    write_file(path, pattern(3 * 4 * MiB, 2))
    drop_page_cache()
    assert read_file(path) == pattern(3 * 4 * MiB, 2)


def test_what_a_killed_daemon_left_to_empty_is_emptied_by_the_next(mount_factory):
    """A daemon killed before its trash's thread got to everything leaves files in
    hot.trash, and the hot copies of files deleted just before stay in the hot tier
    with no record: the next daemon empties the first and removes the second."""
    m = mount_factory(args=("--min-free", "0"))
    write_file(m.path("kept"), pattern(2 * 4 * MiB, 3))
    gone = m.path("gone")
    write_file(gone, pattern(2 * 4 * MiB, 4))
    ino = os.stat(gone).st_ino
    m.cli("sync", m.mountpoint, "--wait", check=True)
    m.umount()
    trash = os.path.join(m.cache_dir, "hot.trash")
    for i in range(3):  # as a killed daemon leaves them
        with open(os.path.join(trash, f"4242-dead-{i}"), "wb") as f:
            f.write(pattern(MiB, 10 + i))
    # The file goes from the namespace (offline, as a delete the daemon did not
    # finish with), its hot copies stay.
    m.start()
    os.unlink(gone)
    m.kill9()
    stray = os.path.join(m.cache_dir, "hot", f"{ino & 0xff:02x}", f"{ino:x}.0")
    if not os.path.exists(stray):  # emptied before the kill: put one back by hand
        write_file(stray, pattern(4 * MiB, 5))
    m.start()
    wait_for(lambda: os.listdir(trash) == [] and not hot_copies(m, ino)
             and status(m)["trash_files"] == 0, what="the trash emptied")
    assert_spares_empty(m)
    assert read_file(m.path("kept")) == pattern(2 * 4 * MiB, 3)
    assert not os.path.exists(gone)
    m.umount()
    res = fsck(m)
    assert res.returncode == 0, res.stdout


# ---- a full metadata database ------------------------------------------------------

def test_metadata_map_grows_then_enospc(mount_factory):
    """The LMDB map doubles when full; at its limit creates fail with ENOSPC, the
    mount stays up, and removing files makes room again."""
    m = mount_factory(args=("--meta-map-size", "256K", "--meta-max-map-size", "1M"))
    names = []
    with pytest.raises(OSError) as err:
        for i in range(20000):
            name = m.path(f"file-with-a-long-name-to-fill-the-map-{i:06d}")
            with open(name, "w"):
                pass
            names.append(name)
    assert err.value.errno == errno.ENOSPC
    assert len(names) > 1000  # it grew from 256 KiB before giving up
    assert os.path.exists(names[0])
    for name in names[:len(names) // 2]:
        os.unlink(name)
    with open(m.path("after-cleanup"), "w") as f:
        f.write("room again")
    assert read_file(m.path("after-cleanup")) == b"room again"
    m.allowed_log.append("metadata database is full")


def test_a_full_cache_disk_gives_enospc_not_eio(mount_factory, tmp_path):
    """The metadata database shares the cache dir's disk: once something else has
    filled that disk, creates fail with ENOSPC (the database cannot grow), not with
    EIO and a traceback; the mount stays up, and works again once there is room."""
    with small_disk(tmp_path / "small", "24m") as small:
        m = mount_factory(args=("--extent-size", "64K", "--min-free", "0"), start=False)
        m.cache_dir = str(small / "cache")
        m.start()
        try:
            write_file(m.path("kept"), pattern(MiB, 1))
            fill_disk(small / "filler")
            names = []
            with pytest.raises(OSError) as err:
                for i in range(20000):
                    name = m.path(f"file-with-a-long-name-to-fill-the-database-{i:06d}")
                    with open(name, "w"):
                        pass
                    names.append(name)
            assert err.value.errno == errno.ENOSPC
            assert read_file(m.path("kept")) == pattern(MiB, 1)
            os.unlink(small / "filler")
            write_file(m.path("after"), b"room again")
            assert read_file(m.path("after")) == b"room again"
            m.allowed_log.append("cache disk is full")
        finally:
            m.cleanup()


@pytest.mark.allow_log_errors
def test_refused_mount_releases_the_lease(s3m, mount_factory, tmp_path):
    """A mount refused after taking the lease (wrong cache dir) must not lock the
    filesystem for the lease's lifetime."""
    a = s3m(name="a")
    write_file(a.path("f"), b"kept")
    a.umount()
    other = mount_factory(name="other")        # a cache dir of another filesystem
    other.umount()
    res = a.cli("mount", a.cold_url, a.mountpoint, "--cache-dir", other.cache_dir)
    assert res.returncode == 1 and "belongs to filesystem" in res.stderr
    a.start()                                   # no "mounted read-write by" refusal
    assert read_file(a.path("f")) == b"kept"
