#!/usr/bin/env python3
"""Cold W6 epochs, repeated on one data set: where a cold training epoch waits.

    python scripts/bench_cold_epochs.py --workdir /var/tmp/cold-epochs --latency 0.02 --reps 2
    python scripts/bench_cold_epochs.py --workdir /var/tmp/cold-epochs --latency 0.05 --no-hint

The first run creates the data set (20,000 files of 64 KiB, as W6 at full size) in a
tierfs filesystem whose bucket is a file:// directory in the work dir, and keeps it
there, so that runs of different code (its checkout first on PYTHONPATH) or settings
compare on the same files. Each epoch releases the files' hot copies, waits until the
daemon has emptied them, drops the page cache, hints the epoch's order (unless
--no-hint) and runs scripts/bench.py's loader (8 processes, batches of 32, 35 ms of
compute per batch) with `latency` seconds added to every GET. It prints the busy %,
the first batch's wait and the stall in each of the first tenths of the epoch.
`--remove` unmounts and deletes the work dir.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import bench as B  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default="/var/tmp/tierfs-cold-epochs")
    ap.add_argument("--files", type=int, default=20_000)
    ap.add_argument("--latency", type=float, default=B.COLD_GET_LATENCY_S)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--compute-ms", type=float, default=35.0)
    ap.add_argument("--seed", type=int, default=1000, help="epoch k's order: seed + k")
    ap.add_argument("--no-hint", action="store_true")
    ap.add_argument("--remove", action="store_true")
    args = ap.parse_args()
    base = os.path.abspath(args.workdir)
    cfg = B.Config(quick=False, reps=1, ckpt_bytes=0, mixed_write_bytes=0,
                   small_files=args.files)
    mount = B.TierfsMount(f"file://{base}/bucket", base,
                          extra_args=("--fault-file", f"{base}/bucket-latency.json"))
    target = B.TierfsTarget(mount)
    if args.remove:
        if mount.mounted:
            mount.umount()
        shutil.rmtree(base, ignore_errors=True)
        return 0
    paths = B.small_paths(target, cfg)
    mount.mount()
    try:
        if not os.path.exists(paths[-1]):
            B.log(f"creating {args.files:,} files of 64 KiB in {mount.mountpoint}")
            B.ensure_small_files(target, cfg)
            target.settle()
        loader = B.Loader(paths, cfg)
        busy = []
        try:
            for rep in range(args.reps):
                order = list(range(len(paths)))
                random.Random(args.seed + rep).shuffle(order)
                with B.bucket_latency(target, args.latency):
                    B.start_cold_epoch(target, paths, order, hinted=not args.no_hint)
                    e = loader.epoch(order, args.compute_ms / 1000)
                busy.append(e["busy_pct"])
                print(f"epoch {rep + 1}: busy {e['busy_pct']:.1f}%, first batch "
                      f"{e['first_batch_s']:.2f} s, stall {e['stall_s']:.2f} s, by tenth "
                      f"{' '.join(f'{x:.2f}' for x in e['stall_by_tenth_s'][:4])} ...",
                      flush=True)
        finally:
            loader.close()
        print(f"median busy {statistics.median(busy):.1f}% "
              f"({'no hints' if args.no_hint else 'hinted'}, {args.latency * 1000:.0f} ms GETs)")
    finally:
        mount.umount()
    return 0


if __name__ == "__main__":
    sys.exit(main())
