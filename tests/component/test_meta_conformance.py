"""The metadata conformance suite: every test runs on each engine, LMDB in a temp
dir and PostgreSQL (a real server the tests start, a new schema per test):
namespace operations, readdir cookies, orphans, xattrs, extent maps, packs and
the gc table."""
from __future__ import annotations

import errno
import os
import stat

import pytest

from tierfs.errors import FsError
from tierfs.meta import MetaStore, scan
from tierfs.meta import schema as s
from tierfs.meta.schema import DIRTY, HOT, ROOT_INO, Extent, Pack, Ref, Superblock
from tierfs.meta.store import COUNTED_RECORDS, Published, count_blocks

REG = stat.S_IFREG | 0o644
DIR = stat.S_IFDIR | 0o755
NOREPLACE, EXCHANGE = 1, 2  # the values renameat2 uses


def gc_ids(meta):
    """Object ids waiting for gc (without the epoch they were dropped in)."""
    return [obj for obj, _epoch in meta.gc_pending()]


def never(_ino: int) -> bool:
    return False


def always(_ino: int) -> bool:
    return True


@pytest.fixture(params=["lmdb", "postgresql"])
def location(request, tmp_path):
    """Where a new, empty store lives: an LMDB directory or a PostgreSQL schema."""
    if request.param == "lmdb":
        return str(tmp_path / "meta")
    return request.getfixturevalue("postgres").new_schema()


@pytest.fixture
def meta(location):
    m = MetaStore(location, map_size=1 << 30)
    m.format(Superblock(fs_id="test", extent_size=4 << 20), uid=0, gid=0)
    yield m
    try:
        m.close()
    except Exception:  # already closed by the test
        pass


def err(fn, *args) -> int:
    with pytest.raises(FsError) as info:
        fn(*args)
    return info.value.errno


def mkfile(meta, parent, name, mode=REG, uid=0, gid=0):
    return meta.create_node(parent, name, mode, uid, gid)


def names(meta, ino) -> list[bytes]:
    return [n for _c, n, _i in meta.readdir(ino, 0)]


def has_key(meta, key: bytes) -> bool:
    with meta.kv.read() as txn:
        return txn.get(key) is not None


# ---- format and counters -------------------------------------------------------------
def test_format_and_reopen(location, meta):
    root = meta.get_inode(ROOT_INO)
    assert stat.S_ISDIR(root.mode) and root.nlink == 2 and root.parent == ROOT_INO
    assert meta.superblock().fs_id == "test"
    f = mkfile(meta, ROOT_INO, b"kept")
    first, second = meta.next_object_id(), meta.next_object_id()
    assert 0 < first < second  # a shared engine hands them out in blocks: not dense
    meta.close()
    again = MetaStore(location, map_size=1 << 30)
    try:
        assert again.lookup(ROOT_INO, b"kept") == f.ino
        assert again.next_object_id() > second  # never handed out twice
        assert again.inode_count() > f.ino
    finally:
        again.close()


def test_empty_store_has_no_superblock(location):
    m = MetaStore(location, map_size=1 << 26)
    try:
        assert m.superblock() is None
    finally:
        m.close()


# ---- create / lookup -----------------------------------------------------------------
def test_create_and_lookup(meta):
    before = meta.get_inode(ROOT_INO)
    f = mkfile(meta, ROOT_INO, b"file", uid=5, gid=6)
    d = meta.create_node(ROOT_INO, b"dir", DIR, 0, 0)
    ln = meta.create_node(ROOT_INO, b"link", stat.S_IFLNK | 0o777, 0, 0, target=b"file")
    dev = meta.create_node(ROOT_INO, b"null", stat.S_IFCHR | 0o600, 0, 0, rdev=0x103)
    assert len({f.ino, d.ino, ln.ino, dev.ino}) == 4 and ROOT_INO not in {f.ino, d.ino}
    assert meta.lookup(ROOT_INO, b"file") == f.ino
    got = meta.get_inode(f.ino)
    assert (got.mode, got.uid, got.gid, got.nlink, got.size) == (REG, 5, 6, 1, 0)
    assert got.mtime_ns == got.ctime_ns == got.atime_ns > 0
    dnode = meta.get_inode(d.ino)
    assert dnode.nlink == 2 and dnode.parent == ROOT_INO
    assert meta.readlink(ln.ino) == b"file" and meta.get_inode(ln.ino).size == 4
    assert meta.get_inode(dev.ino).rdev == 0x103
    root = meta.get_inode(ROOT_INO)
    assert root.nlink == 3  # one subdirectory
    assert root.mtime_ns >= before.mtime_ns and root.next_cookie == s.FIRST_COOKIE + 4
    assert meta.lookup(ROOT_INO, b".") == ROOT_INO
    assert meta.lookup(ROOT_INO, b"..") == ROOT_INO
    assert meta.lookup(d.ino, b"..") == ROOT_INO
    assert meta.lookup(d.ino, b".") == d.ino


def test_create_errors(meta):
    f = mkfile(meta, ROOT_INO, b"f")
    assert err(mkfile, meta, ROOT_INO, b"f") == errno.EEXIST
    assert err(mkfile, meta, ROOT_INO, b"x" * 256) == errno.ENAMETOOLONG
    assert mkfile(meta, ROOT_INO, b"x" * 255).ino
    for bad in (b"", b".", b"..", b"a/b"):
        assert err(mkfile, meta, ROOT_INO, bad) == errno.EINVAL
    assert err(mkfile, meta, f.ino, b"child") == errno.ENOTDIR
    assert err(mkfile, meta, 999_999, b"child") == errno.ENOENT
    assert err(meta.lookup, ROOT_INO, b"missing") == errno.ENOENT
    assert err(meta.lookup, ROOT_INO, b"y" * 256) == errno.ENAMETOOLONG
    assert err(meta.get_inode, 999_999) == errno.ENOENT
    assert err(meta.readlink, f.ino) == errno.EINVAL


