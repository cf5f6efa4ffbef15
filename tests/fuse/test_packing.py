"""Small files packed into shared objects, through a real mount on a file:// bucket:
fewer PUTs, cold reads of their ranges, gc of a pack with its last file, a damaged
or missing pack failing only its own files, and a daemon killed mid-upload."""
from __future__ import annotations

import errno
import json
import os
import resource
import time

import pytest

from tests.fuse.test_outage import set_faults
from tests.fuse.test_tiering import pattern, status
from tests.harness import drop_page_cache, read_file, wait_until, write_file
from tierfs.config import format_size
from tierfs.meta import MetaStore, scan
from tierfs.meta import schema as s

KiB = 1 << 10
ARGS = ("--extent-size", "64K", "--pack-size", "1M", "--checkpoint-keep", "1",
        "--compact-interval", "0.5")


def counters(m) -> dict:
    return json.loads(m.cli("status", m.mountpoint, "--json", check=True).stdout)["counters"]


def data_objects(m) -> list[str]:
    """The data objects in the mount's file:// bucket."""
    root = os.path.join(m.cold_url[len("file://"):], "data")
    return sorted(os.listdir(root)) if os.path.isdir(root) else []


def make_files(m, d: str, n: int, size: int, seed: int) -> dict[str, bytes]:
    os.makedirs(m.path(d), exist_ok=True)
    files = {m.path(d, f"f{i:03d}"): pattern(size, seed + i) for i in range(n)}
    for path, data in files.items():
        write_file(path, data)
    return files


def make_cold(m, top: str) -> None:
    """Evict the hot copies and the kernel's pages: the next reads come from the bucket."""
    m.cli("release", "-r", m.path(top), check=True)
    drop_page_cache(m.path(top))


def fd_limit(n: int):
    """A preexec_fn: the process (a daemon) may hold at most `n` descriptors."""
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))


def test_a_pack_of_more_files_than_the_daemon_may_open_is_uploaded(mount_factory):
    """A pack holds tiny files by the thousand (--pack-size counts bytes). Its upload
    used to hold a descriptor per file, failed with EMFILE on every try, and the files
    never reached the bucket (sync --wait ran into its timeout)."""
    m = mount_factory(start=False)
    # Nothing is due before the sync: on a busy machine, files written over more than
    # the upload delay would otherwise go up in several rounds, some alone.
    m.start("--upload-delay", "3600", preexec_fn=fd_limit(512))
    assert int(open(f"/proc/{m.pid}/limits").read().split("Max open files")[1].split()[1]) == 512
    files = make_files(m, "labels", 1000, 100, 7)  # 1,000 files of 100 bytes: one pack
    res = m.cli("sync", m.mountpoint, "--wait", "--timeout", "60")
    assert res.returncode == 0, res.stdout + res.stderr
    st = status(m)
    assert st["dirty_extents"] == 0 and st["counters"]["packed_extents"] == 1000, st
    assert 1 <= len(data_objects(m)) <= 2
    make_cold(m, "labels")
    for path, data in files.items():
        assert read_file(path) == data


def test_small_files_are_packed_and_read_back_cold(mount_factory):
    m = mount_factory(args=ARGS)
    files = make_files(m, "ds", 60, 20 * KiB, 1)  # 1.2 MiB: two packs of up to 1 MiB
    m.cli("sync", m.mountpoint, "--wait", check=True)
    after = counters(m)
    assert after["packed_extents"] == 60, after
    objects = data_objects(m)
    assert 2 <= len(objects) <= 6, objects  # not one per file
    make_cold(m, "ds")
    before = counters(m)
    for path, data in files.items():
        assert read_file(path) == data
    # Neighbours are counted once installed, which may follow the reads that used them.
    wait_until(lambda: status(m)["fetches_in_flight"] == 0, 30, "the neighbours' installs")
    after = counters(m)
    # A miss fetches its neighbours in the pack with it (the hot tier has room): one
    # ranged GET serves many files.
    gets = after["cold_reads"] - before.get("cold_reads", 0)
    around = after.get("read_around_extents", 0) - before.get("read_around_extents", 0)
    assert gets + around == 60 and gets <= 6, (gets, around)
    assert after.get("checksum_errors", 0) == 0


def test_files_copied_in_one_by_one_go_up_in_full_packs(mount_factory):
    """One writer copies 240 files of 16 KiB in over about three seconds: each round
    of the uploader finds only the files that came due since the last one (a quarter
    of a second's writes, 12 or more objects before), but a pack waits for more while
    the writer goes on, so they go up in packs of at least half of --pack-size."""
    m = mount_factory(args=(*ARGS, "--upload-delay", "0.5"))
    os.makedirs(m.path("copy"))
    files = {m.path("copy", f"f{i:03d}"): pattern(16 * KiB, 500 + i) for i in range(240)}
    for path, data in files.items():
        write_file(path, data)
        time.sleep(0.01)
    m.cli("sync", m.mountpoint, "--wait", check=True)
    assert counters(m)["packed_extents"] == 240
    assert len(data_objects(m)) <= 7, data_objects(m)
    make_cold(m, "copy")
    for path, data in files.items():
        assert read_file(path) == data


