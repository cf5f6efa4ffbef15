#!/usr/bin/env python3
"""Where a reader's buffer starts, and what a read into a new bytes object costs.

    python scripts/bench_read_buffers.py --local-dir /var/tmp/x [--dir /mnt/tierfs/x] [--reps 5]

Everything is read warm (from the page cache), in this one process:

1. copy: a 256 MiB file below --local-dir read with preadv into a 1 MiB buffer that
   starts OFFSET bytes past a page boundary; MiB/s per offset. A fresh bytearray of
   1 MiB starts 16 bytes past one (glibc's header of an mmapped block).
2. small files: 4,000 files of 64 KiB below --local-dir, each opened and read with
   readinto (buffering=0) into a buffer on a page boundary and 16 bytes past one;
   µs per file.
3. read(n), with --dir (a directory on a tierfs mount): the same 256 MiB file there,
   read with read(n) of 1 MiB and of 8 MiB at a time, unbuffered, through open() of
   the local file and tierfs.open() of the one on the mount; MiB/s and the ratio.

Printed: medians over --reps runs.
"""
from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time

from bench_workers import read_whole  # scripts/, beside this one

MiB = 1 << 20
BIG = 256 * MiB
SMALL, SMALL_FILES = 64 << 10, 4000
OFFSETS = (0, 8, 16, 24, 32, 48, 64, 2048)


def make_file(path: str, size: int) -> None:
    """`size` random bytes (a multiple of 1 MiB, or less than 1 MiB) at `path`, once."""
    if os.path.exists(path) and os.path.getsize(path) == size:
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    block = os.urandom(min(size, MiB))
    with open(path, "wb") as f:
        for _ in range(size // len(block)):
            f.write(block)


def copy_rate(path: str, view: memoryview) -> float:
    fd = os.open(path, os.O_RDONLY)
    try:
        t0, done = time.perf_counter(), 0
        while n := os.preadv(fd, [view], done):
            done += n
        return done / MiB / (time.perf_counter() - t0)
    finally:
        os.close(fd)


def small_cost(paths: list[str], view: memoryview) -> float:
    t0 = time.perf_counter()
    for path in paths:
        read_whole(path, view)
    return (time.perf_counter() - t0) / len(paths) * 1e6


def read_n_rate(path: str, opener, n: int) -> float:
    t0, done = time.perf_counter(), 0
    with opener(path, "rb", buffering=0) as f:
        while data := f.read(n):
            done += len(data)
    return done / MiB / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--local-dir", required=True, help="a plain directory")
    ap.add_argument("--dir", help="a directory on a tierfs mount (for part 3)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    big = os.path.join(args.local_dir, "big.bin")
    make_file(big, BIG)
    smalls = [os.path.join(args.local_dir, "small", f"{i:05d}") for i in range(SMALL_FILES)]
    for path in smalls:
        make_file(path, SMALL)
    area = mmap.mmap(-1, 2 * MiB)  # starts on a page boundary
    views = {off: memoryview(area)[off:off + MiB] for off in OFFSETS}
    copy_rate(big, views[0])  # into the page cache
    small_cost(smalls, views[0])

    copies = {off: [] for off in OFFSETS}
    smalls_us = {0: [], 16: []}
    for _ in range(args.reps):
        for off in OFFSETS:
            copies[off].append(copy_rate(big, views[off]))
        for off in smalls_us:
            smalls_us[off].append(small_cost(smalls, views[off]))
    print("1. copy from the page cache into a 1 MiB buffer, by where it starts")
    for off in OFFSETS:
        print(f"   {off:5d} bytes past a page   {statistics.median(copies[off]):8,.0f} MiB/s")
    print("2. 64 KiB files, open + readinto + close")
    for off, got in smalls_us.items():
        print(f"   buffer {off:2d} bytes past a page   {statistics.median(got):6.1f} µs/file")

    if args.dir:
        import tierfs
        mounted = os.path.join(args.dir, "big.bin")
        make_file(mounted, BIG)
        read_n_rate(mounted, tierfs.open, 8 * MiB)  # hot and in the page cache
        print("3. read(n), unbuffered, warm: local open() against tierfs.open()")
        for n in (MiB, 8 * MiB):
            local, direct = [], []
            for _ in range(args.reps):
                local.append(read_n_rate(big, open, n))
                direct.append(read_n_rate(mounted, tierfs.open, n))
            lo, di = statistics.median(local), statistics.median(direct)
            print(f"   read({n // MiB} MiB)   local {lo:8,.0f}   tierfs.open {di:8,.0f} MiB/s"
                  f"   ratio {di / lo:.2f}")


if __name__ == "__main__":
    main()