def test_setgid_directory_inheritance(meta):
    g = meta.create_node(ROOT_INO, b"g", DIR | stat.S_ISGID, 0, 77)
    f = mkfile(meta, g.ino, b"f", uid=1, gid=2)
    sub = meta.create_node(g.ino, b"sub", DIR, 1, 2)
    assert f.gid == 77 and not f.mode & stat.S_ISGID
    assert sub.gid == 77 and sub.mode & stat.S_ISGID
    plain = meta.create_node(ROOT_INO, b"plain", DIR, 0, 77)
    assert mkfile(meta, plain.ino, b"f", uid=1, gid=2).gid == 2


def test_create_in_removed_directory(meta):
    d = meta.create_node(ROOT_INO, b"d", DIR, 0, 0)
    meta.rmdir(ROOT_INO, b"d", always)  # still open somewhere: orphaned
    assert meta.get_inode(d.ino).nlink == 0
    assert err(mkfile, meta, d.ino, b"f") == errno.ENOENT
    assert err(meta.create_node, d.ino, b"sub", DIR, 0, 0) == errno.ENOENT


# ---- link / unlink / rmdir -----------------------------------------------------------
def test_link(meta):
    f = mkfile(meta, ROOT_INO, b"a")
    d = meta.create_node(ROOT_INO, b"d", DIR, 0, 0)
    node = meta.link(f.ino, d.ino, b"b")
    assert node.nlink == 2 and meta.get_inode(f.ino).nlink == 2
    assert node.ctime_ns >= f.ctime_ns
    assert meta.lookup(d.ino, b"b") == f.ino
    assert err(meta.link, f.ino, d.ino, b"b") == errno.EEXIST
    assert err(meta.link, d.ino, ROOT_INO, b"dirlink") == errno.EPERM
    assert err(meta.link, f.ino, ROOT_INO, b"z" * 256) == errno.ENAMETOOLONG
    assert err(meta.link, f.ino, f.ino, b"x") == errno.ENOTDIR
    assert meta.get_inode(d.ino).nlink == 2  # links to files do not count


def test_unlink_purges_when_unused(meta):
    f = mkfile(meta, ROOT_INO, b"f")
    meta.set_xattr(f.ino, b"user.a", b"1")
    meta.update(None, {(f.ino, 0): Extent(flags=HOT, obj_id=11, length=3),
                       (f.ino, 1): Extent(flags=HOT | DIRTY)})
    assert meta.unlink(ROOT_INO, b"f", never) == (f.ino, True)
    assert err(meta.lookup, ROOT_INO, b"f") == errno.ENOENT
    assert err(meta.get_inode, f.ino) == errno.ENOENT
    assert not has_key(meta, s.extent_key(f.ino, 0)) and not has_key(meta, s.extent_key(f.ino, 1))
    assert meta.list_xattrs(f.ino) == []
    assert gc_ids(meta) == [11]  # the uploaded extent's object goes to gc
    assert names(meta, ROOT_INO) == []


def test_unlink_one_of_two_links(meta):
    f = mkfile(meta, ROOT_INO, b"a")
    meta.link(f.ino, ROOT_INO, b"b")
    assert meta.unlink(ROOT_INO, b"a", never) == (f.ino, False)
    assert meta.get_inode(f.ino).nlink == 1
    assert meta.lookup(ROOT_INO, b"b") == f.ino
    assert meta.orphans() == []


def test_unlink_in_use_orphans_then_purge(meta):
    f = mkfile(meta, ROOT_INO, b"f")
    meta.update(None, {(f.ino, 0): Extent(flags=HOT, obj_id=5)})
    assert meta.unlink(ROOT_INO, b"f", lambda ino: ino == f.ino) == (f.ino, False)
    node = meta.get_inode(f.ino)  # still there for the open file
    assert node.nlink == 0
    assert meta.orphans() == [f.ino]
    assert meta.all_extents(f.ino)  # data kept
    assert gc_ids(meta) == []
    assert meta.purge_orphan(f.ino) is True
    assert err(meta.get_inode, f.ino) == errno.ENOENT
    assert meta.orphans() == [] and gc_ids(meta) == [5]
    assert meta.purge_orphan(f.ino) is False


def test_unlink_of_a_huge_file_purges_it_in_parts(meta):
    """A file with more extents than one purge transaction takes (LMDB runs them on
    the event loop: a 1 TiB file's records held every request for seconds): the unlink
    drops the name and at most purge_batch records, leaving an orphan whose records
    purge_orphan deletes in parts, each in a transaction of its own."""
    meta.purge_batch = 8
    f = mkfile(meta, ROOT_INO, b"big")
    meta.update(None, {(f.ino, i): Extent(obj_id=100 + i, obj_len=1) for i in range(20)})
    assert meta.unlink(ROOT_INO, b"big", never) == (f.ino, False)
    assert err(meta.lookup, ROOT_INO, b"big") == errno.ENOENT
    assert meta.is_orphan(f.ino) and len(meta.all_extents(f.ino)) == 12
    assert meta.purge_orphan(f.ino, 8) is None
    assert len(meta.all_extents(f.ino)) == 4
    assert meta.purge_orphan(f.ino, 8) is True
    assert err(meta.get_inode, f.ino) == errno.ENOENT
    assert meta.orphans() == [] and sorted(gc_ids(meta)) == list(range(100, 120))


