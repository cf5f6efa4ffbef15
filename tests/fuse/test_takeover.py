"""Taking a filesystem over from another node: `mount --force` on a new cache dir
recovers from the bucket's newest checkpoint and fences the old mount; a cache
dir another node has written past is refused; and the recovered node's new
objects never reuse ids of the old node's unreferenced uploads (which gc deletes)."""
from __future__ import annotations

import errno
import json
import os
import subprocess

import pytest

from tests.fuse.test_durability import s3env, s3m  # noqa: F401 (fixtures)
from tests.fuse.test_tiering import bucket_client, data_objects, pattern, status
from tests.harness import (drop_page_cache, fill_disk, read_file, small_disk, wait_until,
                           write_file)

MiB = 1 << 20
TAKEN_OVER = r"taken over by"  # the ERROR line a fenced daemon logs once


def object_id(key: str) -> int:
    return int(key.rsplit("/", 1)[1], 16)


def bucket_listing(m) -> dict[str, str]:
    """Every key under the filesystem's prefix with its ETag (content hash)."""
    bucket, prefix = m.cold_url[5:].split("/", 1)
    pages = bucket_client(m).get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=f"{prefix}/")
    return {o["Key"]: o["ETag"] for page in pages for o in page.get("Contents", [])}


def lease(m) -> dict:
    bucket, prefix = m.cold_url[5:].split("/", 1)
    body = bucket_client(m).get_object(Bucket=bucket, Key=f"{prefix}/lease.json")["Body"]
    return json.loads(body.read())


