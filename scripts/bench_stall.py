#!/usr/bin/env python3
"""How long the mount stops answering while hot copies are dropped: a large file
deleted, and an eviction of a tenth of the hot tier.

    python scripts/bench_stall.py [--gib 4] [--reps 3] [--workdir /var/tmp]

The script mounts a tierfs of its own (a file:// bucket and the cache dir under
--workdir, --cache-size --gib GiB, uploads at once) with the `tierfs` on PATH (put a
checkout first on PYTHONPATH to measure another version). While each step runs, a
thread opens and closes a small file on the mount in a loop: every open is a request
the daemon answers on its one trio thread, so the longest open is how long that
thread was busy with something else. Per repetition:

- delete: a file of --gib GiB is written and deleted (`rm`); the window runs from the
  rm until `tierfs status` shows no dropped copies left to empty;
- write, room: 1 GiB written into a hot tier with room for it (the baseline);
- write, evicting: a file of --gib GiB written and uploaded (`sync --wait`) fills the
  hot tier; then 1 GiB more written, which evicts a tenth of it (down to the low
  watermark) besides the room the write needs.

Printed per step: medians over --reps of the longest open (ms), of the time opens
spent over 20 ms in all (ms), and of the step's wall time (s).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time

MiB, GiB = 1 << 20, 1 << 30


class Probe:
    """Opens and closes `path` in a loop; latencies of the opens started in a window."""

    def __init__(self, path: str):
        self.path, self.samples, self.stop = path, [], False
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop:
            t = time.perf_counter()
            os.close(os.open(self.path, os.O_RDONLY))
            self.samples.append((t, time.perf_counter() - t))

    def window(self, t0: float, t1: float) -> tuple[float, float]:
        """(longest open, sum of opens over 20 ms), in ms, of opens started in [t0, t1]."""
        got = [d for t, d in list(self.samples) if t0 <= t <= t1]
        return 1000 * max(got, default=0.0), 1000 * sum(d for d in got if d > 0.02)

    def close(self) -> None:
        self.stop = True
        self.thread.join()


def write(path: str, size: int) -> None:
    block = os.urandom(MiB)
    with open(path, "wb", buffering=0) as f:
        for _ in range(size // MiB):
            f.write(block)


def status(mnt: str) -> dict:
    out = subprocess.run(["tierfs", "status", "--json", mnt], capture_output=True,
                         text=True, check=True, timeout=60).stdout
    return json.loads(out)


def wait_trash_empty(mnt: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while status(mnt).get("trash_files", 0):
        if time.monotonic() > deadline:
            raise RuntimeError("the trash did not empty")
        time.sleep(0.05)


def step(probe: Probe, fn) -> tuple[float, float, float]:
    t0 = time.perf_counter()
    fn()
    t1 = time.perf_counter()
    time.sleep(0.2)  # opens started at the very end finish
    return (*probe.window(t0, t1), t1 - t0)


def one_rep(work: str, gib: int) -> dict[str, tuple[float, float, float]]:
    mnt, cache = os.path.join(work, "mnt"), os.path.join(work, "cache")
    os.makedirs(mnt)
    subprocess.run(["tierfs", "mount", f"file://{work}/bucket", mnt, "--cache-dir", cache,
                    "--cache-size", f"{gib}G", "--min-free", "0", "--upload-delay", "0"],
                   check=True, capture_output=True, timeout=120)
    try:
        probe_path = os.path.join(mnt, "probe")
        with open(probe_path, "w") as f:
            f.write("x")
        probe = Probe(probe_path)
        try:
            out = {}
            big = os.path.join(mnt, "big")
            write(big, gib * GiB)

            def delete() -> None:
                subprocess.run(["rm", big], check=True)
                wait_trash_empty(mnt)
            out["delete"] = step(probe, delete)
            out["write, room"] = step(probe, lambda: write(os.path.join(mnt, "w1"), GiB))
            os.unlink(os.path.join(mnt, "w1"))
            write(big, gib * GiB - GiB // 2)
            subprocess.run(["tierfs", "sync", "--wait", mnt], check=True,
                           capture_output=True, timeout=600)
            wait_trash_empty(mnt)
            out["write, evicting"] = step(probe, lambda: write(os.path.join(mnt, "w2"), GiB))
            if not status(mnt)["counters"].get("evictions"):
                raise RuntimeError("the last write evicted nothing: nothing was measured")
            return out
        finally:
            probe.close()
    finally:
        subprocess.run(["tierfs", "umount", mnt], capture_output=True, timeout=600)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=int, default=4, help="file and hot tier size, GiB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workdir", default="/var/tmp")
    args = ap.parse_args()
    runs = []
    for rep in range(args.reps):
        work = tempfile.mkdtemp(prefix="tierfs-stall-", dir=args.workdir)
        try:
            runs.append(one_rep(work, args.gib))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(f"rep {rep + 1}: " + "; ".join(f"{k} {v[0]:.0f} ms" for k, v in runs[-1].items()),
              flush=True)
    print(f"{'step':18} {'longest open ms':>16} {'opens > 20 ms, ms':>18} {'wall s':>7}"
          f"   (medians of {args.reps}, {args.gib} GiB)")
    for name in runs[0]:
        longest, over, wall = (statistics.median(r[name][k] for r in runs) for k in range(3))
        print(f"{name:18} {longest:16.1f} {over:18.0f} {wall:7.1f}")


if __name__ == "__main__":
    main()
