#!/usr/bin/env python3
"""Whole-file reads (`open(path, "rb").read()`) by file size: through a tierfs mount
with the builtin open(), and through tierfs.open (the direct path), with the page cache
dropped ("hot": the data on the hot tier's disk) and kept ("warm").

    python scripts/bench_read_sizes.py --dir /mnt/tierfs/bench-sizes [--reps 3] [--readers 1]
        [--cache-dir CACHE_DIR]

Files of 64 KiB to 16 MiB (16 MiB in all per size) are written below --dir (a
directory on a tierfs mount, created if missing) and uploaded first. Run as root:
"hot" drops the page cache (/proc/sys/vm/drop_caches). Each run reads every file of a
size once, split among --readers processes. tierfs.open reads files below
tierfs.direct.MOUNT_BELOW through the mount; here it is set to 0, so that the direct
path is measured at every size. With --cache-dir (the mount's), the hot tier's own
extent files of one-extent files are read too, with the builtin open(): the floor
for both paths. Printed: per size, the median over --reps runs of the wall time per
file in µs (with several readers: the run's time over its files), then the daemon's CPU
time per file during the warm runs (what each way costs the daemon).
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import subprocess
import time

import tierfs
from tierfs.client import daemon_info

SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
BYTES_PER_SIZE = 16 << 20


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def make_files(top: str) -> dict[int, list[str]]:
    files = {}
    for size in SIZES:
        d = os.path.join(top, str(size))
        os.makedirs(d, exist_ok=True)
        files[size] = [os.path.join(d, f"f{i}") for i in range(BYTES_PER_SIZE // size)]
        for path in files[size]:
            if not os.path.exists(path) or os.path.getsize(path) != size:
                with open(path, "wb") as f:
                    f.write(os.urandom(size))
    subprocess.run(["tierfs", "sync", "--wait", top], check=True, capture_output=True)
    return files


def hot_files(cache_dir: str, paths: list[str]) -> list[str] | None:
    """The hot extent files of `paths` (laid out as tierfs/hot/store.py does), or None
    if a file has more than one extent or is not hot."""
    out = []
    for path in paths:
        ino = os.stat(path).st_ino
        base = os.path.join(cache_dir, "hot", f"{ino & 0xff:02x}", f"{ino:x}")
        if os.path.exists(base + ".1") or not os.path.exists(base + ".0"):
            return None
        out.append(base + ".0")
    return out


def cpu_seconds(pid: int) -> float:
    """CPU time of all of a process's threads so far, in nanoseconds counted by the
    scheduler (/proc/PID/task/TID/schedstat; /proc/PID/stat counts 10 ms ticks)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except FileNotFoundError:
            pass  # a thread that ended meanwhile
    return total / 1e9


def read_all(paths: list[str], opener) -> None:
    for path in paths:
        with opener(path, "rb") as f:
            f.read()


def per_file_us(paths: list[str], opener, readers: int) -> float:
    t0 = time.perf_counter()
    if readers == 1:
        read_all(paths, opener)
    else:
        procs = [multiprocessing.Process(target=read_all, args=(paths[i::readers], opener))
                 for i in range(readers)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
            if p.exitcode:
                raise RuntimeError(f"a reader failed (exit code {p.exitcode})")
    return (time.perf_counter() - t0) / len(paths) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="a directory on a tierfs mount")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--readers", type=int, default=1, help="reader processes")
    ap.add_argument("--cache-dir", help="the mount's cache dir: read its hot files too")
    args = ap.parse_args()
    multiprocessing.set_start_method("fork")
    tierfs.direct.MOUNT_BELOW = 0
    top = os.path.abspath(args.dir)
    files = make_files(top)
    daemon = daemon_info(top)["pid"]
    daemon_us: dict[tuple[int, str], list[float]] = {}
    ways = [("mount", open), ("tierfs.open", tierfs.open)]
    if args.cache_dir:
        ways.append(("hot files", open))
    print(f"µs per file, {args.readers} reader(s), medians of {args.reps} (hot: page cache "
          f"dropped; warm: cached)")
    print(f"{'size':>9}" + "".join(f"{f'{name} {state}':>20}" for name, _ in ways
                                    for state in ("hot", "warm")))
    for size in SIZES:
        targets = {"mount": files[size], "tierfs.open": files[size]}
        if args.cache_dir:
            targets["hot files"] = hot_files(args.cache_dir, files[size])
        runs: dict[tuple[str, str], list[float]] = {}
        for _rep in range(args.reps):
            for name, opener in ways:  # alternating: the machine's mood hits each alike
                if targets[name] is None:
                    continue
                drop_caches()
                hot = per_file_us(targets[name], opener, args.readers)
                cpu = cpu_seconds(daemon)
                warm = per_file_us(targets[name], opener, args.readers)
                daemon_us.setdefault((size, name), []).append(
                    (cpu_seconds(daemon) - cpu) / len(targets[name]) * 1e6)
                runs.setdefault((name, "hot"), []).append(hot)
                runs.setdefault((name, "warm"), []).append(warm)
        print(f"{size >> 10:>6} KiB" + "".join(
            f"{statistics.median(runs[(name, state)]):>20.0f}" if (name, state) in runs
            else f"{'-':>20}" for name, _ in ways for state in ("hot", "warm")))
    print("daemon CPU µs per file in the warm runs (medians)")
    print(f"{'size':>9}" + "".join(f"{name:>20}" for name, _ in ways))
    for size in SIZES:
        print(f"{size >> 10:>6} KiB" + "".join(
            f"{statistics.median(daemon_us[(size, name)]):>20.1f}" if (size, name) in daemon_us
            else f"{'-':>20}" for name, _ in ways))


if __name__ == "__main__":
    main()