def test_reading_around_a_miss_never_evicts(mount_factory):
    """Neighbours come along only into free room: a full hot tier keeps what it holds."""
    m = mount_factory(args=(*ARGS, "--cache-size", "2M"))
    files = make_files(m, "ds", 40, 20 * KiB, 80)  # 800 KiB, one pack
    m.cli("sync", m.mountpoint, "--wait", check=True)
    make_cold(m, "ds")
    big = pattern(1800 * KiB, 81)  # fills the hot tier with clean data once uploaded
    write_file(m.path("big"), big)
    m.cli("sync", m.mountpoint, "--wait", check=True)
    before = counters(m)
    path = sorted(files)[20]
    assert read_file(path) == files[path]
    after = counters(m)
    assert after["cold_reads"] - before.get("cold_reads", 0) == 1
    assert after.get("read_around_extents", 0) == before.get("read_around_extents", 0)
    wait_until(lambda: status(m)["fetches_in_flight"] == 0, 30, "the fetched extent's install")
    hot = json.loads(m.cli("status", m.path("big"), "--json", check=True).stdout)["file"]["hot"]
    assert hot >= len(big) - 64 * KiB  # at most the one extent that made room went


def test_large_files_are_not_packed(mount_factory):
    m = mount_factory(args=(*ARGS, "--pack-below", "100K"))
    make_files(m, "big", 3, 200 * KiB, 10)  # 4 extents each, above --pack-below
    make_files(m, "small", 3, 10 * KiB, 20)
    m.cli("sync", m.mountpoint, "--wait", check=True)
    c = counters(m)
    assert c["packed_extents"] == 3 and c["uploads"] >= 12 + 1, c
    assert len(data_objects(m)) == 12 + 1  # an object per large extent, one pack


def test_a_pack_is_deleted_with_its_last_file(mount_factory):
    m = mount_factory(args=(*ARGS, "--compact-dead", "1"))  # no compaction: gc alone
    files = make_files(m, "d", 10, 30 * KiB, 30)
    m.cli("sync", m.mountpoint, "--wait", check=True)
    (pack,) = data_objects(m)
    paths = sorted(files)
    for path in paths[:-1]:
        os.unlink(path)
    m.cli("sync", m.mountpoint, "--wait", check=True)  # a checkpoint without them
    passes = counters(m).get("gc_passes", 0)
    wait_until(lambda: counters(m).get("gc_passes", 0) >= passes + 2, 30, "two gc passes")
    assert data_objects(m) == [pack]  # the last file still reads from it
    st = json.loads(m.cli("status", m.mountpoint, "--json", check=True).stdout)
    assert (st["packs"], st["pack_live_bytes"], st["pack_bytes"]) == (1, 30 * KiB, 300 * KiB)
    assert "1 object of small files, 30.0 KiB of 300.0 KiB still in use" in \
        m.cli("status", m.mountpoint, check=True).stdout
    make_cold(m, "d")
    assert read_file(paths[-1]) == files[paths[-1]]
    os.unlink(paths[-1])
    m.cli("sync", m.mountpoint, "--wait", check=True)
    wait_until(lambda: data_objects(m) == [], 30, "gc to delete the pack")


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_a_damaged_pack_fails_only_its_own_files(mount_factory, damage):
    m = mount_factory(args=ARGS)
    a = make_files(m, "a", 8, 12 * KiB, 40)
    m.cli("sync", m.mountpoint, "--wait", check=True)
    (pack_a,) = data_objects(m)
    b = make_files(m, "b", 8, 12 * KiB, 50)
    m.cli("sync", m.mountpoint, "--wait", check=True)
    assert len(data_objects(m)) == 2
    path = os.path.join(m.cold_url[len("file://"):], "data", pack_a)
    if damage == "corrupt":
        with open(path, "r+b") as f:  # every file's range in it gets a flipped byte
            for at in range(0, os.path.getsize(path), 4 * KiB):
                f.seek(at)
                byte = f.read(1)
                f.seek(at)
                f.write(bytes([byte[0] ^ 0xFF]))
    else:
        os.unlink(path)
    m.allowed_log.append("checksum mismatch on object" if damage == "corrupt"
                         else "is missing from the bucket")
    make_cold(m, "a")
    make_cold(m, "b")
    for p in a:
        with pytest.raises(OSError) as e:
            read_file(p)
        assert e.value.errno == errno.EIO
    for p, data in b.items():
        assert read_file(p) == data
    ino = os.stat(sorted(a)[0]).st_ino
    assert f"inode {ino} extent 0" in m.log()  # the log says which file lost data
    # One prefetch of both directories: b's files come, and each of a's is named.
    make_cold(m, "b")
    res = m.cli("prefetch", "-r", m.path("a"), m.path("b"))
    assert res.returncode == 1
    assert res.stdout.startswith(f"prefetched 8 files: {format_size(8 * 12 * KiB)} fetched")
    failed = sorted(line.split(":")[1].strip() for line in res.stderr.splitlines())
    assert failed == sorted(a), res.stderr