def forget_pages(path: str) -> None:
    """Drop clean cached pages without fsync (which a fenced mount answers with EIO)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def assert_errno(err: int, fn, *args) -> None:
    with pytest.raises(OSError) as info:
        fn(*args)
    assert info.value.errno == err, (fn, args, info.value)


def close_reporting(fd: int) -> list[int]:
    """Close, returning the errno a refused flush of written pages reports (if any)."""
    try:
        os.close(fd)
    except OSError as e:
        return [e.errno]
    return []


def one_line_error(res) -> str:
    err = res.stderr.strip()
    assert "Traceback" not in res.stderr and "\n" not in err, res.stderr
    return err


# ---- --force takeover fences the old mount --------------------------------------------

def test_force_takeover_fences_the_old_mount(s3m):
    a = s3m(name="a")
    a.allowed_log.append(TAKEN_OVER)
    data = pattern(2 * MiB + 7, 1)
    write_file(a.path("f"), data)
    os.mkdir(a.path("d"))
    a.cli("sync", a.mountpoint, "--wait", check=True)

    b = s3m(name="b", start=False)
    res = b.start("--force")                       # empty cache dir: recovers, takes the lease
    assert "took over the lease of" in res.stdout and a.cache_dir in res.stdout
    assert "recovered from metadata checkpoint" in res.stdout
    assert lease(b)["cache_dir"] == b.cache_dir
    assert read_file(b.path("f")) == data

    # A does not know yet (it reads the lease every 20 s): it still serves and accepts.
    assert status(a)["fenced_by"] is None
    write_file(a.path("late"), b"written on A after the takeover")
    forget_pages(a.path("f"))
    assert read_file(a.path("f")) == data

    # sync --wait must not claim durability: it reads the lease and A is fenced.
    res = a.cli("sync", a.mountpoint, "--wait")
    assert res.returncode == 3, (res.returncode, res.stdout, res.stderr)
    assert "fenced" in one_line_error(res)

    # Reads keep working, from the page cache and from the daemon.
    forget_pages(a.path("f"))
    assert read_file(a.path("f")) == data
    assert sorted(os.listdir(a.mountpoint)) == ["d", "f", "late"]

    # Every change is refused: EROFS; fsync cannot promise anything: EIO.
    assert_errno(errno.EROFS, write_file, a.path("new"), b"x")              # create
    assert_errno(errno.EROFS, os.open, a.path("f"), os.O_WRONLY | os.O_TRUNC)
    assert_errno(errno.EROFS, os.mkdir, a.path("d2"))
    assert_errno(errno.EROFS, os.unlink, a.path("f"))
    assert_errno(errno.EROFS, os.rmdir, a.path("d"))
    assert_errno(errno.EROFS, os.rename, a.path("f"), a.path("g"))
    assert_errno(errno.EROFS, os.truncate, a.path("f"), 10)
    assert_errno(errno.EROFS, os.setxattr, a.path("f"), "user.k", b"v")
    assert_errno(errno.EROFS, os.symlink, "f", a.path("ln"))
    assert_errno(errno.EROFS, os.chmod, a.path("f"), 0o600)
    fd = os.open(a.path("f"), os.O_RDONLY)
    try:
        assert_errno(errno.EIO, os.fsync, fd)
    finally:
        os.close(fd)
    # Opening for writing is refused, as on a read-only mount: no write(2) can land in
    # the kernel's writeback cache and be seen by A's readers.
    assert_errno(errno.EROFS, os.open, a.path("f"), os.O_RDWR)
    assert_errno(errno.EROFS, os.open, a.path("f"), os.O_WRONLY | os.O_APPEND)
    forget_pages(a.path("f"))
    assert read_file(a.path("f")) == data

    # status says so, and exits 3.
    res = a.cli("status", a.mountpoint)
    assert res.returncode == 3, (res.returncode, res.stderr)
    assert any(line.startswith("FENCED") for line in res.stdout.splitlines()), res.stdout
    res = a.cli("status", a.mountpoint, "--json")
    assert res.returncode == 3
    fenced_by = json.loads(res.stdout)["fenced_by"]
    assert fenced_by and b.cache_dir in fenced_by

    # umount unmounts, but exits 3 and says the mount had been fenced.
    res = a.cli("umount", a.mountpoint)
    assert res.returncode == 3, (res.returncode, res.stdout, res.stderr)
    assert "had been fenced" in one_line_error(res)
    assert not a.mounted
    a.pid = None
    assert lease(b)["cache_dir"] == b.cache_dir     # A's exit did not touch B's lease

    # Nothing A did after the takeover reached B; B writes on.
    assert sorted(os.listdir(b.mountpoint)) == ["d", "f"]
    drop_page_cache(b.mountpoint)
    assert read_file(b.path("f")) == data
    write_file(b.path("after"), b"B keeps writing")
    b.cli("sync", b.mountpoint, "--wait", check=True)
    assert status(b)["fenced_by"] is None


# ---- a stale cache dir is refused --------------------------------------------------------

def test_stale_cache_dir_is_refused_after_another_node_wrote(s3m):
    a = s3m(name="a")
    a.allowed_log.append("holds older metadata")
    write_file(a.path("f"), pattern(MiB + 3, 2))
    a.umount()
    assert lease(a).get("released") is True        # kept as the record of the last writer

    b = s3m(name="b", start=False)
    res = b.start()                                # released lease: no --force needed
    assert "recovered from metadata checkpoint" in res.stdout
    b_data = pattern(3 * MiB + 1, 3)
    write_file(b.path("from-b"), b_data)
    os.unlink(b.path("f"))
    b.umount()
    after_b = lease(b)
    assert after_b.get("released") is True and after_b["cache_dir"] == b.cache_dir
    before = bucket_listing(b)

    res = a.cli("mount", a.cold_url, a.mountpoint, "--cache-dir", a.cache_dir,
                "--extent-size", "1M")
    assert res.returncode == 1, (res.returncode, res.stdout, res.stderr)
    err = one_line_error(res)
    assert "holds older metadata" in err and a.cache_dir in err and b.cache_dir in err
    assert not a.mounted
    assert bucket_listing(b) == before             # lease and data untouched
    assert lease(b) == after_b

    c = s3m(name="c")                              # a fresh node sees what B wrote
    assert sorted(os.listdir(c.mountpoint)) == ["from-b"]
    assert read_file(c.path("from-b")) == b_data


def test_a_copy_of_a_cache_dir_cannot_mount_while_its_original_holds_the_lease(mount_factory):
    """A cache dir copied to pre-warm another node (cp -a, a cloned volume) carries
    the original's node-id. It must not pass for the original: the two would both
    write the filesystem, each checkpointing over the other's changes."""
    a = mount_factory(name="a", args=("--extent-size", "256K"))
    write_file(a.path("f"), b"written by a")
    a.umount()
    copy = a.cache_dir.replace("a-cache", "b-cache")
    subprocess.run(["cp", "-a", a.cache_dir, copy], check=True)
    a.start()                                      # the original mounts again
    b = mount_factory(cold_url=a.cold_url, name="b", start=False)
    b.allowed_log.append("is a copy of")
    res = b.cli("mount", b.cold_url, b.mountpoint, "--cache-dir", copy,
                "--extent-size", "256K")
    assert res.returncode == 1, (res.returncode, res.stdout, res.stderr)
    err = one_line_error(res)
    assert "copy" in err and copy in err, err
    assert not b.mounted
    write_file(a.path("g"), b"a still writes")
    a.cli("sync", a.mountpoint, "--wait", check=True)  # a was not fenced nor joined
    assert status(a)["fenced_by"] is None


