#!/usr/bin/env python3
"""What the S3 store's GET costs the daemon's process: CPU (and the part of it in the
kernel) and page faults per GET of 64 KiB, 1 MiB and 4 MiB objects from a moto server,
with the daemon's allocator settings (tierfs/malloc.py).

    python scripts/bench_s3_get.py [--gets 100] [--reps 3]

Run it with two versions first on PYTHONPATH, one after the other, to compare how
they read a GET's body (S3Store._read_body). Medians over --reps.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.moto_server import make_bucket, moto_server, s3_env  # noqa: E402
from tierfs.cold import open_store  # noqa: E402
from tierfs.malloc import return_large_blocks  # noqa: E402

KiB, MiB = 1024, 1024 * 1024
BUCKET = "bench-s3-get"


def measure(store, key: str, size: int, gets: int) -> tuple[float, float, float, float]:
    """(CPU µs, of it kernel µs, page faults, wall ms) per GET."""
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(gets):
        if len(store.get(key)) != size:
            raise SystemExit(f"GET of {key} returned the wrong size")
    r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    user, kernel = r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime
    return ((user + kernel) / gets * 1e6, kernel / gets * 1e6,
            (r1.ru_minflt - r0.ru_minflt) / gets, (t1 - t0) / gets * 1e3)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gets", type=int, default=100, help="GETs per size and rep (default 100)")
    p.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    args = p.parse_args()
    return_large_blocks()
    sizes = (64 * KiB, MiB, 4 * MiB)
    with moto_server() as endpoint:
        os.environ.update(s3_env(endpoint))
        make_bucket(endpoint, BUCKET)
        store = open_store(f"s3://{BUCKET}/bench", s3_endpoint=endpoint, s3_path_style=True)
        for size in sizes:
            store.put(f"o{size}", os.urandom(size))
            for _ in range(5):
                store.get(f"o{size}")  # connections and allocator warm
        print(f"{'GET of':>8}  {'CPU us':>8}  {'kernel us':>9}  {'faults':>6}  {'wall ms':>7}")
        for size in sizes:
            runs = [measure(store, f"o{size}", size, args.gets) for _ in range(args.reps)]
            cpu, kernel, faults, wall = (statistics.median(col) for col in zip(*runs))
            print(f"{size // KiB:>5} KiB  {cpu:>8.0f}  {kernel:>9.0f}  {faults:>6.0f}  {wall:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
