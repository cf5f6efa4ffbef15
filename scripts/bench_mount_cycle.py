#!/usr/bin/env python3
"""What a mount costs a node: `tierfs mount`, `tierfs status`, one small file written,
`tierfs umount`, over and over, on a local "bucket" directory (file://), as a job's start and end do.

    python scripts/bench_mount_cycle.py [--cycles 20] [--reps 3] [--workdir DIR]

Each run makes --cycles such cycles of one filesystem (the first mount of the first run
creates it). Printed, medians over --reps runs: the seconds `tierfs mount` takes until
it returns (the daemon is serving), the seconds of a `tierfs status` (a command's start,
one control request, its answer printed), the seconds `tierfs umount` takes until it returns
(the daemon's final checkpoint is in the bucket and the daemon has exited), and the CPU
seconds per cycle of the whole machine (/proc/stat: both commands, the daemon, its
connection guard and helper processes, and the kernel's share; other work on the machine
counts too, so run it on a quiet one and compare checkouts side by side:
PYTHONPATH=CHECKOUT picks the code that runs). Also printed: what `import tierfs` alone
takes (python -X importtime, the package's cumulative time; median of 10), which every
command, the daemon and a data loader's worker pay.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def machine_cpu_seconds() -> float:
    """CPU seconds the whole machine has been busy (not idle, not waiting for a disk)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    busy = sum(ticks) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK")


def tierfs(*args: str) -> None:
    # -P: the package from PYTHONPATH or the install, never a checkout in the current
    # directory (as the daemon, which runs with -P, gets it).
    subprocess.run([sys.executable, "-P", "-m", "tierfs", *args], check=True,
                   stdout=subprocess.DEVNULL)


def import_seconds() -> float:
    """The cumulative import time of the tierfs package alone, as -X importtime reports it."""
    res = subprocess.run([sys.executable, "-P", "-X", "importtime", "-c", "import tierfs"],
                         capture_output=True, text=True, check=True)
    line = [ln for ln in res.stderr.splitlines() if ln.rstrip().endswith("| tierfs")][-1]
    return int(line.split("|")[1]) / 1e6


def run(work: str, cycles: int, first: int) -> tuple[float, float, float, float]:
    """(median mount, status and umount seconds, CPU seconds per cycle)"""
    mnt = os.path.join(work, "mnt")
    mounts, statuses, umounts = [], [], []
    cpu0 = machine_cpu_seconds()
    for i in range(first, first + cycles):
        t0 = time.perf_counter()
        tierfs("mount", f"file://{work}/bucket", mnt, "--cache-dir", f"{work}/cache")
        t1 = time.perf_counter()
        tierfs("status", mnt)
        statuses.append(time.perf_counter() - t1)
        with open(os.path.join(mnt, f"f{i}"), "w") as f:
            f.write("one small file\n")
        t2 = time.perf_counter()
        tierfs("umount", mnt)
        t3 = time.perf_counter()
        mounts.append(t1 - t0)
        umounts.append(t3 - t2)
    cpu = (machine_cpu_seconds() - cpu0) / cycles
    return (statistics.median(mounts), statistics.median(statuses), statistics.median(umounts),
            cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workdir", help="an empty or new directory (default: a temporary one)")
    args = ap.parse_args()
    work = args.workdir or tempfile.mkdtemp(prefix="tierfs-mount-cycle-")
    os.makedirs(os.path.join(work, "mnt"), exist_ok=True)
    try:
        results = [run(work, args.cycles, rep * args.cycles) for rep in range(args.reps)]
    finally:
        if os.path.ismount(os.path.join(work, "mnt")):
            subprocess.run([sys.executable, "-P", "-m", "tierfs", "umount",
                            os.path.join(work, "mnt")])
        shutil.rmtree(work, ignore_errors=True)
    import_s = statistics.median(import_seconds() for _ in range(10))
    mount_s, status_s, umount_s, cpu_s = (statistics.median(r[k] for r in results)
                                          for k in range(4))
    print(f"cycles {args.cycles} x {args.reps} runs (medians)")
    print(f"import tierfs           {import_s * 1000:.1f} ms")
    print(f"tierfs mount            {mount_s:.3f} s")
    print(f"tierfs status           {status_s:.3f} s")
    print(f"tierfs umount           {umount_s:.3f} s")
    print(f"machine CPU per cycle   {cpu_s:.3f} s")


if __name__ == "__main__":
    main()