def test_an_unmount_whose_final_checkpoint_failed_keeps_the_lease(s3m, tmp_path):
    """The bucket fails after the data is in: the final checkpoint at unmount does not
    land. `tierfs umount` says so and exits 3, and the lease stays held (to lapse as
    a dead node's does), so that no node starts at once from the older checkpoint,
    which lacks the last changes. The same cache dir mounts again and has them."""
    from tests.fuse.test_outage import set_faults
    faults = str(tmp_path / "faults.json")
    set_faults(faults, {})
    a = s3m("--fault-file", faults, "--unmount-upload-timeout", "5", name="a")
    a.allowed_log += ["final metadata checkpoint", "lease stays held", "injected outage",
                      "lease renewal"]
    write_file(a.path("f"), b"in the bucket")
    a.cli("sync", a.mountpoint, "--wait", check=True)
    os.mkdir(a.path("after"))                      # in no checkpoint yet
    set_faults(faults, {"outage": True})
    res = a.cli("umount", a.mountpoint)
    a.pid = None
    assert res.returncode == 3, (res.returncode, res.stdout, res.stderr)
    assert "final metadata checkpoint did not reach the bucket" in one_line_error(res)
    assert not a.mounted
    set_faults(faults, {})
    assert lease(a).get("released") is not True

    b = s3m(name="b", start=False)
    b.allowed_log.append("is mounted read-write by")
    res = b.cli("mount", b.cold_url, b.mountpoint, "--cache-dir", b.cache_dir,
                "--extent-size", "1M")
    assert res.returncode != 0 and not b.mounted
    assert "--force" in one_line_error(res)

    a.start()
    assert sorted(os.listdir(a.mountpoint)) == ["after", "f"]
    a.umount()
    assert lease(a).get("released") is True


@pytest.mark.allow_log_errors
def test_a_daemon_that_fails_its_final_checkpoint_on_a_full_cache_disk_keeps_the_lease(
        mount_factory, tmp_path):
    """The cache dir's disk is full at unmount: the final checkpoint cannot copy the
    metadata, and the daemon ends with that error. The lease must stay held, as
    after any final checkpoint that did not land, or another node would start at
    once from the older checkpoint, without what was changed since."""
    cache = tmp_path / "a-cache"
    a = mount_factory(name="a", args=("--extent-size", "256K", "--cache-size", "2M",
                                      "--min-free", "0"), start=False)
    with small_disk(cache, "16m"):
        a.start()
        write_file(a.path("f"), b"in the bucket")
        a.cli("sync", a.mountpoint, "--wait", check=True)
        os.mkdir(a.path("after"))                  # in no checkpoint yet
        fill_disk(cache / "filler")                # the cache disk fills up
        res = a.cli("umount", a.mountpoint)
        a.pid = None
        assert res.returncode == 3, (res.returncode, res.stdout, res.stderr)
        assert "mount it again" in one_line_error(res)
        with open(tmp_path / "a-cold" / "lease.json") as f:
            assert json.load(f).get("released") is not True
        os.unlink(cache / "filler")
        a.start()                                  # the same cache dir has it all
        assert sorted(os.listdir(a.mountpoint)) == ["after", "f"]
        a.umount()


