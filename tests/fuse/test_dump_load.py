"""`tierfs dump` and `tierfs load`: a namespace written through a real mount moves
from LMDB to PostgreSQL and back, and a node mounts the result and reads
everything from the bucket; what cannot move is refused with one line."""
from __future__ import annotations

import os
import shutil

from tests.fuse.test_tiering import pattern, status
from tierfs.filesystem import meta_dir
from tierfs.meta import MetaStore, scan
from tierfs.tier.lease import LEASE_KEY
from tests.harness import read_file, run_cli, write_file

MiB = 1 << 20


def make_tree(m) -> dict[str, bytes]:
    """Files big and small (packed), a directory tree, a hard link, a symlink and an
    xattr; returns path (relative) -> content."""
    files = {f"ds/s{i:03d}": pattern(30_000, i) for i in range(40)}
    files["big/model.pt"] = pattern(5 * MiB + 123, 99)
    files["big/deep/er/note"] = b"hello"
    for rel, data in files.items():
        os.makedirs(os.path.dirname(m.path(rel)), exist_ok=True)
        write_file(m.path(rel), data)
    os.link(m.path("big/deep/er/note"), m.path("big/note-link"))
    os.symlink("deep/er/note", m.path("big/sym"))
    os.setxattr(m.path("big/model.pt"), "user.epoch", b"7")
    return files


def check_tree(m, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        assert read_file(m.path(rel)) == data, rel
    assert os.stat(m.path("big/note-link")).st_ino == os.stat(m.path("big/deep/er/note")).st_ino
    assert os.stat(m.path("big/note-link")).st_nlink == 2
    assert os.readlink(m.path("big/sym")) == "deep/er/note"
    assert os.getxattr(m.path("big/model.pt"), "user.epoch") == b"7"
    assert sorted(os.listdir(m.path("ds"))) == sorted(r[3:] for r in files if r.startswith("ds/"))


def test_a_namespace_moves_to_postgresql_and_back_and_mounts(mount_factory, postgres, tmp_path):
    a = mount_factory(args=("--extent-size", "1M"))
    files = make_tree(a)
    a.cli("sync", a.mountpoint, "--wait", check=True)
    a.umount()
    first, second = str(tmp_path / "first.dump"), str(tmp_path / "second.dump")
    res = run_cli("dump", a.cache_dir, first, check=True)
    assert res.stdout.startswith("dumped ") and res.stdout.endswith(f"records to {first}\n")
    url = postgres.new_schema()
    res = run_cli("load", first, url, check=True)
    assert res.stdout.startswith("loaded ") and "records of filesystem " in res.stdout
    source = MetaStore(meta_dir(a.cache_dir))
    fs_id = source.superblock().fs_id
    source.close()
    loaded = MetaStore(url)
    try:  # a's hot copies stay a's: no extent arrives marked hot
        extents = [ext for _ino, _idx, ext in scan.extents(loaded)]
        assert extents and not any(ext.hot for ext in extents)
        assert loaded.superblock().fs_id == fs_id
    finally:
        loaded.close()
    run_cli("dump", url, second, check=True)
    with open(first, "rb") as f1, open(second, "rb") as f2:
        assert f1.read() == f2.read()  # nothing lost or changed on the way through PostgreSQL
    # A node mounts the loaded namespace on a copy of the bucket (without the lease:
    # on the original, a's cache dir is the last writer's, and a cache dir of other
    # metadata is refused as stale).
    copy = tmp_path / "bucket-copy"
    shutil.copytree(a.cold_url[len("file://"):], copy, ignore=shutil.ignore_patterns(LEASE_KEY))
    b = mount_factory(cold_url=f"file://{copy}", name="b", args=("--extent-size", "1M"),
                      start=False)
    run_cli("load", second, b.cache_dir, check=True)
    b.start()
    before = status(b)
    assert before["hot_extents"] == 0 and before["cold_bytes"] >= sum(map(len, files.values()))
    check_tree(b, files)  # every byte from the bucket: the new cache dir had no hot copy
    assert status(b)["counters"]["cold_reads"] > 0
    write_file(b.path("after"), b"the loaded namespace takes new files")
    b.cli("sync", b.mountpoint, "--wait", check=True)
    b.umount()
    res = run_cli("fsck", b.cold_url, "--cache-dir", b.cache_dir, "--verify-data")
    assert res.returncode == 0, res.stdout
    # From the bucket's newest checkpoint, as a new node would recover it.
    third = str(tmp_path / "third.dump")
    res = run_cli("dump", b.cold_url, third, check=True)
    assert "no data was lost" in res.stdout
    # The namespace loaded into PostgreSQL mounts on many nodes, on the original bucket
    # (a unmounted cleanly): packed small files and all, from new cache dirs.
    args = ("--meta-url", url)
    c = mount_factory(cold_url=a.cold_url, name="c", args=args)
    d = mount_factory(cold_url=a.cold_url, name="d", args=args)
    check_tree(c, files)
    write_file(c.path("ds/new"), b"written on c")
    files["ds/new"] = b"written on c"
    check_tree(d, files)
    d.cli("sync", d.mountpoint, "--wait", check=True)
    c.umount()
    d.umount()
    res = run_cli("fsck", a.cold_url, "--meta-url", url, "--verify-data")
    assert res.returncode == 0, res.stdout


def test_what_cannot_move_is_refused_in_one_line(mount_factory, postgres, tmp_path):
    m = mount_factory(args=("--upload-delay", "3600"))
    write_file(m.path("dirty"), b"not in the bucket yet")
    out = str(tmp_path / "x.dump")
    res = run_cli("dump", m.cache_dir, out)  # mounted: the cache dir is in use
    assert res.returncode == 1 and len(res.stderr.splitlines()) == 1, res.stderr
    m.kill9()  # the dirty extent stays dirty in the cache dir
    res = run_cli("dump", m.cache_dir, out)
    assert res.returncode == 1 and "not in the bucket yet" in res.stderr
    assert "sync --wait" in res.stderr and len(res.stderr.splitlines()) == 1
    assert not [n for n in os.listdir(tmp_path) if n.startswith("x.dump")]  # nothing left
    m.start()
    m.cli("sync", m.mountpoint, "--wait", check=True)
    m.umount()
    run_cli("dump", m.cache_dir, out, check=True)
    url = postgres.new_schema()
    run_cli("load", out, url, check=True)
    res = run_cli("load", out, url)  # only into an empty target
    assert res.returncode == 1 and "already holds metadata" in res.stderr
    res = run_cli("load", out, m.cache_dir)
    assert res.returncode == 1 and "already holds metadata" in res.stderr
    with open(out, "r+b") as f:  # one flipped byte in the body
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 1]))
    fresh = str(tmp_path / "fresh-cache")
    res = run_cli("load", out, fresh)
    assert res.returncode == 1 and "is damaged" in res.stderr and len(res.stderr.splitlines()) == 1
    assert not os.path.exists(fresh)  # checked before anything is created
    res = run_cli("load", __file__, fresh)
    assert res.returncode == 1 and "is not a tierfs dump" in res.stderr
    for header in (b"[1]\n", b'{"tierfs_dump": 1}\n'):  # JSON, but no dump's header
        with open(out, "wb") as f:
            f.write(header)
        res = run_cli("load", out, fresh)
        assert res.returncode == 1 and "is not a tierfs dump" in res.stderr, res.stderr
        assert len(res.stderr.splitlines()) == 1
