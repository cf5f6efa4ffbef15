#!/usr/bin/env python3
"""What a data set's hint list costs the mount's other requests.

    python scripts/bench_hints.py [--files 20000] [--lists 1,5,10] [--reps 3]

Mounts tierfs on a file:// bucket in a temp dir, creates --files files in 100
directories, then for each N in --lists sends tierfs.hint() a list of N x --files
paths (the files repeated N times, shuffled; all hot, so the daemon resolves and
skips them, the part of a hint that runs on its event loop). Meanwhile a separate
process asks the daemon a virtual xattr every millisecond (answered by the event
loop, never cached by the kernel) and keeps the latency of each. Printed per list
length, medians over --reps: the seconds tierfs.hint() took, and the worst probe
latency from its start until the daemon has worked through the list (leaving out
the probes that overlap this script's own status polls), next to the worst one
over a window as long without a hint.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tierfs  # noqa: E402
from bench import TierfsMount  # noqa: E402
from tierfs.client import call  # noqa: E402

PROBE_XATTR = "user.tierfs.control"


def probe(path: str, stop, out) -> None:
    """Ask the daemon every millisecond until `stop`; put [(time, latency), ...]."""
    seen = []
    while not stop.is_set():
        t0 = time.monotonic()
        os.getxattr(path, PROBE_XATTR)
        seen.append((t0, time.monotonic() - t0))
        time.sleep(0.001)
    out.put(seen)


def hinted_files(mountpoint: str, polls: list) -> int:
    """The daemon's count of hinted files worked through. A whole-mount status
    costs the daemon a scan of its own, so its time is noted in `polls` and the
    probes it overlaps are left out of the figures."""
    t0 = time.monotonic()
    count = call(mountpoint, "status")["counters"].get("hinted_files", 0)
    polls.append((t0, time.monotonic()))
    return count


def worst_in(seen, start: float, end: float, polls=()) -> float:
    return max((lat for t, lat in seen if start <= t <= end
                and not any(t <= p_end and t + lat >= p_start for p_start, p_end in polls)),
               default=0.0)


def one_rep(mnt: TierfsMount, files: list[str], n_lists: int, seed: int) -> dict:
    paths = files * n_lists
    random.Random(seed).shuffle(paths)
    stop, out = multiprocessing.Event(), multiprocessing.Queue()
    prober = multiprocessing.Process(target=probe, args=(mnt.mountpoint, stop, out))
    prober.start()
    try:
        time.sleep(0.5)  # the prober is up
        polls: list = []
        before = hinted_files(mnt.mountpoint, polls)
        start = time.monotonic()
        tierfs.hint(paths, replace=True)
        sent = time.monotonic()
        deadline = sent + 600
        while hinted_files(mnt.mountpoint, polls) < before + len(paths):
            if time.monotonic() > deadline:
                raise SystemExit("bench_hints: the daemon did not work through the list "
                                 "within 600 s")
            time.sleep(0.5)
        done = time.monotonic()
        time.sleep(min(done - start, 30))  # as long a window without a hint
        quiet_end = time.monotonic()
    finally:
        stop.set()
        seen = out.get(timeout=60)
        prober.join(60)
    return {"hint_s": sent - start, "worst_ms": 1000 * worst_in(seen, start, done, polls),
            "quiet_ms": 1000 * worst_in(seen, done + 0.2, quiet_end)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=20_000)
    ap.add_argument("--lists", default="1,5,10", help="list lengths, in multiples of --files")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="tierfs-bench-hints-", dir="/var/tmp")
    mnt = TierfsMount(f"file://{work}/bucket", work, ["--upload-delay", "3600"])
    try:
        mnt.mount()
        files = []
        for d in range(100):
            os.mkdir(os.path.join(mnt.mountpoint, f"d{d:03d}"))
        for i in range(args.files):
            path = os.path.join(mnt.mountpoint, f"d{i % 100:03d}", f"f{i:07d}")
            os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))
            files.append(path)
        print(f"{'hint list':>12} {'hint s':>8} {'worst ms':>9} {'no hint ms':>11}")
        for n in (int(x) for x in args.lists.split(",")):
            reps = [one_rep(mnt, files, n, seed) for seed in range(args.reps)]
            med = {k: statistics.median(r[k] for r in reps) for k in reps[0]}
            print(f"{n * args.files:>12,} {med['hint_s']:>8.2f} {med['worst_ms']:>9.0f} "
                  f"{med['quiet_ms']:>11.0f}", flush=True)
        problems = mnt.log_problems()
        if problems:
            raise SystemExit("bench_hints: the daemon logged errors:\n" + "\n".join(problems))
    finally:
        mnt.cleanup()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
