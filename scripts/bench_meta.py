#!/usr/bin/env python3
"""Metadata operation latency of the store on each engine, side by side in one run.

    python scripts/bench_meta.py [--reps N] [--ops N]

Runs the same operations on MetaStore over LMDB (a temp dir) and over PostgreSQL
(a server this script starts on a private socket, as the tests do), single-threaded,
and prints for each the median over --reps runs of the mean latency per operation:
  getattr     get_inode of an existing file
  lookup      lookup of an existing name
  create      create_node of a new file
  readdir 1k  readdir of a directory of 1,000 entries, in pages of 1,000
next to JuiceFS's published figures for its PostgreSQL engine (getattr 350 us,
lookup 375 us, create 844 us, readdir 1k 18.4 ms). These are store calls, without
FUSE: the daemon adds its request cost (docs/architecture.md, Round trips).
"""
from __future__ import annotations

import argparse
import os
import statistics
import stat
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.pg_server import pg_server  # noqa: E402
from tierfs.meta import MetaStore  # noqa: E402
from tierfs.meta.schema import ROOT_INO, Superblock  # noqa: E402

REG = stat.S_IFREG | 0o644
DIR = stat.S_IFDIR | 0o755
JUICEFS_POSTGRES_US = {"getattr": 350, "lookup": 375, "create": 844, "readdir 1k": 18400}


def one_run(location: str, ops: int) -> dict[str, float]:
    """Mean seconds per operation, for each operation."""
    meta = MetaStore(location, map_size=1 << 30)
    try:
        meta.format(Superblock(fs_id="bench", extent_size=4 << 20), uid=0, gid=0)
        top = meta.create_node(ROOT_INO, b"top", DIR, 0, 0).ino
        out = {}
        t0 = time.perf_counter()
        made = [meta.create_node(top, f"f{i}".encode(), REG, 0, 0) for i in range(ops)]
        out["create"] = (time.perf_counter() - t0) / ops
        t0 = time.perf_counter()
        for node in made:
            meta.get_inode(node.ino)
        out["getattr"] = (time.perf_counter() - t0) / ops
        t0 = time.perf_counter()
        for i in range(ops):
            meta.lookup(top, f"f{i}".encode())
        out["lookup"] = (time.perf_counter() - t0) / ops
        big = meta.create_node(ROOT_INO, b"big", DIR, 0, 0).ino
        for i in range(1000):
            meta.create_node(big, f"entry-{i:04d}".encode(), REG, 0, 0)
        rounds = max(1, ops // 100)
        t0 = time.perf_counter()
        for _ in range(rounds):
            # readdirplus as FUSE asks: the page of entries, then each entry's attributes
            entries = meta.readdir(big, 0, limit=1000)
            meta.get_inodes([ino for _c, _n, ino in entries])
        out["readdir 1k"] = (time.perf_counter() - t0) / rounds
        assert len(entries) == 1000
        return out
    finally:
        meta.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ops", type=int, default=500, help="operations per kind and run")
    args = ap.parse_args()
    results: dict[str, list[dict[str, float]]] = {"lmdb": [], "postgresql": []}
    with pg_server() as server, tempfile.TemporaryDirectory(prefix="bench-meta-") as tmp:
        for rep in range(args.reps):  # interleaved, so both see the same machine
            results["lmdb"].append(one_run(os.path.join(tmp, f"lmdb-{rep}"), args.ops))
            results["postgresql"].append(one_run(server.new_schema(), args.ops))
    print(f"medians of {args.reps} runs, {args.ops} operations each, mean latency per operation")
    print(f"{'operation':<12} {'LMDB':>10} {'PostgreSQL':>12} {'JuiceFS PG':>12}")
    for op in ("getattr", "lookup", "create", "readdir 1k"):
        row = [statistics.median(r[op] for r in results[engine]) * 1e6
               for engine in ("lmdb", "postgresql")]
        print(f"{op:<12} {row[0]:>8.1f}us {row[1]:>10.1f}us {JUICEFS_POSTGRES_US[op]:>10}us")


if __name__ == "__main__":
    main()