def test_purge_orphan_ignores_linked_inodes(meta):
    f = mkfile(meta, ROOT_INO, b"f")
    assert meta.purge_orphan(f.ino) is False
    assert meta.get_inode(f.ino).nlink == 1


def test_unlink_errors(meta):
    d = meta.create_node(ROOT_INO, b"d", DIR, 0, 0)
    f = mkfile(meta, ROOT_INO, b"f")
    assert err(meta.unlink, ROOT_INO, b"d", never) == errno.EISDIR
    assert err(meta.unlink, ROOT_INO, b"missing", never) == errno.ENOENT
    assert err(meta.unlink, ROOT_INO, b"m" * 256, never) == errno.ENAMETOOLONG
    assert err(meta.unlink, f.ino, b"x", never) == errno.ENOTDIR
    assert meta.lookup(ROOT_INO, b"d") == d.ino


def test_rmdir(meta):
    d = meta.create_node(ROOT_INO, b"d", DIR, 0, 0)
    sub = meta.create_node(d.ino, b"sub", DIR, 0, 0)
    mkfile(meta, ROOT_INO, b"f")
    assert meta.get_inode(ROOT_INO).nlink == 3
    assert err(meta.rmdir, ROOT_INO, b"d", never) == errno.ENOTEMPTY
    assert err(meta.rmdir, ROOT_INO, b"f", never) == errno.ENOTDIR
    assert err(meta.rmdir, ROOT_INO, b"missing", never) == errno.ENOENT
    assert err(meta.rmdir, d.ino, b".", never) == errno.EINVAL
    assert err(meta.rmdir, d.ino, b"..", never) == errno.ENOTEMPTY
    assert meta.rmdir(d.ino, b"sub", never) == (sub.ino, True)
    assert meta.get_inode(d.ino).nlink == 2
    assert meta.rmdir(ROOT_INO, b"d", lambda i: True) == (d.ino, False)
    assert meta.get_inode(ROOT_INO).nlink == 2
    assert meta.get_inode(d.ino).nlink == 0 and meta.orphans() == [d.ino]
    assert meta.purge_orphan(d.ino)


# ---- rename --------------------------------------------------------------------------
def rename(meta, op, on, np, nn, flags=0, in_use=never):
    return meta.rename(op, on, np, nn, flags, in_use, NOREPLACE, EXCHANGE)


def test_rename_simple_and_cross_directory(meta):
    a = meta.create_node(ROOT_INO, b"a", DIR, 0, 0)
    b = meta.create_node(ROOT_INO, b"b", DIR, 0, 0)
    f = mkfile(meta, a.ino, b"f")
    assert rename(meta, a.ino, b"f", a.ino, b"g") == (None, False)
    assert meta.lookup(a.ino, b"g") == f.ino and err(meta.lookup, a.ino, b"f") == errno.ENOENT
    assert rename(meta, a.ino, b"g", b.ino, b"h") == (None, False)
    assert names(meta, a.ino) == [] and names(meta, b.ino) == [b"h"]
    sub = meta.create_node(a.ino, b"sub", DIR, 0, 0)
    assert meta.get_inode(a.ino).nlink == 3
    rename(meta, a.ino, b"sub", b.ino, b"sub2")
    assert meta.get_inode(a.ino).nlink == 2 and meta.get_inode(b.ino).nlink == 3
    assert meta.get_inode(sub.ino).parent == b.ino
    assert meta.lookup(sub.ino, b"..") == b.ino


def test_rename_over_file(meta):
    a = mkfile(meta, ROOT_INO, b"a")
    b = mkfile(meta, ROOT_INO, b"b")
    meta.update(None, {(b.ino, 0): Extent(obj_id=9)})
    assert rename(meta, ROOT_INO, b"a", ROOT_INO, b"b") == (b.ino, True)
    assert meta.lookup(ROOT_INO, b"b") == a.ino
    assert err(meta.get_inode, b.ino) == errno.ENOENT and gc_ids(meta) == [9]
    c = mkfile(meta, ROOT_INO, b"c")
    assert rename(meta, ROOT_INO, b"c", ROOT_INO, b"b", in_use=always) == (a.ino, False)
    assert meta.orphans() == [a.ino] and meta.lookup(ROOT_INO, b"b") == c.ino
    # Replacing one name of a hard-linked file only drops a link.
    meta.link(c.ino, ROOT_INO, b"c2")
    d = mkfile(meta, ROOT_INO, b"d")
    assert rename(meta, ROOT_INO, b"d", ROOT_INO, b"b") == (c.ino, False)
    assert meta.get_inode(c.ino).nlink == 1 and meta.lookup(ROOT_INO, b"b") == d.ino


def test_rename_dir_over_empty_dir(meta):
    a = meta.create_node(ROOT_INO, b"a", DIR, 0, 0)
    p = meta.create_node(ROOT_INO, b"p", DIR, 0, 0)
    target = meta.create_node(p.ino, b"t", DIR, 0, 0)
    assert meta.get_inode(ROOT_INO).nlink == 4 and meta.get_inode(p.ino).nlink == 3
    assert rename(meta, ROOT_INO, b"a", p.ino, b"t") == (target.ino, True)
    # Root lost a; p lost t and gained a: 3 and 3.
    assert meta.get_inode(ROOT_INO).nlink == 3 and meta.get_inode(p.ino).nlink == 3
    assert meta.get_inode(a.ino).parent == p.ino
    same = meta.create_node(p.ino, b"empty", DIR, 0, 0)
    assert rename(meta, p.ino, b"t", p.ino, b"empty") == (same.ino, True)
    assert meta.get_inode(p.ino).nlink == 3


