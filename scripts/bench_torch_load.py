#!/usr/bin/env python3
"""Loading a PyTorch checkpoint from the hot tier against a local directory, many short
rounds in a rotating order: the W7 rows of scripts/bench.py move a lot from run to run
on a shared machine, and this puts each tierfs load next to a local one.

    python scripts/bench_torch_load.py --dir MOUNT/ckpt --local-dir DIR [--rounds 12]

Saves a state dict of 16 float32 tensors (256 MiB) once below each directory: with
torch.save (through tierfs.open on the mount) and with torch.distributed.checkpoint
(FileSystemWriter locally, FsspecWriter on a tierfs:// URL), waits until the mount has
uploaded it (`tierfs sync --wait`: the data is clean and hot, as after a save that
settled). Each round then loads it every way, the page cache dropped before each load
(root), the ways in an order that rotates round by round:

- local / mount / tierfs.open: torch.load of the file, opened with open() locally,
  open() on the mount, tierfs.open on the mount;
- dcp local / dcp tierfs: torch.distributed.checkpoint.load with FileSystemReader, and
  with FsspecReader on the tierfs:// URL.

Printed per way: MiB/s of every round and their median, and the median over rounds of
the ratio to the local way of the same kind in that round.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

import tierfs
from bench_read_sizes import drop_caches  # scripts/, beside this one

MiB = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="a new directory on a tierfs mount")
    ap.add_argument("--local-dir", required=True, help="a new directory on a local disk")
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    state = {f"layer{i}.weight": torch.randn(4 << 20) for i in range(16)}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    for d in (args.dir, args.local_dir):
        os.makedirs(d)
    try:
        files = {"local": os.path.join(args.local_dir, "model.pt"),
                 "mount": os.path.join(args.dir, "model.pt")}
        with open(files["local"], "wb") as f:
            torch.save(state, f)
        with tierfs.open(files["mount"], "wb") as f:
            torch.save(state, f)
        dcp_local, dcp_tierfs = (os.path.join(d, "dcp") for d in (args.local_dir, args.dir))
        dcp.save(state, storage_writer=dcp.FileSystemWriter(dcp_local), no_dist=True)
        dcp.save(state, storage_writer=FsspecWriter(f"tierfs://{dcp_tierfs}"), no_dist=True)
        subprocess.run(["tierfs", "sync", args.dir, "--wait"], check=True,
                       capture_output=True)
        target = {k: torch.empty_like(v) for k, v in state.items()}

        def load(path: str, opener) -> None:
            with opener(path, "rb") as f:
                torch.load(f)

        ways = {
            "local": lambda: load(files["local"], open),
            "mount": lambda: load(files["mount"], open),
            "tierfs.open": lambda: load(files["mount"], tierfs.open),
            "dcp local": lambda: dcp.load(target, no_dist=True,
                                          storage_reader=dcp.FileSystemReader(dcp_local)),
            "dcp tierfs": lambda: dcp.load(target, no_dist=True, storage_reader=FsspecReader(
                f"tierfs://{dcp_tierfs}")),
        }
        names = list(ways)
        rates: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                drop_caches()
                t0 = time.perf_counter()
                ways[name]()
                rates[name].append(nbytes / MiB / (time.perf_counter() - t0))
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
        shutil.rmtree(args.local_dir, ignore_errors=True)
    print(f"torch.load of {nbytes // MiB} MiB, page cache dropped, {args.rounds} rounds")
    for name in names:
        ref = "dcp local" if name.startswith("dcp") else "local"
        ratio = statistics.median(a / b for a, b in zip(rates[name], rates[ref]))
        print(f"{name:<12} median {statistics.median(rates[name]):6.0f} MiB/s  ratio "
              f"{ratio:4.2f}   rounds: " + " ".join(f"{x:.0f}" for x in rates[name]))


if __name__ == "__main__":
    main()