@pytest.mark.allow_log_errors
def test_a_sync_wait_whose_checkpoint_finds_the_cache_disk_full_says_so(mount_factory, tmp_path):
    """A checkpoint copies the metadata into the cache dir first: on a full cache disk
    that fails. `sync --wait` then says that in one line and exits 3 (not in the
    bucket), instead of losing its connection to a traceback in the daemon's log."""
    cache = tmp_path / "a-cache"
    a = mount_factory(name="a", args=("--extent-size", "256K", "--cache-size", "2M",
                                      "--min-free", "0"), start=False)
    with small_disk(cache, "16m"):
        a.start()
        write_file(a.path("f"), b"in the bucket")
        a.cli("sync", a.mountpoint, "--wait", check=True)
        fill_disk(cache / "filler")                # the cache disk fills up
        res = a.cli("sync", a.mountpoint, "--wait", "--timeout", "60")
        assert res.returncode == 3, (res.returncode, res.stdout, res.stderr)
        assert "No space left on device" in one_line_error(res)
        assert "control request failed" not in a.log()
        os.unlink(cache / "filler")
        a.cli("sync", a.mountpoint, "--wait", check=True)
        a.umount()


def test_a_mount_refused_after_recovering_does_not_pose_as_the_last_writer(mount_factory):
    """A new node recovers the namespace into its empty cache dir, then its mount is
    refused (a --cache-size larger than its disk). It wrote nothing: the lease must
    still name the node that wrote last, whose cache dir then mounts as before,
    instead of being refused as stale."""
    a = mount_factory(name="a", args=("--extent-size", "256K"))
    write_file(a.path("f"), b"written last by a")
    a.umount()
    b = mount_factory(cold_url=a.cold_url, name="b", start=False)
    b.allowed_log.append("--cache-size .* is larger than")
    res = b.cli("mount", b.cold_url, b.mountpoint, "--cache-dir", b.cache_dir,
                "--cache-size", "1P")
    assert res.returncode == 1 and "--cache-size" in one_line_error(res), res.stderr
    assert not b.mounted
    a.start()
    assert read_file(a.path("f")) == b"written last by a"