def test_rename_errors(meta):
    f = mkfile(meta, ROOT_INO, b"f")
    full = meta.create_node(ROOT_INO, b"full", DIR, 0, 0)
    inner = meta.create_node(full.ino, b"inner", DIR, 0, 0)
    empty = meta.create_node(ROOT_INO, b"empty", DIR, 0, 0)
    assert err(rename, meta, ROOT_INO, b"empty", ROOT_INO, b"full") == errno.ENOTEMPTY
    assert err(rename, meta, ROOT_INO, b"empty", ROOT_INO, b"f") == errno.ENOTDIR
    assert err(rename, meta, ROOT_INO, b"f", ROOT_INO, b"empty") == errno.EISDIR
    assert err(rename, meta, ROOT_INO, b"full", inner.ino, b"x") == errno.EINVAL
    assert err(rename, meta, ROOT_INO, b"full", full.ino, b"x") == errno.EINVAL
    assert err(rename, meta, ROOT_INO, b"nope", ROOT_INO, b"x") == errno.ENOENT
    assert err(rename, meta, ROOT_INO, b"f", ROOT_INO, b"n" * 256) == errno.ENAMETOOLONG
    assert err(rename, meta, ROOT_INO, b"f", f.ino, b"x") == errno.ENOTDIR
    assert err(rename, meta, ROOT_INO, b"f", ROOT_INO, b"full", NOREPLACE) == errno.EEXIST
    assert err(rename, meta, ROOT_INO, b"f", ROOT_INO, b"none", EXCHANGE) == errno.ENOENT
    assert err(rename, meta, ROOT_INO, b"f", ROOT_INO, b"w", 4) == errno.EINVAL  # WHITEOUT
    assert sorted(names(meta, ROOT_INO)) == [b"empty", b"f", b"full"]
    assert meta.get_inode(ROOT_INO).nlink == 4 and meta.get_inode(empty.ino).nlink == 2


def test_rename_same_inode_is_noop(meta):
    f = mkfile(meta, ROOT_INO, b"a")
    meta.link(f.ino, ROOT_INO, b"b")
    assert rename(meta, ROOT_INO, b"a", ROOT_INO, b"b") == (None, False)
    assert sorted(names(meta, ROOT_INO)) == [b"a", b"b"]
    assert meta.get_inode(f.ino).nlink == 2


def test_rename_noreplace_to_free_name(meta):
    f = mkfile(meta, ROOT_INO, b"a")
    assert rename(meta, ROOT_INO, b"a", ROOT_INO, b"b", NOREPLACE) == (None, False)
    assert meta.lookup(ROOT_INO, b"b") == f.ino


def test_rename_exchange(meta):
    x = meta.create_node(ROOT_INO, b"x", DIR, 0, 0)
    y = meta.create_node(ROOT_INO, b"y", DIR, 0, 0)
    f = mkfile(meta, x.ino, b"f")
    sub = meta.create_node(y.ino, b"sub", DIR, 0, 0)
    cookies_x = meta.readdir(x.ino, 0)
    assert rename(meta, x.ino, b"f", y.ino, b"sub", EXCHANGE) == (None, False)
    assert meta.lookup(x.ino, b"f") == sub.ino and meta.lookup(y.ino, b"sub") == f.ino
    assert meta.get_inode(sub.ino).parent == x.ino
    assert meta.get_inode(x.ino).nlink == 3 and meta.get_inode(y.ino).nlink == 2
    # Each name keeps its readdir cookie.
    assert [c for c, _n, _i in meta.readdir(x.ino, 0)] == [c for c, _n, _i in cookies_x]
    assert meta.readdir(x.ino, 0)[0][2] == sub.ino
    # Two files in one directory.
    a, b = mkfile(meta, ROOT_INO, b"a"), mkfile(meta, ROOT_INO, b"b")
    rename(meta, ROOT_INO, b"a", ROOT_INO, b"b", EXCHANGE)
    assert meta.lookup(ROOT_INO, b"a") == b.ino and meta.lookup(ROOT_INO, b"b") == a.ino
    # Not into its own subtree.
    deeper = meta.create_node(sub.ino, b"deeper", DIR, 0, 0)
    assert err(rename, meta, x.ino, b"f", sub.ino, b"deeper", EXCHANGE) == errno.EINVAL
    assert meta.lookup(sub.ino, b"deeper") == deeper.ino


# ---- readdir -------------------------------------------------------------------------
def test_readdir_cookies_are_stable(meta):
    d = meta.create_node(ROOT_INO, b"d", DIR, 0, 0)
    inos = {n: mkfile(meta, d.ino, n).ino for n in (b"c", b"a", b"b")}
    listing = meta.readdir(d.ino, 0)
    assert listing == [(3, b"c", inos[b"c"]), (4, b"a", inos[b"a"]), (5, b"b", inos[b"b"])]
    assert meta.readdir(d.ino, 2) == listing  # '.' and '..' are 1 and 2
    assert meta.readdir(d.ino, 3) == listing[1:]
    meta.unlink(d.ino, b"a", never)
    assert meta.readdir(d.ino, 3) == [listing[2]]
    assert meta.readdir(d.ino, 4) == [listing[2]]  # resuming after a removed cookie
    e = mkfile(meta, d.ino, b"e")
    assert meta.readdir(d.ino, 5) == [(6, b"e", e.ino)]  # cookies are never reused
    rename(meta, d.ino, b"c", d.ino, b"c2")
    assert meta.readdir(d.ino, 0) == [(5, b"b", inos[b"b"]), (6, b"e", e.ino),
                                      (7, b"c2", inos[b"c"])]
    assert meta.readdir(d.ino, 7) == []
    assert meta.readdir(d.ino, 1 << 62) == []


