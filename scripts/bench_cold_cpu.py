#!/usr/bin/env python3
"""The daemon's CPU time per small file read hot, cold and cold with hints: what a cold
epoch costs the daemon beyond serving the reads.

    python scripts/bench_cold_cpu.py --dir /mnt/tierfs/bench-cold [--files 4000] [--reps 3]

--files files of 64 KiB are written below --dir (a directory on a tierfs mount whose
bucket holds them packed) and uploaded. Each run reads all of them once in a shuffled
order with 8 reader processes, a batch of 32 files after another per process as a
DataLoader's workers do, with the builtin open() through the mount:

- hot: the files on the hot tier, page cache dropped;
- cold: released first (`tierfs release -r`), so every byte comes from the bucket, with
  the mount's read-around;
- hinted: released, then the whole order sent with `tierfs.hint` first, as
  `tierfs.HintingSampler` does at the start of an epoch.

Run as root (the page cache is dropped before every run). The ways alternate run by
run. Printed per way, medians over --reps runs: the wall time of the read, the
daemon's CPU time per file (all its threads, from /proc/PID/task/*/schedstat), the
part of it spent in the kernel (/proc/PID/stat, in 10 ms ticks) and the whole
machine's busy CPU time per file (/proc/stat), in µs; and how long `tierfs release -r`
of the files took.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import statistics
import subprocess
import time

import tierfs
from bench_read_sizes import cpu_seconds, drop_caches  # scripts/, beside this one
from tierfs.client import daemon_info

SIZE = 64 << 10
RELEASE_S: list[float] = []  # how long each `tierfs release -r` of the files took
READERS = 8
BATCH = 32


def daemon_system_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[12]) / os.sysconf("SC_CLK_TCK")  # stime


def machine_busy_s() -> float:
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def read_batches(paths: list[str], worker: int) -> None:
    batches = [paths[i:i + BATCH] for i in range(0, len(paths), BATCH)]
    for batch in batches[worker::READERS]:
        for path in batch:
            with open(path, "rb") as f:
                if len(f.read()) != SIZE:
                    raise RuntimeError(f"short read of {path}")


def run(paths: list[str], top: str, way: str, pid: int, seed: int) -> tuple[float, ...]:
    order = list(paths)
    random.Random(seed).shuffle(order)
    if way != "hot":
        t0 = time.perf_counter()
        subprocess.run(["tierfs", "release", "-r", top], check=True, capture_output=True)
        RELEASE_S.append(time.perf_counter() - t0)
    drop_caches()
    cpu0, sys0, busy0 = cpu_seconds(pid), daemon_system_s(pid), machine_busy_s()
    t0 = time.perf_counter()
    if way == "hinted":
        tierfs.hint(order, replace=True)
    procs = [multiprocessing.Process(target=read_batches, args=(order, k))
             for k in range(READERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"a reader failed (exit code {p.exitcode})")
    wall = time.perf_counter() - t0
    n = len(paths)
    return (wall, (cpu_seconds(pid) - cpu0) / n * 1e6, (daemon_system_s(pid) - sys0) / n * 1e6,
            (machine_busy_s() - busy0) / n * 1e6)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="a directory on a tierfs mount")
    ap.add_argument("--files", type=int, default=4000)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    multiprocessing.set_start_method("fork")
    top = os.path.abspath(args.dir)
    os.makedirs(top, exist_ok=True)
    paths = [os.path.join(top, f"f{i:06d}") for i in range(args.files)]
    for path in paths:
        if not os.path.exists(path) or os.path.getsize(path) != SIZE:
            with open(path, "wb") as f:
                f.write(os.urandom(SIZE))
    subprocess.run(["tierfs", "sync", "--wait", top], check=True, capture_output=True)
    pid = daemon_info(top)["pid"]
    ways = ("hot", "cold", "hinted")
    runs: dict[str, list[tuple[float, ...]]] = {w: [] for w in ways}
    for rep in range(args.reps):
        for way in ways:
            runs[way].append(run(paths, top, way, pid, seed=rep))
    print(f"{args.files} files of 64 KiB, {READERS} readers, medians of {args.reps}")
    print(f"{'way':8} {'wall s':>8} {'daemon µs/file':>16} {'of it kernel':>13} "
          f"{'machine µs/file':>17}")
    for way in ways:
        wall, daemon, kernel, machine = (statistics.median(r[i] for r in runs[way])
                                         for i in range(4))
        print(f"{way:8} {wall:8.2f} {daemon:16.0f} {kernel:13.0f} {machine:17.0f}")
    print(f"tierfs release -r of the {args.files} files: {statistics.median(RELEASE_S):.2f} s "
          f"(median of {len(RELEASE_S)})")


if __name__ == "__main__":
    main()
