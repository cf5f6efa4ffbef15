"""fsck on a real LMDB, a real hot tier and a file:// bucket: what it finds in a damaged
namespace, and what it holds in memory on a large one."""
from __future__ import annotations

import os
import stat
import tracemalloc

from tierfs.cold.file import FileStore
from tierfs.hot.store import HotStore
from tierfs.meta import MetaStore
from tierfs.meta import schema as s
from tierfs.meta.schema import ROOT_INO, Extent, Ref, Superblock, object_name
from tierfs.tier.fsck import Fsck

E = 4 << 20
FILE = stat.S_IFREG | 0o644
DIR = stat.S_IFDIR | 0o755


def stack(tmp_path):
    meta = MetaStore(str(tmp_path / "meta"))
    meta.format(Superblock(fs_id="fsck", extent_size=E), 0, 0)
    cold = FileStore(str(tmp_path / "bucket"))
    cold.check()
    return meta, HotStore(str(tmp_path / "hot")), cold


def fsck(meta, hot, cold, repair=False) -> list[str]:
    return [f.problem for f in Fsck(meta, hot, cold, E, repair=repair, verify_data=False).run()]


def test_fsck_finds_and_repairs_a_damaged_namespace(tmp_path):
    """Entries pointing nowhere, cookies without entries, wrong link counts, a directory
    naming the wrong parent and an unreachable inode, each found once and repaired."""
    meta, hot, cold = stack(tmp_path)
    try:
        a = meta.create_node(ROOT_INO, b"a", DIR, 0, 0).ino
        b = meta.create_node(ROOT_INO, b"b", DIR, 0, 0).ino
        meta.create_node(a, b"f1", FILE, 0, 0)
        f2 = meta.create_node(ROOT_INO, b"f2", FILE, 0, 0)
        f3 = meta.create_node(a, b"f3", FILE, 0, 0).ino
        f4 = meta.create_node(b, b"f4", FILE, 0, 0).ino
        meta.delete_raw([s.inode_key(f3)])        # an entry points to a missing inode
        meta.delete_raw([s.dentry_key(b, b"f4")])  # f4 is unreachable, its cookie stray
        f2.nlink = 5
        meta.put_inode(f2)                         # a wrong link count
        node = meta.get_inode(b)
        node.parent = a
        meta.put_inode(node)                       # a directory naming the wrong parent
        meta.sync()
        found = fsck(meta, hot, cold)
        assert found == [
            f"directory {b} names {a} as parent, but lives in {ROOT_INO}",
            f"entry b'f3' in directory {a} points to missing inode {f3}",
            f"readdir cookie 4 of directory {a} has no entry",  # f3's, the second in a
            f"readdir cookie 3 of directory {b} has no entry",  # f4's
            f"inode {f2.ino} has link count 5, expected 1",
            f"inode {f4} is not reachable from the root",
        ]
        # Repairing, the entry's cookie goes with the entry: it is not found again.
        assert fsck(meta, hot, cold, repair=True) == found[:2] + found[3:]
        assert fsck(meta, hot, cold) == []
        lost_found = meta.lookup(ROOT_INO, b"lost+found")
        assert meta.lookup(lost_found, f"inode-{f4}".encode()) == f4
    finally:
        meta.close()


def test_fsck_holds_no_whole_copy_of_the_namespace_in_memory(tmp_path):
    """A namespace of millions of small files has an LMDB file of gigabytes (about 500
    bytes a file: scripts/bench_fsck_memory.py), far more than a node can spare for
    a check: fsck walks it in key order, holding bounded pieces of it."""
    FILES, PER_DIR = 50_000, 1000
    meta, hot, cold = stack(tmp_path)
    try:
        for first in range(0, FILES, PER_DIR):
            folder = meta.create_node(ROOT_INO, b"d%05d" % first, DIR, 0, 0).ino
            pack = meta.next_object_id()
            extents, refs = {}, []
            for i in range(PER_DIR):
                node = meta.create_node(folder, b"f%05d" % i, FILE, 0, 0)
                node.size = 100
                meta.put_inode(node)
                extents[(node.ino, 0)] = Extent(0, 100, 1, pack, i * 100, 100)
                refs.append(Ref(i * 100, 100, node.ino, 0))
            meta.update(None, extents, packs={pack: (PER_DIR * 100, refs)})
            cold.put(object_name(pack), b"\0" * (PER_DIR * 100))
        meta.sync()
        size = os.path.getsize(tmp_path / "meta" / "data.mdb")
        tracemalloc.start()
        try:
            found = fsck(meta, hot, cold)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert found == []
        assert peak < size / 4, f"fsck of {size} bytes of metadata took {peak} bytes of memory"
    finally:
        meta.close()