def test_readdir_pages_and_directories_do_not_mix(meta):
    d1 = meta.create_node(ROOT_INO, b"d1", DIR, 0, 0)
    d2 = meta.create_node(ROOT_INO, b"d2", DIR, 0, 0)
    for i in range(1000):
        mkfile(meta, d1.ino, b"f%04d" % i)
    mkfile(meta, d2.ino, b"other")
    seen, after = [], 0
    while batch := meta.readdir(d1.ino, after, 64):
        assert len(batch) <= 64
        seen += batch
        after = batch[-1][0]
    assert [n for _c, n, _i in seen] == [b"f%04d" % i for i in range(1000)]
    assert [c for c, _n, _i in seen] == list(range(3, 1003))
    assert names(meta, d2.ino) == [b"other"]
    empty = meta.create_node(ROOT_INO, b"empty", DIR, 0, 0)
    assert meta.readdir(empty.ino, 0) == []


def test_get_inodes(meta):
    a, b = mkfile(meta, ROOT_INO, b"a"), mkfile(meta, ROOT_INO, b"b")
    assert [n.ino for n in meta.get_inodes([b.ino, a.ino])] == [b.ino, a.ino]
    assert err(meta.get_inodes, [a.ino, 999]) == errno.ENOENT


# ---- xattrs --------------------------------------------------------------------------
def test_xattrs(meta):
    f = mkfile(meta, ROOT_INO, b"f")
    g = mkfile(meta, ROOT_INO, b"g")
    assert meta.get_xattr(f.ino, b"user.a") is None
    meta.set_xattr(f.ino, b"user.b", b"2")
    meta.set_xattr(f.ino, b"user.a", b"1")
    meta.set_xattr(g.ino, b"user.z", b"other inode")
    assert meta.get_inode(f.ino).ctime_ns >= f.ctime_ns
    assert meta.list_xattrs(f.ino) == [b"user.a", b"user.b"]
    assert meta.get_xattr(f.ino, b"user.a") == b"1"
    assert err(meta.set_xattr, f.ino, b"user.a", b"x", os.XATTR_CREATE) == errno.EEXIST
    assert err(meta.set_xattr, f.ino, b"user.c", b"x", os.XATTR_REPLACE) == errno.ENODATA
    meta.set_xattr(f.ino, b"user.a", b"one", os.XATTR_REPLACE)
    meta.set_xattr(f.ino, b"user.c", b"", os.XATTR_CREATE)
    assert meta.get_xattr(f.ino, b"user.a") == b"one"
    assert meta.get_xattr(f.ino, b"user.c") == b""
    meta.remove_xattr(f.ino, b"user.b")
    assert err(meta.remove_xattr, f.ino, b"user.b") == errno.ENODATA
    assert meta.list_xattrs(f.ino) == [b"user.a", b"user.c"]
    assert meta.list_xattrs(g.ino) == [b"user.z"]
    assert err(meta.set_xattr, 999_999, b"user.a", b"1") == errno.ENOENT
    assert err(meta.remove_xattr, 999_999, b"user.a") == errno.ENOENT


# ---- extents -------------------------------------------------------------------------
def test_extents_ranges_update_and_gc(meta):
    f = mkfile(meta, ROOT_INO, b"f")
    other = mkfile(meta, ROOT_INO, b"other")
    exts = {i: Extent(flags=HOT, length=i, obj_id=100 + i) for i in (0, 1, 5, 255, 256, 1280)}
    meta.update(None, {(f.ino, i): e for i, e in exts.items()})
    meta.update(None, {(other.ino, 0): Extent(flags=HOT | DIRTY)})
    node, got = meta.get_extents(f.ino, 0, 1 << 20)
    assert node.ino == f.ino and got == exts and list(got) == sorted(exts)
    assert meta.get_extents(f.ino, 1, 1)[1] == {1: exts[1]}
    assert meta.get_extents(f.ino, 2, 2)[1] == {}
    assert meta.get_extents(f.ino, 1, 255)[1] == {i: exts[i] for i in (1, 5, 255)}
    assert meta.get_extents(f.ino, 2, 4)[1] == {}
    assert meta.get_extents(f.ino, 256, (1 << 64) - 1)[1] == {i: exts[i] for i in (256, 1280)}
    assert meta.all_extents(f.ino) == exts
    assert meta.all_extents(other.ino) == {0: Extent(flags=HOT | DIRTY)}
    assert meta.extent_indices(f.ino) == sorted(exts)  # keys only, not the neighbour's
    assert meta.extent_indices(other.ino) == [0]
    assert meta.extent_indices(999_999) == []
    assert err(meta.get_extents, 999_999, 0, 1) == errno.ENOENT
    assert [(i, x) for i, x, _e in scan.extents(meta)] == \
        [(f.ino, i) for i in sorted(exts)] + [(other.ino, 0)]
    # Inode and extents in one transaction; None deletes; gc keys added.
    node.size = 12345
    meta.update(node, {(f.ino, 5): None, (f.ino, 1): Extent(flags=HOT | DIRTY),
                       (f.ino, 9999): None}, gc_objects=[105, 42])
    assert meta.get_inode(f.ino).size == 12345
    assert sorted(meta.all_extents(f.ino)) == [0, 1, 255, 256, 1280]
    assert meta.all_extents(f.ino)[1] == Extent(flags=HOT | DIRTY)
    assert gc_ids(meta) == [42, 105]
    meta.gc_done([42])
    assert gc_ids(meta) == [105]
    meta.gc_done([105, 7])  # unknown ids are fine
    assert gc_ids(meta) == []