def test_a_pack_cut_short_fails_only_the_files_it_lacks(mount_factory):
    """A pack file in the bucket lost its end: only the file whose bytes were there
    reads EIO and is named in the log; the files before it read back whole."""
    m = mount_factory(args=ARGS)
    files = make_files(m, "a", 8, 12 * KiB, 150)
    m.cli("sync", m.mountpoint, "--wait", check=True)
    (pack,) = data_objects(m)
    os.truncate(os.path.join(m.cold_url[len("file://"):], "data", pack), 7 * 12 * KiB + 10)
    m.allowed_log.append("checksum mismatch on object")
    make_cold(m, "a")
    *whole, cut = sorted(files)
    for path in whole:
        assert read_file(path) == files[path]
    with pytest.raises(OSError) as e:
        read_file(cut)
    assert e.value.errno == errno.EIO
    blamed = [line for line in m.log().splitlines() if "checksum mismatch" in line]
    assert blamed and all(f"inode {os.stat(cut).st_ino} extent 0" in x for x in blamed), blamed


def test_a_daemon_killed_while_a_pack_uploads_loses_nothing(mount_factory, tmp_path):
    faults = str(tmp_path / "faults.json")
    set_faults(faults, {})
    m = mount_factory(args=(*ARGS, "--fault-file", faults))
    set_faults(faults, {"hang": True})  # every bucket call blocks: the PUT never ends
    files = make_files(m, "d", 20, 10 * KiB, 60)
    wait_until(lambda: json.loads(m.cli("status", m.mountpoint, "--json", check=True).stdout)
               ["uploads_running"], 30, "a pack upload to be under way")
    m.kill9()
    m.cli("umount", m.mountpoint)  # the kernel's side of the dead mount
    set_faults(faults, {})
    m.start()
    m.cli("sync", m.mountpoint, "--wait", check=True)
    assert counters(m)["packed_extents"] == 20  # uploaded again, from the hot tier
    make_cold(m, "d")
    for path, data in files.items():
        assert read_file(path) == data


def test_fsck_finds_and_repairs_pack_references(mount_factory):
    """A reference lost from the records would let gc delete a pack still in use:
    fsck finds it and records it again."""
    m = mount_factory(args=ARGS)
    files = make_files(m, "d", 6, 8 * KiB, 70)
    m.cli("sync", m.mountpoint, "--wait", check=True)
    m.umount()

    def fsck(*args):
        return m.cli("fsck", m.cold_url, "--cache-dir", m.cache_dir, *args)

    assert fsck().returncode == 0
    meta = MetaStore(os.path.join(m.cache_dir, "meta"))
    try:
        (pack_id, _pack), = scan.packs(meta)
        meta.delete_raw([s.ref_key(pack_id, meta.pack_refs(pack_id)[2].offset)])
    finally:
        meta.close()
    res = fsck()
    assert res.returncode == 4 and "1 file reference(s) not recorded" in res.stdout, res.stdout
    res = fsck("--repair")
    assert res.returncode == 1, res.stdout
    assert fsck("--verify-data").returncode == 0
    m.start()
    make_cold(m, "d")
    for path, data in files.items():
        assert read_file(path) == data


def test_a_mostly_dead_pack_is_compacted(mount_factory):
    m = mount_factory(args=ARGS)
    files = make_files(m, "d", 20, 30 * KiB, 90)
    m.cli("sync", m.mountpoint, "--wait", check=True)
    (old,) = data_objects(m)
    paths = sorted(files)
    for path in paths[5:]:  # 75% of the pack is dead now, past --compact-dead 0.25
        os.unlink(path)
    wait_until(lambda: counters(m).get("compactions", 0) >= 1, 60, "a compaction")
    m.cli("sync", m.mountpoint, "--wait", check=True)  # a checkpoint without the old pack
    wait_until(lambda: old not in data_objects(m), 30, "gc to delete the old pack")
    (new,) = data_objects(m)
    assert os.path.getsize(os.path.join(m.cold_url[len("file://"):], "data", new)) == 150 * KiB
    st = json.loads(m.cli("status", m.mountpoint, "--json", check=True).stdout)
    assert (st["packs"], st["pack_live_bytes"], st["pack_bytes"]) == (1, 150 * KiB, 150 * KiB)
    make_cold(m, "d")
    for path in paths[:5]:
        assert read_file(path) == files[path]
    m.umount()
    res = m.cli("fsck", m.cold_url, "--cache-dir", m.cache_dir, "--verify-data")
    assert res.returncode == 0, res.stdout


