#!/usr/bin/env python3
"""What a metadata checkpoint and a recovery from it cost in memory: the LMDB bytes per
small file (one extent in a pack, 1,000 files a directory), and the peak Python heap
(tracemalloc) while a checkpoint is copied and put into a file:// bucket, and while a
new cache dir recovers from it.

    python scripts/bench_checkpoint_memory.py [--files 200000]

Run it against another checkout with that checkout first on PYTHONPATH.
"""
from __future__ import annotations

import argparse
import os
import shutil
import stat
import tempfile
import tracemalloc

from tierfs.cold.file import FileStore
from tierfs.meta import MetaStore
from tierfs.meta.schema import ROOT_INO, Extent, Ref, Superblock, object_name
from tierfs.tier import checkpoint
from tierfs.tier.recover import recover

PER_DIR = 1000
FILE_SIZE = 100_000


def build(meta: MetaStore, files: int, file_size: int = FILE_SIZE, cold=None) -> None:
    """`files` small files, PER_DIR a directory, each one extent in its directory's
    pack; with `cold`, the files have their size and the packs are put there too."""
    for first in range(0, files, PER_DIR):
        folder = meta.create_node(ROOT_INO, b"d%07d" % first, stat.S_IFDIR | 0o755, 0, 0)
        pack = meta.next_object_id()
        extents, refs = {}, []
        for i in range(min(PER_DIR, files - first)):
            node = meta.create_node(folder.ino, b"file-%07d.jpg" % (first + i),
                                    stat.S_IFREG | 0o644, 0, 0)
            if cold is not None:
                node.size = file_size
                meta.put_inode(node)
            extents[(node.ino, 0)] = Extent(0, file_size, 1, pack, i * file_size, file_size)
            refs.append(Ref(i * file_size, file_size, node.ino, 0))
        meta.update(None, extents, packs={pack: (len(refs) * file_size, refs)})
        if cold is not None:
            cold.put(object_name(pack), b"\0" * (len(refs) * file_size))
    meta.sync()


def put(meta: MetaStore, cold, workdir: str) -> None:
    """A checkpoint's copy and PUT, as the daemon takes it (this checkout's way)."""
    if hasattr(checkpoint, "put_checkpoint"):
        copy = checkpoint.snapshot(meta, workdir)
        try:
            checkpoint.put_checkpoint(cold, 1, copy)
        finally:
            checkpoint.remove_copy(copy)
    else:  # a checkout that holds the copy in memory
        db = checkpoint.snapshot(meta, workdir)
        cold.put(checkpoint.checkpoint_name(1), checkpoint.pack(1, db))


def peak_of(fn, *args):
    tracemalloc.start()
    try:
        result = fn(*args)
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=200_000)
    ap.add_argument("--dir", default=None, help="where to work (default: a temp dir)")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="tierfs-bench-ckpt-", dir=args.dir)
    try:
        meta = MetaStore(os.path.join(work, "meta"))
        meta.format(Superblock(fs_id="bench", extent_size=4 << 20), 0, 0)
        build(meta, args.files)
        cold = FileStore(os.path.join(work, "bucket"))
        cold.check()
        _none, put_peak = peak_of(put, meta, cold, work)
        meta.close()
        size = cold.size(checkpoint.checkpoint_name(1))
        (recovered, _report), recover_peak = peak_of(recover, cold,
                                                    os.path.join(work, "recovered"))
        recovered.close()
        mib = 1 << 20
        print(f"{args.files:,} small files: checkpoint {size / mib:.1f} MiB, "
              f"{size / args.files:.0f} bytes a file")
        print(f"peak Python heap: checkpoint {put_peak / mib:.1f} MiB, "
              f"recovery {recover_peak / mib:.1f} MiB")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