def test_last_extent_indices_read_a_file_from_its_end(meta):
    f = mkfile(meta, ROOT_INO, b"f")
    other = mkfile(meta, ROOT_INO, b"other")  # its records follow f's
    meta.update(None, {(f.ino, i): Extent(flags=HOT | DIRTY) for i in (0, 3, 4, 256, 1280)})
    meta.update(None, {(other.ino, 0): Extent(flags=HOT | DIRTY)})
    assert meta.last_extent_indices(f.ino, 0, 3) == [1280, 256, 4]
    assert meta.last_extent_indices(f.ino, 4, 10) == [1280, 256, 4]
    assert meta.last_extent_indices(f.ino, 5, 10) == [1280, 256]
    assert meta.last_extent_indices(f.ino, 1281, 10) == []
    assert meta.last_extent_indices(other.ino, 0, 10) == [0]  # the last records stored
    assert meta.last_extent_indices(999_999, 0, 10) == []


def test_put_extent_if(meta):
    f = mkfile(meta, ROOT_INO, b"f")
    old = Extent(flags=HOT | DIRTY)
    meta.update(None, {(f.ino, 0): old})
    new = Extent(flags=HOT, length=10, checksum=1, obj_id=3, obj_len=10)
    assert meta.put_extent_if(f.ino, 0, Extent(flags=HOT), new) is False
    assert meta.all_extents(f.ino)[0] == old
    assert meta.put_extent_if(f.ino, 0, old, new) is True
    assert meta.all_extents(f.ino)[0] == new
    assert meta.put_extent_if(f.ino, 1, old, new) is False  # missing record
    assert 1 not in meta.all_extents(f.ino)
    # Many at once: each set only if its record is what was expected.
    meta.update(None, {(f.ino, 2): old})
    newer = Extent(flags=HOT, length=5, obj_id=4, obj_len=5)
    assert meta.put_extents_if([((f.ino, 0), new, newer), ((f.ino, 2), new, newer),
                                ((f.ino, 7), old, newer)]) == [True, False, False]
    assert meta.all_extents(f.ino) == {0: newer, 2: old}


def test_purge_removes_everything_of_the_inode(meta):
    ln = meta.create_node(ROOT_INO, b"l", stat.S_IFLNK | 0o777, 0, 0, target=b"t")
    f = mkfile(meta, ROOT_INO, b"f")
    meta.set_xattr(f.ino, b"user.x", b"1")
    meta.update(None, {(f.ino, 0): Extent(obj_id=1), (f.ino, 1): Extent(flags=HOT | DIRTY)})
    keep = mkfile(meta, ROOT_INO, b"keep")
    meta.set_xattr(keep.ino, b"user.x", b"kept")
    meta.update(None, {(keep.ino, 0): Extent(obj_id=2)})
    meta.unlink(ROOT_INO, b"l", never)
    meta.unlink(ROOT_INO, b"f", never)
    for key in (s.inode_key(ln.ino), s.symlink_key(ln.ino), s.inode_key(f.ino),
                s.xattr_key(f.ino, b"user.x"), s.extent_key(f.ino, 0),
                s.extent_key(f.ino, 1), s.orphan_key(f.ino)):
        assert not has_key(meta, key), key
    assert meta.get_xattr(keep.ino, b"user.x") == b"kept"
    assert meta.all_extents(keep.ino) == {0: Extent(obj_id=2)}
    assert gc_ids(meta) == [1]


def test_orphans_survive_reopen(location, meta):
    f = mkfile(meta, ROOT_INO, b"f")
    meta.unlink(ROOT_INO, b"f", always)
    meta.close()
    again = MetaStore(location, map_size=1 << 30)
    try:
        assert again.orphans() == [f.ino]
        assert again.purge_orphan(f.ino)
        assert again.orphans() == []
    finally:
        again.close()


# ---- packs --------------------------------------------------------------------------
def test_a_pack_goes_to_gc_with_its_last_reference(meta):
    f = mkfile(meta, ROOT_INO, b"f")
    g = mkfile(meta, ROOT_INO, b"g")
    pack_id = meta.next_object_id()
    a = Extent(flags=HOT, length=100, checksum=1, obj_id=pack_id, obj_off=0, obj_len=100)
    b = Extent(flags=HOT, length=50, checksum=2, obj_id=pack_id, obj_off=100, obj_len=50)
    ra, rb = Ref(0, 100, f.ino, 0), Ref(100, 50, g.ino, 0)
    meta.update(None, {(f.ino, 0): a, (g.ino, 0): b}, uploaded=[pack_id],
                packs={pack_id: (150, [ra, rb])})
    assert meta.pack(pack_id) == Pack(150, 150)
    assert meta.pack_refs(pack_id) == [ra, rb]
    assert meta.pack_refs(pack_id, 50, 150) == [rb] and meta.pack_refs(pack_id, 0, 100) == [ra]
    assert meta.upload_intents() == []
    meta.begin_epoch()  # a checkpoint may hold the pack from now on
    meta.copy_taken()
    # f is rewritten: its old reference goes, twice (a drop is idempotent)
    meta.update(None, {(f.ino, 0): Extent(flags=HOT | DIRTY)}, gc_objects=[a.ref])
    meta.update(None, {}, gc_objects=[a.ref])
    assert meta.pack(pack_id) == Pack(150, 50) and meta.pack_refs(pack_id) == [rb]
    assert gc_ids(meta) == []  # g still reads from it
    with pytest.raises(ValueError):  # a pack is never dropped whole while referenced
        meta.update(None, {}, gc_objects=[pack_id])
    assert meta.pack(pack_id) is not None and gc_ids(meta) == []
    # g unlinked and purged: the last reference, so the whole pack goes (after the
    # checkpoints of this epoch, which may reference it)
    meta.unlink(ROOT_INO, b"g", never)
    assert meta.pack(pack_id) is None and meta.pack_refs(pack_id) == []
    assert meta.gc_pending() == [(pack_id, meta.epoch)]
    assert meta.gc_backlog() == (1, 150)


