#!/usr/bin/env python3
"""Small files and metadata on the two metadata engines, side by side in one run.

    python scripts/bench_shared.py [--files 20000] [--reps 3] [--readers 8]

Each repetition runs, in turn, on (a) a plain directory on the same disk, (b) a
tierfs mount with its namespace in LMDB and (c) a tierfs mount with its namespace
in PostgreSQL (--meta-url; a server this script starts on a Unix socket on the
same machine, fsync on), each new and on a file:// bucket on the same disk:
  W3 create   N files of 64 KiB in 100 directories, each opened, written, closed
  W3 read     all of them in random order by 8 reader processes, page cache dropped
              (hot: the data is on the NVMe hot tier)
  W4 stat     every file, with the kernel's caches dropped
  W4 ls -lR   the tree, caches dropped
  B read      (PostgreSQL) a second mount of the same filesystem reads every file: the
              data comes from the bucket, the namespace from the database
Prints the medians and the ratios to the plain directory. Timing only: no pass/fail.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.pg_server import pg_server  # noqa: E402

FILE_BYTES = 64 << 10
DIRS = 100


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def tierfs(*args) -> None:
    res = subprocess.run([sys.executable, "-m", "tierfs", *args], capture_output=True,
                         text=True, timeout=1800)
    if res.returncode:
        raise RuntimeError(f"tierfs {' '.join(args)}: {res.stderr.strip()}")


def paths_under(root: str, n: int) -> list[str]:
    return [os.path.join(root, "small", f"d{i % DIRS:03d}", f"f{i:06d}") for i in range(n)]


def create(paths: list[str]) -> float:
    data = os.urandom(FILE_BYTES)
    t0 = time.monotonic()
    for d in sorted({os.path.dirname(p) for p in paths}):
        os.makedirs(d)
    for p in paths:
        with open(p, "wb", buffering=0) as f:
            f.write(data)
    return len(paths) / (time.monotonic() - t0)


def _read_share(share: list[str]) -> int:
    got = 0
    for p in share:
        with open(p, "rb", buffering=0) as f:
            got += len(f.read())
    return got


def read_all(paths: list[str], readers: int, seed: int) -> float:
    order = list(paths)
    random.Random(seed).shuffle(order)
    shares = [order[i::readers] for i in range(readers)]
    with multiprocessing.get_context("fork").Pool(readers) as pool:
        t0 = time.monotonic()
        got = sum(pool.map(_read_share, shares))
        took = time.monotonic() - t0
    if got != len(paths) * FILE_BYTES:
        raise RuntimeError(f"read {got} bytes, expected {len(paths) * FILE_BYTES}")
    return len(paths) / took


def stat_all(paths: list[str]) -> float:
    drop_caches()
    t0 = time.monotonic()
    for p in paths:
        os.stat(p)
    return len(paths) / (time.monotonic() - t0)


def ls_lr(root: str, entries: int) -> float:
    drop_caches()
    t0 = time.monotonic()
    subprocess.run(["ls", "-lR", os.path.join(root, "small")], stdout=subprocess.DEVNULL,
                   check=True, env=dict(os.environ, LC_ALL="C"))
    return entries / (time.monotonic() - t0)


class Mount:
    def __init__(self, base: str, name: str, bucket: str, args=()):
        self.root = os.path.join(base, f"{name}-mnt")
        self.cache = os.path.join(base, f"{name}-cache")
        self.bucket, self.args = bucket, list(args)
        os.makedirs(self.root, exist_ok=True)

    def __enter__(self):
        tierfs("mount", self.bucket, self.root, "--cache-dir", self.cache, *self.args)
        return self

    def __exit__(self, *exc):
        tierfs("umount", self.root)


def one_target(kind: str, base: str, n: int, readers: int, seed: int, pg) -> dict:
    os.makedirs(base)
    if kind == "local":
        root = os.path.join(base, "local")
        return measure(root, n, readers, seed, None)
    bucket = f"file://{base}/bucket"
    args = ["--meta-url", pg.new_schema()] if kind == "postgres" else []
    with Mount(base, "a", bucket, args) as m:
        out = measure(m.root, n, readers, seed, m)
        if kind == "postgres":
            with Mount(base, "b", bucket, args) as b:
                drop_caches()
                out["b_read"] = read_all(paths_under(b.root, n), readers, seed + 1)
    return out


def measure(root: str, n: int, readers: int, seed: int, mount) -> dict:
    paths = paths_under(root, n)
    out = {"create": create(paths)}
    if mount is not None:
        tierfs("sync", "--wait", root)
    drop_caches()
    out["read"] = read_all(paths, readers, seed)
    out["stat"] = stat_all(paths)
    out["ls"] = ls_lr(root, n + DIRS + 1)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=20000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--readers", type=int, default=8)
    p.add_argument("--workdir", default=None, help="directory on the disk to test")
    args = p.parse_args()
    top = tempfile.mkdtemp(prefix="tierfs-bench-shared-", dir=args.workdir)
    kinds = ("local", "lmdb", "postgres")
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    try:
        with pg_server(durable=True) as pg:
            for rep in range(args.reps):
                for kind in kinds:
                    base = os.path.join(top, f"{kind}-{rep}")
                    runs[kind].append(one_target(kind, base, args.files, args.readers,
                                                 rep * 10, pg))
                    shutil.rmtree(base, ignore_errors=True)
                    print(f"rep {rep + 1}/{args.reps} {kind}: {runs[kind][-1]}", flush=True)
    finally:
        shutil.rmtree(top, ignore_errors=True)
    rows = (("W3 create", "create", "files/s"), ("W3 read hot, 8 readers", "read", "files/s"),
            ("W4 stat, caches cold", "stat", "ops/s"), ("W4 ls -lR, caches cold", "ls",
                                                         "entries/s"),
            ("W3 read on a 2nd node (bucket)", "b_read", "files/s"))
    med = {k: {key: statistics.median(r[key] for r in runs[k]) for key in runs[k][0]}
           for k in kinds}
    print(f"\n{args.files:,} files of 64 KiB, {args.reps} reps, medians; "
          f"ratios to the plain directory")
    print(f"{'row':32} {'unit':9} {'local':>8} {'LMDB':>8} {'ratio':>6} {'PG':>8} {'ratio':>6}")
    for name, key, unit in rows:
        local = med["local"].get(key)
        lm, pg = med["lmdb"].get(key), med["postgres"].get(key)

        def cell(x):
            return f"{x:8,.0f}" if x is not None else f"{'-':>8}"

        def ratio(x):
            return f"{x / local:6.2f}" if x is not None and local else f"{'-':>6}"
        print(f"{name:32} {unit:9} {cell(local)} {cell(lm)} {ratio(lm)} {cell(pg)} "
              f"{ratio(pg)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
