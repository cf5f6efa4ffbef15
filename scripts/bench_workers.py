"""Worker-process functions of scripts/bench.py.

A separate, standard-library-only module so that spawned worker processes import
it quickly and never import the benchmark driver (boto3, moto, ...).

Every worker waits on a shared barrier before it starts, so the driver can take
the start time after the (slow) process start-up, and reports either
("ok", ...) or ("error", text) on its result queue.
"""
from __future__ import annotations

import mmap
import os
import time
import traceback

BLOCK = 1 << 20


def read_buffer(size: int = BLOCK) -> mmap.mmap:
    """A buffer to read into, starting on a page boundary. A fresh bytearray of 1 MiB
    starts 16 bytes into a page (glibc's header of an mmapped block), and on some CPUs
    (the AMD EPYC build machine) the kernel's copy from the page cache into a buffer
    1-31 bytes past a page boundary runs several times slower: a 64 KiB file read
    locally cost 34 µs instead of 12.5 (README, Benchmark § Where a reader's buffer
    starts). Both sides of a comparison read into buffers placed alike."""
    return mmap.mmap(-1, size)


def read_whole(path: str, buf, opener=open) -> int:
    """Read a file to its end with unbuffered reads of len(buf) bytes; return its size.
    opener: open, or tierfs.open for the direct path."""
    view = memoryview(buf)
    total = 0
    with opener(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(view)
            if not n:
                return total
            total += n


def write_blocks(path: str, size: int, block: bytes, do_fsync: bool = True,
                 opener=open) -> int:
    """Write `size` bytes in len(block) writes (the last one may be short), then fsync.
    opener: open, or tierfs.open for the direct path."""
    done = 0
    with opener(path, "wb", buffering=0) as f:
        while done < size:
            n = min(len(block), size - done)
            f.write(block if n == len(block) else block[:n])
            done += n
        if do_fsync:
            os.fsync(f.fileno())
    return done


# ---- W3: parallel readers --------------------------------------------------------------

def read_share(paths: list[str], barrier, results) -> None:
    """Read every file of `paths` fully (64 KiB files: one or two reads each)."""
    try:
        buf = read_buffer()
        barrier.wait()
        t0 = time.monotonic()
        nbytes = sum(read_whole(p, buf) for p in paths)
        results.put(("ok", len(paths), nbytes, time.monotonic() - t0))
    except BaseException:
        results.put(("error", traceback.format_exc()))


def read_share_direct(paths: list[str], batch: int, barrier, results) -> None:
    """read_share through tierfs.open (batch 0), or tierfs.open_many per `batch` files.
    tierfs is imported here only: it is the code under test, not the driver."""
    try:
        import tierfs
        # Bound before the clock starts: their first use imports the direct path (tens
        # of ms per process), which a loader's worker pays once, not per epoch.
        open_one, open_many = tierfs.open, tierfs.open_many
        buf = read_buffer()
        barrier.wait()
        t0 = time.monotonic()
        nbytes = 0
        if not batch:
            nbytes = sum(read_whole(p, buf, open_one) for p in paths)
        for at in range(0, len(paths) if batch else 0, batch or 1):
            for f in open_many(paths[at:at + batch], buffering=0):
                with f:
                    while n := f.readinto(buf):
                        nbytes += n
        results.put(("ok", len(paths), nbytes, time.monotonic() - t0))
    except BaseException:
        results.put(("error", traceback.format_exc()))


# ---- W5: one streaming reader or writer ----------------------------------------------------

def _opener(direct: bool):
    if not direct:
        return open
    import tierfs
    return tierfs.open


def stream_read(path: str, barrier, results, direct: bool = False) -> None:
    try:
        buf = read_buffer()
        opener = _opener(direct)
        barrier.wait()
        t0 = time.monotonic()
        n = read_whole(path, buf, opener)
        results.put(("ok", "read", n, time.monotonic() - t0))
    except BaseException:
        results.put(("error", traceback.format_exc()))


def stream_write(path: str, size: int, barrier, results, direct: bool = False) -> None:
    try:
        block = os.urandom(BLOCK)
        opener = _opener(direct)
        barrier.wait()
        t0 = time.monotonic()
        n = write_blocks(path, size, block, opener=opener)
        results.put(("ok", "write", n, time.monotonic() - t0))
    except BaseException:
        results.put(("error", traceback.format_exc()))


def stream_read_direct(path: str, barrier, results) -> None:
    stream_read(path, barrier, results, direct=True)


def stream_write_direct(path: str, size: int, barrier, results) -> None:
    stream_write(path, size, barrier, results, direct=True)


# ---- W6: data-loader workers -----------------------------------------------------------

def loader_worker(paths: list[str], tasks, results) -> None:
    """Like a DataLoader worker: take (batch number, sample indices), read those
    samples, hand back (batch number, bytes). None stops the worker."""
    buf = read_buffer()
    while True:
        task = tasks.get()
        if task is None:
            return
        batch, indices = task
        try:
            nbytes = sum(read_whole(paths[i], buf) for i in indices)
            results.put(("ok", batch, nbytes))
        except BaseException:
            results.put(("error", traceback.format_exc()))


# ---- W6 with torch (only used when `import torch` works) ------------------------------------

class FileDataset:
    """A map-style dataset whose samples are whole files (returns the byte count)."""

    def __init__(self, paths: list[str]):
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> int:
        with open(self.paths[i], "rb", buffering=0) as f:
            return len(f.read())


def accelerate_worker(_worker_id: int) -> None:
    """A DataLoader worker_init_fn: the builtin open() of mount paths goes through
    tierfs.open from here on (the dataset code is unchanged)."""
    import tierfs
    tierfs.accelerate()


class OrderSampler:
    """A sampler whose order the driver replaces before every epoch (the iteration
    happens in the main process, so this works with persistent workers)."""

    def __init__(self, order: list[int]):
        self.order = list(order)

    def __iter__(self):
        return iter(list(self.order))

    def __len__(self) -> int:
        return len(self.order)


def collate_sizes(samples: list[int]) -> int:
    return sum(samples)