def test_a_sync_wait_on_a_mount_taken_over_meanwhile_says_so(s3m, tmp_path):
    """`sync --wait` waits for uploads that hang; another node takes the filesystem
    over. Once the old mount notices (its next lease renewal, which goes on while the
    data PUTs hang), nothing more uploads from it: the sync fails at once naming the
    takeover, instead of waiting out its --timeout and calling it a timeout."""
    import subprocess
    import sys
    from tests.fuse.test_outage import set_faults
    faults = str(tmp_path / "faults.json")
    set_faults(faults, {})
    a = s3m("--fault-file", faults, "--lease-ttl", "6", name="a")  # renews every 2 s
    a.allowed_log += [TAKEN_OVER, "injected", "lease renewal"]
    held = lease(a)
    assert held["renew_every"] == 2 and held["expires"] - held["renewed"] == 6, held
    write_file(a.path("before"), b"x")
    a.cli("sync", a.mountpoint, "--wait", check=True)
    set_faults(faults, {"hang": True, "hang_ops": ["put"]})
    write_file(a.path("f"), pattern(MiB, 4))
    renewed = lease(a)["renewed"]
    wait_until(lambda: lease(a)["renewed"] > renewed, 15, "a renewal while the PUTs hang")
    sync = subprocess.Popen([sys.executable, "-m", "tierfs", "sync", a.mountpoint, "--wait",
                             "--timeout", "600"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        b = s3m(name="b", start=False)
        b.start("--force")
        out, err = sync.communicate(timeout=90)
    finally:
        if sync.poll() is None:
            sync.kill()
            sync.wait()
        set_faults(faults, {})
    assert sync.returncode != 0
    assert "took the filesystem over" in err and "timed out" not in err, err


# ---- ids after recovery ------------------------------------------------------------------

def test_new_data_after_recovery_survives_gc_of_the_old_nodes_objects(s3m):
    a = s3m("--checkpoint-interval", "0", "--upload-delay", "0.2", name="a")
    write_file(a.path("f1"), pattern(2 * MiB, 4))
    a.cli("sync", a.mountpoint, "--wait", check=True)  # the checkpoint B recovers from
    f1_objects = set(data_objects(a))
    assert len(f1_objects) == 2
    write_file(a.path("f2"), pattern(2 * MiB, 5))
    wait_until(lambda: status(a)["dirty_bytes"] == 0, 20, "f2 to be uploaded")
    a_objects = set(data_objects(a))
    f2_objects = a_objects - f1_objects             # in the bucket, in no checkpoint
    assert len(f2_objects) == 2
    a.kill9()                                       # a dead node

    b = s3m("--checkpoint-keep", "1", "--force", name="b")
    assert not os.path.exists(b.path("f2"))         # created after the checkpoint
    assert read_file(b.path("f1")) == pattern(2 * MiB, 4)
    g = pattern(3 * MiB + 11, 6)
    write_file(b.path("g"), g)
    for _ in range(2):                              # keep + 1: A's checkpoint is pruned
        b.cli("sync", b.mountpoint, "--wait", check=True)
    wait_until(lambda: status(b)["gc_backlog_objects"] == 0, 20, "gc of A's stray objects")

    # g must come back from the bucket intact: its objects were not deleted with A's.
    b.cli("release", b.path("g"), check=True)
    drop_page_cache(b.mountpoint)
    assert read_file(b.path("g")) == g
    assert read_file(b.path("f1")) == pattern(2 * MiB, 4)

    objects = set(data_objects(b))
    assert not objects & f2_objects                 # gc deleted A's stray objects
    b_objects = objects - a_objects                 # g: 4 extents of 1 MiB
    assert len(b_objects) == 4 and objects == f1_objects | b_objects, sorted(objects)
    assert all(object_id(k) >= 1 << 32 for k in b_objects), sorted(b_objects)
    assert min(map(object_id, b_objects)) > max(map(object_id, a_objects))


# ---- a fenced mount leaves the bucket alone -------------------------------------------

def checkpoints_taken(m) -> int:
    res = m.cli("status", m.mountpoint, "--json")  # exits 3 on a fenced mount
    return json.loads(res.stdout)["counters"].get("checkpoints", 0)


def test_fenced_mount_takes_no_more_checkpoints(s3m):
    a = s3m("--checkpoint-interval", "0.3", name="a")
    a.allowed_log.append(TAKEN_OVER)
    write_file(a.path("f"), b"from A")
    a.cli("sync", a.mountpoint, "--wait", check=True)
    b = s3m(name="b", start=False)
    b.start("--force")
    assert a.cli("sync", a.mountpoint, "--wait").returncode == 3   # fenced from here on
    taken = checkpoints_taken(a)
    # At most one checkpoint already under way may finish; none may start.
    with pytest.raises(AssertionError, match="timed out"):
        wait_until(lambda: checkpoints_taken(a) > taken + 1, 2.0,
                   "a fenced mount to take another checkpoint", interval=0.2)
