#!/usr/bin/env python3
"""The daemon's memory per file on the hot tier: what a node needs to keep a data set
of many small files hot.

    python scripts/bench_hot_memory.py --dir /mnt/tierfs/hot-memory [--files 100000]

Writes --files files of 4 KiB below --dir (a new directory on a tierfs mount), in
100 directories, waits until they are uploaded (`tierfs sync --wait`: then each is a
clean hot extent, the state a data set stays in while it is read epoch after epoch),
and prints the daemon's anonymous memory (RssAnon, /proc/PID/status) before and after,
and the difference per hot file. The files stay (remove --dir afterwards).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from tierfs.client import daemon_info

SIZE = 4096


def rss_anon_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    raise RuntimeError(f"no RssAnon for pid {pid}")


def hot_extents(top: str) -> int:
    mountpoint = daemon_info(top)["mountpoint"]  # the whole mount's figures
    out = subprocess.run(["tierfs", "status", mountpoint, "--json"], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)["hot_extents"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="a new directory on a tierfs mount")
    ap.add_argument("--files", type=int, default=100_000)
    args = ap.parse_args()
    top = os.path.abspath(args.dir)
    os.makedirs(top, exist_ok=True)
    if os.listdir(top):
        sys.exit(f"bench_hot_memory: {top} is not empty: give a new directory")
    pid = daemon_info(top)["pid"]
    subprocess.run(["tierfs", "sync", "--wait", top], check=True, capture_output=True)
    hot0, rss0 = hot_extents(top), rss_anon_kib(pid)
    data = os.urandom(SIZE)
    for i in range(args.files):
        d = os.path.join(top, f"d{i % 100:02d}")
        if i < 100:
            os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"f{i:07d}"), "wb") as f:
            f.write(data)
    subprocess.run(["tierfs", "sync", "--wait", top], check=True, capture_output=True)
    hot1, rss1 = hot_extents(top), rss_anon_kib(pid)
    added = hot1 - hot0
    print(f"hot extents         {hot0:,} -> {hot1:,} (+{added:,})")
    print(f"daemon RssAnon      {rss0 / 1024:,.1f} -> {rss1 / 1024:,.1f} MiB")
    if added > 0:
        print(f"per added hot file  {(rss1 - rss0) * 1024 / added:,.0f} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
