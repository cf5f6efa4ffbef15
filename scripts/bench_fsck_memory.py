#!/usr/bin/env python3
"""What `tierfs fsck` costs in memory: the peak Python heap (tracemalloc) of a check of
a cache dir's namespace of small files (one extent in a pack, 1,000 files a directory,
packs in a file:// bucket), next to its LMDB bytes, and how long the check took.

    python scripts/bench_fsck_memory.py [--files 200000]

Run it against another checkout with that checkout first on PYTHONPATH.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import tracemalloc

from bench_checkpoint_memory import build  # scripts/, beside this one
from tierfs.cold.file import FileStore
from tierfs.hot.store import HotStore
from tierfs.meta import MetaStore
from tierfs.meta.schema import Superblock
from tierfs.tier.fsck import Fsck

FILE_SIZE = 1000
E = 4 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=200_000)
    ap.add_argument("--dir", default=None, help="where to work (default: a temp dir)")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="tierfs-bench-fsck-", dir=args.dir)
    try:
        meta = MetaStore(os.path.join(work, "meta"))
        meta.format(Superblock(fs_id="bench", extent_size=E), 0, 0)
        cold = FileStore(os.path.join(work, "bucket"))
        cold.check()
        build(meta, args.files, FILE_SIZE, cold)
        lmdb = os.path.getsize(os.path.join(work, "meta", "data.mdb"))
        hot = HotStore(os.path.join(work, "hot"))
        tracemalloc.start()
        try:
            start = time.monotonic()
            findings = Fsck(meta, hot, cold, E, repair=False, verify_data=False).run()
            took = time.monotonic() - start
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        meta.close()
        mib = 1 << 20
        print(f"{args.files:,} small files: {lmdb / mib:.1f} MiB of LMDB, "
              f"{len(findings)} findings, checked in {took:.1f} s (under tracemalloc)")
        print(f"peak Python heap of fsck: {peak / mib:.1f} MiB, "
              f"{peak / args.files:.0f} bytes a file")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
