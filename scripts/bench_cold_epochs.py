#!/usr/bin/env python3
"""Cold W6 epochs, repeated on one data set: where a cold training epoch waits.

    python scripts/bench_cold_epochs.py --workdir /var/tmp/cold-epochs --latency 0.02 --reps 2
    python scripts/bench_cold_epochs.py --workdir /var/tmp/cold-epochs --latency 0.05 --no-hint

The first run creates the data set (20,000 files of 64 KiB, as W6 at full size) in a
tierfs filesystem whose bucket is a file:// directory in the work dir, and keeps it
there, so that runs of different code (its checkout first on PYTHONPATH) or settings
compare on the same files. `--bucket moto-ranges` (or `moto`) puts the bucket in a moto
S3 server started for the run instead, as `scripts/bench.py --bucket` does; the server
keeps its objects in memory, so each run creates the data set again. Each epoch releases the files' hot copies, waits until the
daemon has emptied them, drops the page cache, hints the epoch's order (unless
--no-hint) and runs scripts/bench.py's loader (8 processes, batches of 32, 35 ms of
compute per batch) with `latency` seconds added to every GET. It prints the busy %,
the first batch's wait and the stall in each of the first tenths of the epoch, the CPU
seconds the daemon and its event loop (main thread) spent in the epoch, and how
the runs of files fetched along were installed (the daemon's
tierfs_fetched_install_seconds: the wait for one of its install threads, the writing of
the run's hot copies, and the event loop's time for their records and renames; a run's
files hold their memory until it is installed).
`--remove` unmounts and deletes the work dir.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import socket
import statistics
import sys
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import bench as B  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def install_times(port: int) -> dict[str, float]:
    """Count and sum of tierfs_fetched_install_seconds, per phase, and the count of
    GETs of extents (tierfs_cold_fetches), from the daemon."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    text = opener.open(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    found = re.findall(r'^tierfs_fetched_install_seconds_(count|sum)\{phase="(\w+)"\} (\S+)$',
                       text, re.M)
    out = {f"{phase}_{what}": float(value) for what, phase, value in found}
    gets = re.search(r"^tierfs_cold_fetches_total (\S+)$", text, re.M)
    out["gets_count"] = float(gets.group(1)) if gets else 0.0
    return out


def install_line(before: dict, after: dict) -> str:
    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)
    runs = delta("write_count")
    if not runs:
        return f"GETs {delta('gets_count'):.0f}; installs of fetched runs: none"
    line = (f"GETs {delta('gets_count'):.0f}; installs of fetched runs: {runs:.0f}, each "
            f"waited {1000 * delta('wait_sum') / runs:.0f} ms for an install thread and "
            f"wrote for {1000 * delta('write_sum') / runs:.0f} ms")
    if delta("install_count"):  # older daemons do not report this phase
        line += (f", then held the event loop {1000 * delta('install_sum') / runs:.1f} ms "
                 f"to be put in place")
    return line + " (means)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default="/var/tmp/tierfs-cold-epochs")
    ap.add_argument("--files", type=int, default=20_000)
    ap.add_argument("--latency", type=float, default=B.COLD_GET_LATENCY_S)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--compute-ms", type=float, default=35.0)
    ap.add_argument("--seed", type=int, default=1000, help="epoch k's order: seed + k")
    ap.add_argument("--no-hint", action="store_true")
    ap.add_argument("--bucket", choices=("file", "moto-ranges", "moto"), default="file")
    ap.add_argument("--remove", action="store_true")
    args = ap.parse_args()
    base = os.path.abspath(args.workdir)
    with contextlib.ExitStack() as stack:
        url = f"file://{base}/bucket"
        if args.bucket != "file":
            if args.remove:
                return 0
            endpoint = stack.enter_context(B.moto.moto_server(ranges=args.bucket == "moto-ranges"))
            os.environ.update(B.s3_env(endpoint))
            os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"
            B.make_bucket(endpoint, B.BUCKET)
            url = f"s3://{B.BUCKET}/epochs"
            base = os.path.join(base, "s3")  # the file bucket's data set stays apart
            shutil.rmtree(base, ignore_errors=True)
        return run(args, base, url)


def run(args, base: str, url: str) -> int:
    cfg = B.Config(quick=False, reps=1, ckpt_bytes=0, mixed_write_bytes=0,
                   small_files=args.files)
    port = free_port()
    mount = B.TierfsMount(url, base,
                          extra_args=("--fault-file", f"{base}/bucket-latency.json",
                                      "--metrics-port", str(port)))
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
        status = B.tierfs_cli("status", mount.mountpoint, "--json", timeout=120)
        packs = json.loads(status.stdout).get("packs", "?")
        print(f"data set: {args.files:,} files in {packs} packs", flush=True)
        loader = B.Loader(paths, cfg)
        busy = []
        try:
            for rep in range(args.reps):
                order = list(range(len(paths)))
                random.Random(args.seed + rep).shuffle(order)
                with B.bucket_latency(target, args.latency):
                    B.start_cold_epoch(target, paths, order, hinted=not args.no_hint)
                    installs = install_times(port)
                    with B.CpuWatch(mount.pid) as cpu:
                        e = loader.epoch(order, args.compute_ms / 1000)
                    installs = install_line(installs, install_times(port))
                busy.append(e["busy_pct"])
                print(f"epoch {rep + 1}: busy {e['busy_pct']:.1f}%, first batch "
                      f"{e['first_batch_s']:.2f} s, stall {e['stall_s']:.2f} s, by tenth "
                      f"{' '.join(f'{x:.2f}' for x in e['stall_by_tenth_s'][:4])} ...; "
                      f"daemon CPU {cpu.result['daemon_s']:.1f} s, its event loop "
                      f"{cpu.result['loop_s']:.1f} s; "
                      f"{installs}", flush=True)
        finally:
            loader.close()
        print(f"median busy {statistics.median(busy):.1f}% "
              f"({'no hints' if args.no_hint else 'hinted'}, {args.latency * 1000:.0f} ms GETs, "
              f"{args.bucket} bucket)")
    finally:
        mount.umount()
        if args.bucket != "file":
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
