#!/usr/bin/env python3
"""The first and second reads of a large hot file after a remount, as the first two
epochs after a node restarts: through tierfs.open and through the mount, beside a
local file on the same disk.

    python scripts/bench_after_remount.py [--dir /var/tmp] [--mib 512] [--reps 5]

A filesystem is made below --dir (a file:// bucket, a cache dir, a mount point), one
file of --mib MiB is written to it and uploaded, and a copy is written beside it.
Each run, for each way in turn: unmount, drop the page cache, mount again, read the
file whole in 1 MiB reads (first: from the disk, each extent checked against its
checksum on the way, as after every mount), then read it again (second: from the
page cache). The local file is read the same way after the page cache is dropped.
Printed: median MiB/s over --reps runs, and the ratio to the local file. Run as root.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import tierfs
from bench_read_sizes import drop_caches  # scripts/, beside this one
from bench_workers import read_buffer, read_whole

MiB = 1 << 20
WAYS = ("local", "tierfs.open", "mount")


def read_rate(path: str, opener) -> float:
    """MiB/s of one read of the whole file in 1 MiB reads."""
    t0 = time.perf_counter()
    total = read_whole(path, read_buffer(), opener)
    return total / MiB / (time.perf_counter() - t0)


def tierfs_cli(*args: str) -> None:
    subprocess.run(["tierfs", *args], check=True, capture_output=True, timeout=300)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    top = tempfile.mkdtemp(prefix="tierfs-remount-", dir=args.dir)
    bucket, cache, mnt = (os.path.join(top, n) for n in ("bucket", "cache", "mnt"))
    os.makedirs(mnt)
    mount = ["mount", f"file://{bucket}", mnt, "--cache-dir", cache]
    local, on_mount = os.path.join(top, "local.bin"), os.path.join(mnt, "big.bin")
    tierfs_cli(*mount)
    try:
        data = os.urandom(MiB)
        for path in (local, on_mount):
            with open(path, "wb") as f:
                for _ in range(args.mib):
                    f.write(data)
        tierfs_cli("sync", mnt, "--wait")
        results: dict[str, list[tuple[float, float]]] = {w: [] for w in WAYS}
        for _rep in range(args.reps):
            for way in WAYS:
                if way == "local":
                    drop_caches()
                    path, opener = local, open
                else:
                    tierfs_cli("umount", mnt)
                    drop_caches()
                    tierfs_cli(*mount)
                    path, opener = on_mount, tierfs.open if way == "tierfs.open" else open
                results[way].append((read_rate(path, opener), read_rate(path, opener)))
    finally:
        subprocess.run(["tierfs", "umount", mnt], capture_output=True, timeout=300)
        shutil.rmtree(top, ignore_errors=True)
    first = {w: statistics.median(r[0] for r in results[w]) for w in WAYS}
    second = {w: statistics.median(r[1] for r in results[w]) for w in WAYS}
    print(f"{'way':12} {'first MiB/s':>12} {'ratio':>6} {'second MiB/s':>13} {'ratio':>6}"
          f"   (medians of {args.reps}, {args.mib} MiB file)")
    for way in WAYS:
        print(f"{way:12} {first[way]:12,.0f} {first[way] / first['local']:6.2f}"
              f" {second[way]:13,.0f} {second[way] / second['local']:6.2f}")


if __name__ == "__main__":
    main()
