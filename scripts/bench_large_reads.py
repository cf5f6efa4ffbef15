#!/usr/bin/env python3
"""Large reads of a checkpoint, as `torch.load` makes them: through tierfs.open with
the extent files of each read read at once (tierfs/read_pool.py) and one after
another, beside a local file on the same disk and the builtin open() on the mount.

    python scripts/bench_large_reads.py --dir /mnt/tierfs/bench-large --local-dir /var/tmp/x
        [--reps 7] [--record-mib 16] [--records 16] [--shuffle]

A file of --records records is written below --dir (a directory on a tierfs mount)
and below --local-dir (a plain directory on the same disk), then uploaded. Each
record is a 64-byte header and --record-mib MiB of data; a run reads the header at
the end of the file, then every record: seek, read its header, read its data in one
read (torch.load reads a zip checkpoint so: one read per tensor). Run as root: every
run drops the page cache first ("hot": from the disk). The ways alternate run by
run, so the machine's mood hits each alike. Right after, the same reads run again
with the pages cached ("warm"): how fast the page cache serves what the first run
left in it. --shuffle reads the records in a random order (a seek before each, as a
loader of a few tensors or random shards does). Printed: the median MiB/s of each
way over --reps runs, and its ratio to the local file.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import time

import tierfs
from bench_read_sizes import drop_caches  # scripts/, beside this one
from bench_workers import read_buffer
from tierfs import read_pool

HEADER = 64
MiB = 1 << 20


def write_checkpoint(path: str, records: int, record: int) -> None:
    with open(path, "wb") as f:
        for _ in range(records):
            f.write(os.urandom(HEADER))
            f.write(os.urandom(record))
        f.write(os.urandom(HEADER))  # the "central directory" read first
        f.flush()
        os.fsync(f.fileno())


def read_checkpoint(path: str, opener, order: list[int], record: int) -> tuple[float, float]:
    """MiB/s of one run with the page cache dropped first, and of the same reads again."""
    buf = read_buffer(record)
    drop_caches()
    rates = []
    for _pass in ("hot", "warm"):
        t0 = time.perf_counter()
        with opener(path, "rb") as f:
            f.seek(-HEADER, os.SEEK_END)
            f.read(HEADER)
            for i in order:
                f.seek(i * (HEADER + record))
                f.read(HEADER)
                if f.readinto(buf) != record:
                    raise RuntimeError(f"short read of record {i} of {path}")
        rates.append(len(order) * record / MiB / (time.perf_counter() - t0))
    return rates[0], rates[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="a directory on a tierfs mount")
    ap.add_argument("--local-dir", required=True, help="a plain directory on the same disk")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--records", type=int, default=16)
    ap.add_argument("--record-mib", type=int, default=16)
    ap.add_argument("--shuffle", action="store_true", help="records in a random order")
    args = ap.parse_args()
    record = args.record_mib * MiB
    os.makedirs(args.dir, exist_ok=True)
    os.makedirs(args.local_dir, exist_ok=True)
    on_mount = os.path.join(args.dir, "checkpoint.bin")
    local = os.path.join(args.local_dir, "checkpoint.bin")
    for path in (on_mount, local):
        write_checkpoint(path, args.records, record)
    subprocess.run(["tierfs", "sync", "--wait", args.dir], check=True, capture_output=True)
    at_once = read_pool.PARALLEL_MIN
    ways = [("local file", local, open, at_once),
            ("mount, open()", on_mount, open, at_once),
            ("tierfs.open, one extent after another", on_mount, tierfs.open, 1 << 62),
            ("tierfs.open, extents at once", on_mount, tierfs.open, at_once)]
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name, *_ in ways}
    rng = random.Random(1)
    for _rep in range(args.reps):
        order = list(range(args.records))
        if args.shuffle:
            rng.shuffle(order)
        for name, path, opener, parallel_min in ways:
            read_pool.PARALLEL_MIN = parallel_min
            runs[name].append(read_checkpoint(path, opener, order, record))
    read_pool.PARALLEL_MIN = at_once
    print(f"{args.records} records of {args.record_mib} MiB"
          f"{' in a random order' if args.shuffle else ''}, medians of {args.reps}")
    print(f"{'way':40} {'pass':5} {'MiB/s':>8} {'ratio':>6}   runs")
    for k, label in enumerate(("hot", "warm")):
        local_rate = statistics.median(r[k] for r in runs["local file"])
        for name, *_ in ways:
            rate = statistics.median(r[k] for r in runs[name])
            print(f"{name:40} {label:5} {rate:8.0f} {rate / local_rate:6.2f}   "
                  + " ".join(f"{r[k]:.0f}" for r in runs[name]))


if __name__ == "__main__":
    main()
