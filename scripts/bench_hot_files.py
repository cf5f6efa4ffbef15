#!/usr/bin/env python3
"""What putting a fetched extent in place costs per file on the hot tier's disk: a new
file created for it (as tierfs does), or an evicted file kept empty and reused.

    python scripts/bench_hot_files.py [--files 4000] [--size 65536] [--reps 3] [--dir /var/tmp]

Per rep and mode, --files files are laid out as tierfs's hot tier lays out extent files
(256 directories), removed as eviction would, and written again as fetches would (a temp
file renamed into place). "create": eviction unlinks, a fetch creates a file. "reuse":
eviction empties the file and renames it to a spare directory, a fetch renames a spare
to its temp name, opens and writes it (without O_TRUNC, as tierfs does: a truncate to
zero makes ext4 push the file's data to the disk at close; --o-trunc opens it with O_TRUNC
to show that cost). Printed: medians of µs per file.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time


def one_rep(root: str, files: int, data: bytes, reuse: bool,
            o_trunc: bool = False) -> tuple[float, float]:
    """(µs per file to fill after eviction, µs per file to evict)."""
    spare = os.path.join(root, "spare")
    for d in range(256):
        os.makedirs(os.path.join(root, f"{d:02x}"))
    os.makedirs(spare)

    def path(i: int) -> str:
        return os.path.join(root, f"{i & 0xff:02x}", f"{i:x}.0")

    def put(i: int, spare_name: str | None) -> None:
        tmp = path(i) + ".tmp"
        if spare_name is not None:
            os.rename(os.path.join(spare, spare_name), tmp)
        flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if o_trunc else 0)
        with open(os.open(tmp, flags, 0o600), "wb") as f:
            f.write(data)
        os.rename(tmp, path(i))

    for i in range(files):
        put(i, None)
    t0 = time.perf_counter()
    for i in range(files):
        if reuse:
            os.truncate(path(i), 0)
            os.rename(path(i), os.path.join(spare, str(i)))
        else:
            os.unlink(path(i))
    evicted = time.perf_counter()
    for i in range(files):
        put(files + i, str(i) if reuse else None)
    filled = time.perf_counter()
    shutil.rmtree(root)
    return 1e6 * (filled - evicted) / files, 1e6 * (evicted - t0) / files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=4000)
    ap.add_argument("--size", type=int, default=64 << 10)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/var/tmp", help="a directory on the disk to test")
    ap.add_argument("--o-trunc", action="store_true",
                    help="open reused temp files with O_TRUNC, to measure what that costs")
    args = ap.parse_args()
    data = os.urandom(args.size)
    work = tempfile.mkdtemp(prefix="tierfs-bench-hot-", dir=args.dir)
    try:
        runs: dict[bool, list] = {False: [], True: []}
        for _rep in range(args.reps):
            for reuse in (False, True):  # alternating: the disk's mood hits both
                runs[reuse].append(one_rep(os.path.join(work, "hot"), args.files, data, reuse,
                                          args.o_trunc))
        print(f"{args.files:,} files of {args.size:,} bytes in {args.dir}, medians of "
              f"{args.reps} (each run: create / reuse)")
        for i, what in enumerate(("fill after eviction", "evict")):
            each = "  ".join(f"{c:.0f}/{r:.0f}" for (c, r) in
                             zip((x[i] for x in runs[False]), (x[i] for x in runs[True])))
            c, r = (statistics.median(x[i] for x in runs[k]) for k in (False, True))
            print(f"{what:<20} create {c:6.0f} us  reuse {r:6.0f} us  ratio {r / c:5.2f}"
                  f"   runs: {each}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