def test_a_pack_made_after_the_checkpoint_copy_goes_at_once(meta):
    f = mkfile(meta, ROOT_INO, b"f")
    pack_id = meta.next_object_id()
    ext = Extent(flags=HOT, length=10, obj_id=pack_id, obj_off=0, obj_len=10)
    meta.update(None, {(f.ino, 0): ext}, uploaded=[pack_id],
                packs={pack_id: (10, [Ref(0, 10, f.ino, 0)])})
    meta.update(None, {(f.ino, 0): None}, gc_objects=[ext.ref])
    assert meta.gc_pending() == [(pack_id, 0)]  # in no checkpoint: nothing to wait for


def test_set_pack_refs_repairs_what_the_records_say(meta):
    pack_id = meta.next_object_id()
    meta.update(None, {}, uploaded=[pack_id],
                packs={pack_id: (300, [Ref(0, 100, 5, 0), Ref(100, 100, 6, 0)])})
    refs = [Ref(0, 100, 5, 0), Ref(200, 100, 7, 1)]
    meta.set_pack_refs(pack_id, refs)
    assert meta.pack_refs(pack_id) == refs
    assert meta.pack(pack_id) == Pack(300, 200)
    meta.set_pack_refs(pack_id, [])
    assert meta.pack(pack_id) is None and meta.pack_refs(pack_id) == []
    assert gc_ids(meta) == [pack_id]


# ---- sessions -----------------------------------------------------------------------
def test_a_session_owns_its_orphans_and_upload_intents(meta):
    sid = meta.open_session("node-a", 123, "/mnt/a")
    assert [(x.sid, x.node, x.pid, x.mountpoint) for x in meta.sessions()] == \
        [(sid, "node-a", 123, "/mnt/a")]
    f = mkfile(meta, ROOT_INO, b"open")
    meta.unlink(ROOT_INO, b"open", always)  # still open: kept as this session's orphan
    obj = meta.next_object_id()
    before = meta.sessions()[0].heartbeat_ns
    meta.heartbeat()
    assert meta.sessions()[0].heartbeat_ns > before
    assert meta.end_session(sid) == (1, 1)
    assert meta.orphans() == [] and meta.upload_intents() == []
    assert err(meta.get_inode, f.ino) == errno.ENOENT
    assert obj in gc_ids(meta)
    assert meta.sessions() == []
    assert meta.end_session(sid) == (0, 0)  # twice: nothing more


# ---- what a node of a shared namespace reads and publishes (tier/shared_view.py) ----------

E = 1 << 20