def test_a_daemon_killed_while_compacting_loses_nothing(mount_factory, tmp_path):
    faults = str(tmp_path / "faults.json")
    set_faults(faults, {})
    m = mount_factory(args=(*ARGS, "--fault-file", faults))
    files = make_files(m, "d", 20, 30 * KiB, 100)
    m.cli("sync", m.mountpoint, "--wait", check=True)
    paths = sorted(files)
    for path in paths[5:]:
        os.unlink(path)
    set_faults(faults, {"hang": True, "hang_ops": ["put"]})  # the new pack's PUT never ends
    wait_until(lambda: counters(m).get("compaction_runs", 0) >= 1, 60, "a compaction to start")
    m.kill9()
    m.cli("umount", m.mountpoint)
    set_faults(faults, {})
    m.start()
    make_cold(m, "d")
    for path in paths[:5]:
        assert read_file(path) == files[path]
    wait_until(lambda: counters(m).get("compactions", 0) >= 1, 60, "the compaction again")
    m.umount()
    res = m.cli("fsck", m.cold_url, "--cache-dir", m.cache_dir, "--verify-data")
    assert res.returncode == 0, res.stdout


def test_a_pack_lost_from_the_bucket_does_not_stop_compaction(mount_factory):
    """A pack gone from the bucket cannot be compacted: it is named in the log once,
    and the other dead packs are compacted all the same."""
    m = mount_factory(args=ARGS)
    a = make_files(m, "a", 20, 30 * KiB, 110)
    m.cli("sync", m.mountpoint, "--wait", check=True)
    (lost,) = data_objects(m)
    b = make_files(m, "b", 20, 30 * KiB, 130)
    m.cli("sync", m.mountpoint, "--wait", check=True)
    os.unlink(os.path.join(m.cold_url[len("file://"):], "data", lost))
    m.allowed_log.append("is missing from the bucket")
    for path in sorted(a)[5:] + sorted(b)[5:]:  # both packs 75% dead
        os.unlink(path)
    wait_until(lambda: counters(m).get("compactions", 0) >= 1, 60, "b's pack to be compacted")
    make_cold(m, "b")
    for path in sorted(b)[:5]:
        assert read_file(path) == b[path]
    assert m.log().count(f"pack data/{lost} is missing from the bucket") == 1, m.log()


def test_prefetch_and_pin_fetch_packed_files_a_range_of_the_pack_at_a_time(mount_factory):
    """`prefetch -r` and `pin -r` of a directory of small packed files send the files
    in one request and cost a few ranged GETs, not one per file; files packed among
    them that were not named stay cold."""
    from tests.fuse.test_ecosystem import file_is_hot
    m = mount_factory(args=("--extent-size", "1M"))
    os.makedirs(m.path("ds"))
    os.makedirs(m.path("other"))
    files, others = {}, {}
    for i in range(150):  # interleaved, so the packs hold both directories' files
        files[m.path("ds", f"s{i:03d}")] = pattern(20_000, i)
        if i % 10 == 0:
            others[m.path("other", f"o{i:03d}")] = pattern(20_000, 1000 + i)
    for path, data in {**files, **others}.items():
        write_file(path, data)
    m.cli("sync", m.mountpoint, "--wait", check=True)
    for verb, expect in (("prefetch", "prefetched 150 files: 2.9 MiB fetched, 0 B already hot"),
                         ("pin", "pinned 150 files (150 extents changed)")):
        m.cli("release", "-r", m.path("ds"), m.path("other"), check=True)
        assert not any(file_is_hot(p) for p in files)
        before = counters(m).get("cold_reads", 0)
        res = m.cli(verb, "-r", m.path("ds"), check=True)
        assert res.stdout.startswith(expect), res.stdout
        gets = counters(m)["cold_reads"] - before
        assert gets <= 8, f"{verb}: {gets} GETs for {len(files)} files packed together"
        assert all(file_is_hot(p) for p in files)
        assert not any(file_is_hot(p) for p in others), "a file not named was fetched"
    drop_page_cache(*files, *others)
    for path, data in {**files, **others}.items():
        assert read_file(path) == data, path
