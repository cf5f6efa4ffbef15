#!/usr/bin/env python3
"""What the daemon's in-memory index of the hot tier (tierfs/tier/cache.py) costs per
hot small file: Python heap bytes per file of one extent, clean (in the bucket) and
dirty (waiting for its upload), measured with tracemalloc.

    python scripts/bench_index_memory.py [--files 1000000]

Run it against another checkout with that checkout first on PYTHONPATH.
"""
from __future__ import annotations

import argparse
import tracemalloc

from tierfs.tier.cache import HotIndex


def bytes_per_file(files: int, dirty: bool) -> float:
    keys = [(ino, 0) for ino in range(2, files + 2)]
    tracemalloc.start()
    try:
        index = HotIndex()
        for key in keys:
            if dirty:
                index.written(key, 64 << 10)
            else:
                index.add(key, 64 << 10, dirty=False, checked=True)
        return tracemalloc.get_traced_memory()[0] / files
    finally:
        tracemalloc.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=1_000_000)
    args = ap.parse_args()
    print(f"{args.files:,} files of one extent: bytes per file in the index")
    print(f"clean {bytes_per_file(args.files, False):.0f}")
    print(f"dirty {bytes_per_file(args.files, True):.0f}")


if __name__ == "__main__":
    main()