def test_attrs_and_readdir_plus_count_blocks_of_present_extents(meta):
    d = meta.create_node(ROOT_INO, b"d", DIR, 0, 0)
    sparse, full, empty = (mkfile(meta, d.ino, n) for n in (b"sparse", b"full", b"empty"))
    sparse.size, full.size = 3 * E, E + 100
    meta.update(sparse, {(sparse.ino, 2): Extent(obj_id=7, length=E)})
    meta.update(full, {(full.ino, 0): Extent(obj_id=8, length=E),
                       (full.ino, 1): Extent(obj_id=9, length=100)})
    node, blocks = meta.attrs(d.ino, E, b"sparse")
    assert (node.ino, node.size, blocks) == (sparse.ino, 3 * E, E // 512)
    assert meta.attrs(full.ino, E)[1] == (E + 100 + 511) // 512
    assert meta.attrs(d.ino, E, b"..")[0].ino == ROOT_INO
    assert meta.attrs(d.ino, E, b".")[0].ino == d.ino
    assert err(meta.attrs, d.ino, E, b"missing") == errno.ENOENT
    assert err(meta.attrs, 999_999, E) == errno.ENOENT
    node, parent, page = meta.readdir_plus(d.ino, 0, 2, E)
    assert (node.ino, parent.ino) == (d.ino, ROOT_INO)
    assert [(n, f[0].ino, f[1]) for _c, n, f in page] == [
        (b"sparse", sparse.ino, E // 512), (b"full", full.ino, (E + 100 + 511) // 512)]
    _n, _p, rest = meta.readdir_plus(d.ino, page[-1][0], 2, E)
    assert [(n, f[0].ino, f[1]) for _c, n, f in rest] == [(b"empty", empty.ino, 0)]
    assert [c for c, _n, _f in page + rest] == [c for c, _n, _i in meta.readdir(d.ino, 0)]


def _blocks_by_scan(meta, ino: int) -> int:
    node = meta.get_inode(ino)
    return count_blocks(node, meta.extent_indices(ino), E)


def test_blocks_follow_every_change_of_the_extent_records(meta):
    """st_blocks of a big file (its record count kept on LMDB) after each way the
    records or the size change: always what counting every record gives."""
    f = mkfile(meta, ROOT_INO, b"f")
    n = COUNTED_RECORDS + 10
    f.size = (n + 5) * E - 100  # holes at 3 and 4, and after the records
    meta.update(f, {(f.ino, i): Extent(obj_id=100 + i, length=E)
                    for i in range(n) if i not in (3, 4)})

    def check(why: str) -> None:
        node = meta.get_inode(f.ino)
        assert meta.blocks(node, E) == _blocks_by_scan(meta, f.ino), why

    check("first stat")
    check("second stat")
    meta.update(None, {(f.ino, 3): Extent(flags=HOT | DIRTY)})
    check("a hole filled")
    meta.update(None, {(f.ino, 10): None})
    check("a record deleted")
    meta.update(None, {(f.ino, n + 4): Extent(flags=HOT | DIRTY)})
    check("the last extent written")
    assert meta.put_extent_if(f.ino, 0, Extent(obj_id=100, length=E), Extent(flags=HOT))
    check("a record replaced")
    f = meta.get_inode(f.ino)
    f.size = 20 * E + 7
    meta.update(f)
    check("shrunk with records past the end")
    meta.update(None, {(f.ino, 20): Extent(flags=HOT | DIRTY), (f.ino, 40): None})
    check("records past the end changed")
    meta.delete_raw([s.extent_key(f.ino, 5)])
    check("a record deleted raw")
    meta.take_view(meta.get_inode(f.ino), {(f.ino, 4): Extent(obj_id=99, length=E)}, [])
    check("a pulled record")
    held = {i: Extent(flags=HOT | DIRTY).published(42) for i in range(0, 30, 2)}
    meta.publish([Published(f.ino, 30 * E, 1, 2, held, 0)], 42, "node-a")
    check("published")
    meta.update(None, {(f.ino, i): Extent(flags=HOT | DIRTY) for i in range(30, 30 + n)})
    check("records added past the end")
    meta.unlink(ROOT_INO, b"f", always)  # in use: an orphan, purged below in parts
    assert meta.purge_orphan(f.ino, 4) is None
    check("part of a purge")


def test_a_stat_of_a_big_file_reads_its_records_once(tmp_path):
    """blocks() of a file of many extent records reads them all once; later stats
    read only the last one, until a change of the records."""
    meta = MetaStore(str(tmp_path / "meta"), map_size=1 << 30)
    try:
        meta.format(Superblock(fs_id="test", extent_size=E), uid=0, gid=0)
        f = mkfile(meta, ROOT_INO, b"f")
        f.size = 1000 * E
        meta.update(f, {(f.ino, i): Extent(obj_id=1 + i, length=E) for i in range(1000)})
        read = []
        scan = meta.kv.scan

        def counting(txn, start, end, values=True):
            for key, val in scan(txn, start, end, values):
                if key.startswith(s.extent_prefix(f.ino)):
                    read.append(key)
                yield key, val

        meta.kv.scan = counting
        assert meta.blocks(f, E) == 1000 * E // 512
        read.clear()
        assert meta.blocks(f, E) == 1000 * E // 512
        assert len(read) <= 1, f"a stat read {len(read)} extent records"
        meta.update(None, {(f.ino, 500): None})
        assert meta.blocks(f, E) == 999 * E // 512
        read.clear()
        assert meta.blocks(f, E) == 999 * E // 512
        assert len(read) <= 1, f"a stat read {len(read)} extent records"
    finally:
        meta.close()


def test_file_view_and_publish(meta):
    f = mkfile(meta, ROOT_INO, b"f")
    f.size = 2 * E
    meta.update(f, {(f.ino, 0): Extent(obj_id=5, length=E), (f.ino, 1): Extent(obj_id=6, length=E)})
    meta.update(None, packs={6: (3 * E, [Ref(0, E, f.ino, 1)])})
    node, exts = meta.file_view(f.ino)
    assert node.size == 2 * E and sorted(exts) == [0, 1]
    assert meta.packs_among([5, 6]) == [6]
    # Extent 0 rewritten and held by session 42; extent 1 cut away: its pack goes to gc.
    held = {0: Extent(flags=HOT | DIRTY).published(42)}
    assert meta.publish([Published(f.ino, E, 111, 222, held, 4096)], 42, "node-a") == [True]
    node, exts = meta.file_view(f.ino)
    assert (node.size, node.mtime_ns) == (E, 111) and exts == held
    assert exts[0].dirty and exts[0].holder == 42 and not exts[0].hot
    assert meta.held() == [(f.ino, 42, 4096, "node-a")]
    assert sorted(gc_ids(meta)) == [5, 6]
    clean = {0: Extent(flags=HOT, obj_id=9, length=E, checksum=3).published(42)}
    g = mkfile(meta, ROOT_INO, b"g")
    assert meta.publish([Published(f.ino, E, 112, 223, clean, 0),
                         Published(g.ino, 5, 1, 1, {}, 0)], 42, "node-a") == [True, True]
    assert meta.get_inode(g.ino).size == 5
    assert meta.file_view(f.ino)[1] == {0: Extent(obj_id=9, length=E, checksum=3)}
    assert meta.held() == []
    meta.unlink(ROOT_INO, b"f", never)
    assert meta.publish([Published(f.ino, 0, 1, 1, {}, 0)], 42, "node-a") == [False]  # gone
    assert err(meta.file_view, f.ino) == errno.ENOENT


def test_readdir_plus_lists_every_name_of_a_hard_link(meta):
    f = mkfile(meta, ROOT_INO, b"a")
    meta.link(f.ino, ROOT_INO, b"b")
    _n, _p, page = meta.readdir_plus(ROOT_INO, 0, 10, E)
    assert [(n, found[0].ino, found[0].nlink) for _c, n, found in page] == [
        (b"a", f.ino, 2), (b"b", f.ino, 2)]
