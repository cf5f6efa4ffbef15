#!/usr/bin/env python3
"""What one round of the uploader costs the daemon's event loop, by the size of the
upload backlog: the real index (tierfs/tier/cache.py) and uploader
(tierfs/tier/uploader.py), no bucket, no disk.

    python scripts/bench_upload_rounds.py [--extents 1000,10000,100000] [--reps 5]

--extents dirty extents are recorded in the index, as a checkpoint of that many
extents (4 MiB each by default: 100,000 are 400 GiB) leaves them while it is being
written. A round runs twice a second and after every finished upload. Timed per
backlog, medians over --reps runs, in ms:

- waiting: nothing is due yet (the writer is still writing: the usual case);
- all due: a full hot tier asks for every upload at once (only the choice of what
  to upload, no upload starts).

Run it against another checkout with that checkout first on PYTHONPATH.
"""
from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import trio

from tierfs.tier.cache import HotIndex
from tierfs.tier.uploader import Uploader

EXTENT = 4 << 20


def one_round(up: Uploader, now: float):
    if hasattr(up, "_select"):
        return up._select(now)
    return up._packs(up._due(now))  # before the queue


def timed_round(extents: int, all_due: bool) -> float:
    index = HotIndex()
    for i in range(extents):
        index.written((1 + i // 1024, i % 1024), EXTENT)
    engine = SimpleNamespace(index=index, E=EXTENT, meta=None)
    space = SimpleNamespace(need_upload=trio.Event())
    up = Uploader(engine, space, delay=5.0, parallel=8)
    if all_due:
        space.need_upload.set()
    t0 = time.perf_counter()
    one_round(up, time.monotonic())
    return (time.perf_counter() - t0) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--extents", default="1000,10000,100000")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    print(f"{'dirty extents':>14} {'waiting ms':>11} {'all due ms':>11}   "
          f"(medians of {args.reps})")
    for n in (int(x) for x in args.extents.split(",")):
        waiting = statistics.median(timed_round(n, False) for _ in range(args.reps))
        due = statistics.median(timed_round(n, True) for _ in range(args.reps))
        print(f"{n:>14,} {waiting:>11.3f} {due:>11.3f}")


if __name__ == "__main__":
    main()
