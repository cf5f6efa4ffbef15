#!/usr/bin/env python3
"""What opening and reading a small hot file costs, through the mount and through the
direct path: the reader's and the daemon's CPU time per file.

    python scripts/bench_direct_open.py --dir /mnt/tierfs/bench-open [--files 5000] [--reps 5]

--files files of 64 KiB are written below --dir (a directory on a tierfs mount) once
and read whole before the runs, so they are hot and in the page cache: what is measured
is the cost of the open path, not of the disk. Each run reads every file once, in one
process, one of three ways:

- mount: the builtin open(), through FUSE (open, read and release requests);
- open: tierfs.open (its size threshold for the mount, MOUNT_BELOW, set to 0): one
  control request per file, the descriptor of the hot extent file passed back;
- open_many: tierfs.open_many of 64 files at a time: one control request per 64 files.

--extra-mounts N mounts N small tmpfs filesystems (under a temporary directory,
unmounted at the end; needs root) before the runs, as on a container host with many
mounts: placing each path of a batch on its mount must not cost more per mount.

The ways alternate run by run. Printed per way, medians over --reps runs: files per
second, and the reader's and the daemon's CPU time per file in µs (all their threads,
user and system).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import tierfs
import tierfs.direct
from bench_read_sizes import cpu_seconds  # scripts/, beside this one
from bench_workers import read_buffer, read_whole
from tierfs.client import daemon_info

SIZE = 64 << 10
BATCH = 64
WAYS = ("mount", "open", "open_many")


def read_all(paths: list[str], way: str) -> int:
    buf = read_buffer()
    if way != "open_many":
        opener = open if way == "mount" else tierfs.open
        return sum(read_whole(path, buf, opener) for path in paths)
    total = 0
    for at in range(0, len(paths), BATCH):
        for f in tierfs.open_many(paths[at:at + BATCH], buffering=0):
            with f:
                while n := f.readinto(buf):
                    total += n
    return total


def run(paths: list[str], way: str, pid: int) -> tuple[float, float, float]:
    """(files/s, reader µs/file, daemon µs/file)"""
    daemon0, reader0 = cpu_seconds(pid), time.process_time()
    t0 = time.perf_counter()
    got = read_all(paths, way)
    wall = time.perf_counter() - t0
    reader, daemon = time.process_time() - reader0, cpu_seconds(pid) - daemon0
    if got != SIZE * len(paths):
        raise RuntimeError(f"{way}: read {got} bytes, expected {SIZE * len(paths)}")
    n = len(paths)
    return n / wall, 1e6 * reader / n, 1e6 * daemon / n


@contextlib.contextmanager
def extra_mounts(n: int):
    """n tmpfs mounts for the runs' length, all unmounted at the end."""
    base = tempfile.mkdtemp(prefix="tierfs-bench-mounts-")
    mounted = []
    try:
        for k in range(n):
            point = os.path.join(base, f"m{k:04d}")
            os.mkdir(point)
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tierfs-bench", point],
                           check=True)
            mounted.append(point)
        yield
    finally:
        for point in reversed(mounted):
            subprocess.run(["umount", point], check=False)
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="a directory on a tierfs mount")
    ap.add_argument("--files", type=int, default=5000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--extra-mounts", type=int, default=0,
                    help="tmpfs mounts made for the runs (default 0)")
    args = ap.parse_args()
    tierfs.direct.MOUNT_BELOW = 0  # tierfs.open takes the direct path at any size
    os.makedirs(args.dir, exist_ok=True)
    data = os.urandom(SIZE)
    paths = [os.path.join(args.dir, f"{i // 1000:03d}", f"{i:06d}.bin")
             for i in range(args.files)]
    for path in paths:
        if not os.path.exists(path) or os.path.getsize(path) != SIZE:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
    pid = int(daemon_info(args.dir)["pid"])
    read_all(paths, "mount")  # hot, verified and in the page cache
    results: dict[str, list[tuple[float, float, float]]] = {w: [] for w in WAYS}
    with extra_mounts(args.extra_mounts):
        with open("/proc/self/mountinfo") as f:
            mounts = sum(1 for _line in f)
        for rep in range(args.reps):
            for way in WAYS[rep % len(WAYS):] + WAYS[:rep % len(WAYS)]:
                results[way].append(run(paths, way, pid))
    print(f"{'way':10} {'files/s':>9} {'reader µs/file':>15} {'daemon µs/file':>15}"
          f"   (medians of {args.reps}, {args.files} files of 64 KiB, {mounts} mounts)")
    for way in WAYS:
        rate, reader, daemon = (statistics.median(r[k] for r in results[way])
                                for k in range(3))
        print(f"{way:10} {rate:9,.0f} {reader:15.1f} {daemon:15.1f}")


if __name__ == "__main__":
    main()
