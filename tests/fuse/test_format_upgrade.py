"""A filesystem made by an older release (format 1, kept as test data) mounts,
reads back whole, is upgraded in place, and then packs new small files; a format
this release does not know is refused with a clear message."""
from __future__ import annotations

import json
import os
import tarfile

from tests.data import make_format1 as fmt1
from tests.harness import drop_page_cache, read_file, write_file

DATA = os.path.join(os.path.dirname(fmt1.__file__), "format1-bucket.tar.gz")


def unpack_format1(tmp_path) -> str:
    with tarfile.open(DATA) as tar:  # the filter exists from Python 3.11.4 on
        extra = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(tmp_path, **extra)
    return os.path.join(tmp_path, "bucket")


def check_contents(m) -> None:
    for rel, data in fmt1.FILES.items():
        assert read_file(m.path(rel)) == data, rel
    name, head, at, tail = fmt1.SPARSE
    assert read_file(m.path(name)) == head + bytes(at - len(head)) + tail
    assert os.readlink(m.path(fmt1.SYMLINK[0])) == fmt1.SYMLINK[1]
    assert os.getxattr(m.path(fmt1.XATTR[0]), fmt1.XATTR[1]) == fmt1.XATTR[2]


def test_a_format_1_filesystem_mounts_reads_and_is_upgraded(mount_factory, tmp_path):
    bucket = unpack_format1(tmp_path)
    with open(os.path.join(bucket, "tierfs.json")) as f:
        assert json.load(f)["format"] == 1
    m = mount_factory(cold_url=f"file://{bucket}", start=False)
    res = m.start()  # a new cache dir: the metadata comes from format 1's checkpoint
    assert "upgraded filesystem" in res.stdout + res.stderr
    check_contents(m)  # every byte from format 1's one-object-per-extent data
    with open(os.path.join(bucket, "tierfs.json")) as f:
        assert json.load(f)["format"] == 2
    # New small files are packed beside the old objects.
    new = {m.path("new", f"n{i}"): bytes([i]) * 5000 for i in range(10)}
    os.mkdir(m.path("new"))
    for path, data in new.items():
        write_file(path, data)
    m.cli("sync", m.mountpoint, "--wait", check=True)
    counters = json.loads(m.cli("status", m.mountpoint, "--json", check=True).stdout)["counters"]
    assert counters["packed_extents"] == 10
    m.remount()
    m.cli("release", "-r", m.mountpoint, check=True)
    drop_page_cache(m.mountpoint)
    check_contents(m)
    for path, data in new.items():
        assert read_file(path) == data
    m.umount()
    res = m.cli("fsck", m.cold_url, "--cache-dir", m.cache_dir, "--verify-data")
    assert res.returncode == 0, res.stdout + res.stderr


def test_a_newer_format_is_refused(mount_factory, tmp_path):
    bucket = unpack_format1(tmp_path)
    sb_path = os.path.join(bucket, "tierfs.json")
    with open(sb_path) as f:
        sb = json.load(f)
    sb["format"] = 99
    with open(sb_path, "w") as f:
        json.dump(sb, f)
    m = mount_factory(cold_url=f"file://{bucket}", start=False)
    m.allowed_log.append("has format version 99")
    res = m.cli("mount", m.cold_url, m.mountpoint, "--cache-dir", m.cache_dir)
    assert res.returncode != 0
    assert "has format version 99" in res.stderr and "newer tierfs release" in res.stderr
    assert "Traceback" not in res.stderr and not m.mounted
