#!/usr/bin/env python3
"""What a page the kernel has to find for the page cache costs, on this machine: the same
buffered write of --mib MiB into fresh pages, into pages freed a moment ago, and over pages
already cached.

    python scripts/bench_fresh_pages.py [--mib 512] [--reps 3] [--idle 15] [--dir /var/tmp]

Per rep: drop the page cache (root) and wait --idle seconds, then write a new file with
1 MiB writes ("first touch": pages free for that long), truncate it and write it again
("pages just freed"), then write over it in place ("cached pages"). No fsync: the figure
is the copy into the page cache. On a virtual machine whose host takes back the memory
its guest leaves free (virtio-balloon free page reporting), the first touch of such a
page costs the host's work too. A write through the mount lands in two page caches (the
mount's, then the hot file's in the daemon), so tierfs pays that twice per byte.
Printed: MiB/s per way, the runs and their median.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from bench_read_sizes import drop_caches  # scripts/, beside this one

MiB = 1 << 20


def write(path: str, mib: int, block: bytes, flags: int) -> float:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o600)
    try:
        t0 = time.perf_counter()
        for _ in range(mib):
            os.write(fd, block)
        return mib / (time.perf_counter() - t0)
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--idle", type=float, default=15.0,
                    help="seconds the dropped pages stay free before the first write")
    ap.add_argument("--dir", default="/var/tmp", help="a directory on the disk to test")
    args = ap.parse_args()
    block = os.urandom(MiB)
    runs: dict[str, list[float]] = {"first touch": [], "pages just freed": [],
                                    "cached pages": []}
    fd, path = tempfile.mkstemp(prefix="tierfs-bench-pages-", dir=args.dir)
    os.close(fd)
    try:
        for _rep in range(args.reps):
            os.unlink(path)
            drop_caches()
            time.sleep(args.idle)
            runs["first touch"].append(write(path, args.mib, block, os.O_TRUNC))
            runs["pages just freed"].append(write(path, args.mib, block, os.O_TRUNC))
            runs["cached pages"].append(write(path, args.mib, block, 0))
    finally:
        os.unlink(path)
    print(f"{args.mib} MiB in 1 MiB writes to {args.dir}, MiB/s, median of {args.reps} "
          f"(first touch after {args.idle:g} s free)")
    for way, rates in runs.items():
        print(f"{way:<18} {statistics.median(rates):8.0f}   runs: "
              + "  ".join(f"{r:.0f}" for r in rates))


if __name__ == "__main__":
    main()
