#!/usr/bin/env python3
"""What the S3 store's GET costs the daemon's process: CPU (and the part of it in the
kernel) and page faults per GET of 64 KiB, 1 MiB and 4 MiB objects from a moto server,
then per ranged GET of 64 KiB, 1 MiB and 8 MiB of a 64 MiB pack from a moto server
that reads only the range (tests/moto_ranges.py), with the daemon's allocator settings
(tierfs/malloc.py) and switch interval.

    python scripts/bench_s3_get.py [--gets 100] [--reps 3] [--boto3]

Last, the wait for the interpreter lock that ranged GETs of 8 MiB (a cold epoch's wide
GETs) cause the event loop: 4 threads make them while the main thread, as the event
loop does, makes one short system call after another, each letting the lock go; the
table gives, per GET, the main thread's time in calls that took over 50 µs (its
waits to get the lock back).

--boto3: every GET through boto3's get_object (as before presigned GETs). Run it with
two versions first on PYTHONPATH, one after the other, to compare how they read a
GET's body (S3Store._read_body). Medians over --reps. moto's server closes each
connection after its answer, so every GET here also opens one.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# This checkout's tierfs, but for one put first on PYTHONPATH to compare versions.
if os.environ.get("PYTHONPATH"):
    sys.path.append(ROOT)
else:
    sys.path.insert(0, ROOT)

from tests.moto_server import make_bucket, moto_server, s3_env  # noqa: E402
from tierfs.cold import open_store  # noqa: E402
from tierfs.malloc import return_large_blocks  # noqa: E402
from tierfs.runtime import SWITCH_INTERVAL_S  # noqa: E402

KiB, MiB = 1024, 1024 * 1024
BUCKET = "bench-s3-get"
PACK = 64 * MiB


def pack_offset(i: int, size: int) -> int:
    """Where the i-th ranged GET of `size` bytes starts: spread over the pack."""
    return (i * 7919 * 64 * KiB) % (PACK - size)


def measure(store, key: str, size: int, gets: int, ranged: bool = False
            ) -> tuple[float, float, float, float]:
    """(CPU µs, of it kernel µs, page faults, wall ms) per GET (`ranged`: of `size`
    bytes of a PACK-byte object, each at another offset)."""
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for i in range(gets):
        offset = pack_offset(i, size) if ranged else 0
        got = store.get(key, offset, size) if ranged else store.get(key)
        if len(got) != size:
            raise SystemExit(f"GET of {key} returned the wrong size")
    r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    user, kernel = r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime
    return ((user + kernel) / gets * 1e6, kernel / gets * 1e6,
            (r1.ru_minflt - r0.ru_minflt) / gets, (t1 - t0) / gets * 1e3)


def table(store, rows: list[tuple[str, str, int, bool]], gets: int, reps: int) -> None:
    print(f"{'GET of':>20}  {'CPU us':>8}  {'kernel us':>9}  {'faults':>6}  {'wall ms':>7}")
    for label, key, size, ranged in rows:
        runs = [measure(store, key, size, gets, ranged) for _ in range(reps)]
        cpu, kernel, faults, wall = (statistics.median(col) for col in zip(*runs))
        print(f"{label:>20}  {cpu:>8.0f}  {kernel:>9.0f}  {faults:>6.0f}  {wall:>7.2f}")


def lock_waits(store, gets: int, size: int = 8 * MiB, threads: int = 4) -> float:
    """ms per GET that the main thread, making short system calls meanwhile, waited
    for the interpreter lock while `threads` threads made `gets` ranged GETs."""
    offsets = [pack_offset(i, size) for i in range(gets)]
    lock, running = threading.Lock(), [threads]

    def work() -> None:
        try:
            while True:
                with lock:
                    if not offsets:
                        return
                    offset = offsets.pop()
                store.get("pack", offset, size)
        finally:
            with lock:
                running[0] -= 1

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for w in workers:
        w.start()
    waited = 0.0
    while running[0]:
        t0 = time.perf_counter()
        os.getppid()  # lets the lock go and takes it back, as the loop's calls do
        took = time.perf_counter() - t0
        if took > 50e-6:
            waited += took
    for w in workers:
        w.join()
    return waited / gets * 1e3


def open_bench_store(endpoint: str, boto3_only: bool):
    store = open_store(f"s3://{BUCKET}/bench", s3_endpoint=endpoint, s3_path_style=True)
    if boto3_only:
        store.presigned_gets = False
    return store


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gets", type=int, default=100, help="GETs per size and rep (default 100)")
    p.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    p.add_argument("--boto3", action="store_true", help="every GET through boto3's get_object")
    args = p.parse_args()
    return_large_blocks()
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # the daemon's
    sizes = (64 * KiB, MiB, 4 * MiB)
    with moto_server() as endpoint:
        os.environ.update(s3_env(endpoint))
        make_bucket(endpoint, BUCKET)
        store = open_bench_store(endpoint, args.boto3)
        for size in sizes:
            store.put(f"o{size}", os.urandom(size))
            for _ in range(5):
                store.get(f"o{size}")  # connections and allocator warm
        table(store, [(f"{size // KiB} KiB", f"o{size}", size, False) for size in sizes],
              args.gets, args.reps)
    with moto_server(ranges=True) as endpoint:
        os.environ.update(s3_env(endpoint))
        make_bucket(endpoint, BUCKET)
        store = open_bench_store(endpoint, args.boto3)
        store.put("pack", os.urandom(PACK))
        for _ in range(5):
            store.get("pack", 0, MiB)
        table(store, [(f"{size // KiB} KiB of a pack", "pack", size, True)
                      for size in (64 * KiB, MiB, 8 * MiB)], args.gets, args.reps)
        waits = [lock_waits(store, args.gets) for _ in range(args.reps)]
        print(f"8 MiB GETs in 4 threads: the event loop's wait for the interpreter lock "
              f"{statistics.median(waits):.2f} ms per GET (median of {args.reps})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
