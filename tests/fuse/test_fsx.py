"""An fsx-style exerciser: a seeded random sequence of writes, truncates, reads,
fsyncs, reopens and mmap reads on one file in the mount, checked against an
in-memory model. Sizes cross several extent boundaries (extents are 4 MiB; the
file grows to about 20 MiB), offsets cluster around those boundaries, and the
kernel's page cache is dropped now and then so reads reach the daemon.

A failure names the seed, the op index and the first differing offset, and
lists the ops just before it; rerun a single seed with -k.
"""
from __future__ import annotations

import collections
import mmap
import os
import random

import pytest

MiB = 1 << 20
E = 4 * MiB
MAX_SIZE = 20 * MiB
N_OPS = 3000


class Fsx:
    def __init__(self, path: str, seed: int):
        self.path = path
        self.seed = seed
        self.rng = random.Random(seed)
        self.model = bytearray()
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.op = -1
        self.history: collections.deque[str] = collections.deque(maxlen=12)

    # ---- choosing offsets and lengths ----------------------------------------------
    def offset(self) -> int:
        r = self.rng.random()
        if r < 0.35:  # near an extent boundary
            edge = self.rng.randrange(1, MAX_SIZE // E + 1) * E
            return max(0, min(MAX_SIZE - 1, edge + self.rng.randrange(-8192, 8192)))
        if r < 0.55 and self.model:  # near the current end of file
            return max(0, min(MAX_SIZE - 1, len(self.model) + self.rng.randrange(-65536, 65536)))
        return self.rng.randrange(MAX_SIZE)

    def length(self) -> int:
        r = self.rng.random()
        if r < 0.6:
            return self.rng.randrange(1, 16384)
        if r < 0.95:
            return self.rng.randrange(16384, 512 * 1024)
        return self.rng.randrange(512 * 1024, 5 * MiB)  # spans a whole extent

    # ---- checking --------------------------------------------------------------------
    def fail(self, what: str) -> None:
        raise AssertionError(f"fsx seed {self.seed} op #{self.op}: {what}\nlast ops:\n  "
                             + "\n  ".join(self.history))

    def compare(self, got: bytes, off: int, how: str) -> None:
        want = bytes(self.model[off:off + len(got)]) if off < len(self.model) else b""
        if got == want:
            return
        n = min(len(got), len(want))
        bad = next((i for i in range(n) if got[i] != want[i]), n)
        self.fail(f"{how} at offset {off}: first difference at file offset {off + bad} "
                  f"(got {got[bad:bad + 8].hex() or 'EOF'}, expected "
                  f"{want[bad:bad + 8].hex() or 'EOF'}; read {len(got)}, expected {len(want)})")

    def check_size(self) -> None:
        size = os.fstat(self.fd).st_size
        if size != len(self.model):
            self.fail(f"size {size}, expected {len(self.model)}")

    # ---- ops -------------------------------------------------------------------------
    def do_write(self) -> None:
        off = self.offset()
        n = min(self.length(), MAX_SIZE - off)
        data = self.rng.randbytes(n)
        self.history.append(f"#{self.op} pwrite off={off} len={n}")
        if os.pwrite(self.fd, data, off) != n:
            self.fail(f"short pwrite at offset {off}")
        if off > len(self.model):
            self.model.extend(bytes(off - len(self.model)))
        self.model[off:off + n] = data

    def do_truncate(self) -> None:
        r = self.rng.random()
        if r < 0.4:
            size = self.rng.randrange(len(self.model) + 1)      # down
        elif r < 0.7:
            size = self.offset()                                # near a boundary / anywhere
        else:
            size = min(MAX_SIZE, len(self.model) + self.rng.randrange(E))  # up
        self.history.append(f"#{self.op} ftruncate {len(self.model)} -> {size}")
        os.ftruncate(self.fd, size)
        if size < len(self.model):
            del self.model[size:]
        else:
            self.model.extend(bytes(size - len(self.model)))

    def do_read(self) -> None:
        off = self.offset()
        n = self.length()
        self.history.append(f"#{self.op} pread off={off} len={n}")
        self.compare(os.pread(self.fd, n, off), off, "pread")

    def do_mmap_read(self) -> None:
        size = len(self.model)
        if size == 0:
            return
        off = self.rng.randrange(size)
        n = min(self.length(), size - off)
        self.history.append(f"#{self.op} mmap read off={off} len={n}")
        with mmap.mmap(self.fd, size, access=mmap.ACCESS_READ) as m:
            self.compare(m[off:off + n], off, "mmap read")

    def do_fsync(self) -> None:
        self.history.append(f"#{self.op} fsync")
        (os.fsync if self.rng.random() < 0.5 else os.fdatasync)(self.fd)

    def do_reopen(self) -> None:
        self.history.append(f"#{self.op} close+reopen")
        os.close(self.fd)
        self.fd = os.open(self.path, os.O_RDWR)

    def do_drop_cache(self) -> None:
        # Clean pages can be dropped; flush first so that is all of them.
        self.history.append(f"#{self.op} fsync+drop page cache")
        os.fsync(self.fd)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def verify_all(self, how: str) -> None:
        self.check_size()
        pos = 0
        while pos < len(self.model):
            chunk = os.pread(self.fd, 4 * MiB, pos)
            if not chunk:
                self.fail(f"{how}: EOF at {pos}, expected {len(self.model)} bytes")
            self.compare(chunk, pos, how)
            pos += len(chunk)

    def run(self, n_ops: int) -> None:
        ops = [(self.do_write, 34), (self.do_read, 26), (self.do_truncate, 9),
               (self.do_mmap_read, 6), (self.do_fsync, 8), (self.do_reopen, 6),
               (self.do_drop_cache, 6)]
        funcs = [f for f, _w in ops]
        weights = [w for _f, w in ops]
        for self.op in range(n_ops):
            self.rng.choices(funcs, weights)[0]()
            self.check_size()
            if self.op % 500 == 499:
                self.history.append(f"#{self.op} full check")
                self.do_drop_cache()
                self.verify_all("full check")

    def close(self) -> None:
        os.close(self.fd)


@pytest.mark.parametrize("seed,args,n_ops", [
    (1, [], N_OPS), (2, [], N_OPS), (3, [], N_OPS),
    # A hot tier smaller than the file: extents get evicted, and reads and
    # partial writes fetch them back from the bucket (slower: fewer ops).
    (4, ["--cache-size", "12M"], 600),
    # The daemon's own size and mtime handling, 1 MiB extents.
    (5, ["--no-writeback-cache", "--extent-size", "1M"], N_OPS),
], ids=["seed1", "seed2", "seed3", "seed4-evicting", "seed5-no-writeback-1M"])
def test_fsx(mount_factory, seed, args, n_ops):
    mnt = mount_factory(args=args)
    path = mnt.path(f"fsx{seed}")
    fsx = Fsx(path, seed)
    try:
        fsx.run(n_ops)
        fsx.op = n_ops
        fsx.history.append("final check before remount")
        fsx.do_drop_cache()
        fsx.verify_all("final check")
    finally:
        fsx.close()
    mnt.remount()
    fsx.history.append("final check after remount")
    fsx.fd = os.open(path, os.O_RDONLY)
    try:
        fsx.verify_all("after remount")
    finally:
        fsx.close()
