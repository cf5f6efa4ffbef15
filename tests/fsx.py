"""An fsx-style exerciser: a seeded random sequence of file operations on one
file, checked against an in-memory model of its contents.

A plain module (no pytest): tests/fuse/test_fsx.py and scripts/fsx_long.py both
use it. Ops (names as used in `weights`):

  write        pwrite of a random range (may extend the file, leaving a hole)
  read         pread of a random range, compared with the model
  mmap_read    MAP_SHARED read of a range inside the file
  mmap_write   MAP_SHARED write of a range inside the file, then msync (mmap.flush)
  copy_range   os.copy_file_range of a range to a non-overlapping range of the
               same file; only where the syscall raises EXDEV/ENOSYS/EOPNOTSUPP
               is it done as pread+pwrite instead (counted as copy_range_fallback)
  truncate     ftruncate down or up, sizes clustered around extent boundaries;
               sometimes down and straight back up (the cut range must read as zeros)
  fsync        fsync or fdatasync
  reopen       close and reopen the file
  drop_cache   fsync, then posix_fadvise(DONTNEED): the next reads reach the daemon
  direct_read  fsync (close-to-open), then a random range read through tierfs.open_many
               (the direct path for files of every size: hot extent files' descriptors)
  direct_write fsync, then a random range written through tierfs.open(path, "r+b")
               (sometimes fsynced), closed, with unchecked reads of the range through
               the mount before and after the write (they fill the kernel's cache); the
               mount's descriptor stays open and must see the data and the size at once.
               A direct op that falls back to the builtin open() is a failure: it would
               test the mount instead

Offsets cluster around extent boundaries (multiples of `extent_size`) and the
end of file; lengths go up to `max_len`. Every `check_every` ops the page cache
is dropped and the whole file is read back. A failure raises FsxFailure, which
names the seed, the op index, the offset and the kind of failure, and lists the
last ops (those touching the bad offset are marked).
"""
from __future__ import annotations

import collections
import errno
import mmap
import os
import random
import time
from array import array
from dataclasses import dataclass

KiB = 1 << 10
MiB = 1 << 20

# The default mix with the direct path's reads and writes between the mount's ops.
DIRECT_WEIGHTS = {"write": 18, "read": 14, "mmap_read": 6, "mmap_write": 8, "copy_range": 5,
                  "truncate": 9, "fsync": 4, "reopen": 3, "drop_cache": 6,
                  "direct_read": 14, "direct_write": 13}
# The historical mix of tests/fuse/test_fsx.py (no mmap writes, no copies).
LEGACY_WEIGHTS = {"write": 34, "read": 26, "truncate": 9, "mmap_read": 6, "fsync": 8,
                  "reopen": 6, "drop_cache": 6}
# Every op: the mix of the bug reports.
DEFAULT_WEIGHTS = {"write": 24, "read": 22, "mmap_read": 8, "mmap_write": 12,
                   "copy_range": 7, "truncate": 9, "fsync": 6, "reopen": 4, "drop_cache": 8}
# Mostly MAP_SHARED writes and msync.
MMAP_HEAVY_WEIGHTS = {"write": 8, "read": 14, "mmap_read": 14, "mmap_write": 40,
                      "copy_range": 3, "truncate": 6, "fsync": 4, "reopen": 3, "drop_cache": 8}

FALLBACK_ERRNOS = (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP)


class FsxFailure(AssertionError):
    """The file disagreed with the model (or an op failed)."""

    def __init__(self, message: str, *, seed: int, op: int, kind: str,
                 offset: int | None = None, err: int | None = None, history=()):
        super().__init__(message)
        self.seed = seed
        self.op = op
        self.kind = kind          # "mismatch", "size", "errno", "short", "fallback"
        self.offset = offset      # first bad file offset, or the op's offset
        self.errno = err
        self.history = list(history)

    def summary(self) -> dict:
        return {"seed": self.seed, "op": self.op, "kind": self.kind, "offset": self.offset,
                "errno": errno.errorcode.get(self.errno, self.errno) if self.errno else None,
                "message": str(self).split("\n", 1)[0]}


@dataclass
class _Hist:
    op: int
    text: str
    lo: int = -1        # file range the op changed or read: [lo, hi)
    hi: int = -1
    read: bool = False  # it only read that range
    data: bytes | None = None  # what a write put at [lo, hi)


class Fsx:
    def __init__(self, path: str, seed: int, *, max_size: int = 20 * MiB,
                 extent_size: int = 4 * MiB, max_len: int = 1 * MiB,
                 weights: dict[str, float] | None = None, check_every: int = 500,
                 history_len: int = 40, create: bool = True):
        self.path = path
        self.seed = seed
        self.max_size = max_size
        self.extent_size = extent_size
        self.max_len = max_len
        self.check_every = check_every
        self.weights = dict(DEFAULT_WEIGHTS if weights is None else weights)
        unknown = set(self.weights) - set(self._ops())
        if unknown:
            raise ValueError(f"unknown fsx ops: {sorted(unknown)}")
        self.rng = random.Random(seed)
        self.model = bytearray()
        self.op = -1
        self.ops_done = 0
        self.history: collections.deque[_Hist] = collections.deque(maxlen=history_len)
        self.counts: collections.Counter[str] = collections.Counter()
        # Which op last changed each page of the file (and what that op was), to name
        # the culprit of a mismatch older than the history window.
        self.changed_by = array("q", [-1]) * (max_size // mmap.PAGESIZE + 2)
        self.op_text: dict[int, str] = {}
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | (os.O_TRUNC if create else 0), 0o644)

    def _ops(self) -> dict:
        return {"write": self.do_write, "read": self.do_read, "mmap_read": self.do_mmap_read,
                "mmap_write": self.do_mmap_write, "copy_range": self.do_copy_range,
                "truncate": self.do_truncate, "fsync": self.do_fsync, "reopen": self.do_reopen,
                "drop_cache": self.do_drop_cache, "direct_read": self.do_direct_read,
                "direct_write": self.do_direct_write}

    # ---- choosing offsets and lengths ----------------------------------------------
    def near_edge(self) -> int:
        """An offset at or near a multiple of the extent size."""
        edge = self.rng.randrange(1, self.max_size // self.extent_size + 1) * self.extent_size
        r = self.rng.random()
        if r < 0.3:
            delta = self.rng.choice((-1, 0, 1))
        elif r < 0.5:
            delta = self.rng.randrange(-4, 5) * mmap.PAGESIZE
        else:
            delta = self.rng.randrange(-8192, 8192)
        return edge + delta

    def offset(self) -> int:
        r = self.rng.random()
        if r < 0.35:
            off = self.near_edge()
        elif r < 0.55 and self.model:  # near the current end of file
            off = len(self.model) + self.rng.randrange(-65536, 65536)
        else:
            off = self.rng.randrange(self.max_size)
        return max(0, min(self.max_size - 1, off))

    def length(self) -> int:
        r = self.rng.random()
        top = self.max_len
        if r < 0.55 or top <= 16384:
            return self.rng.randrange(1, min(16384, top) + 1)
        if r < 0.9 or top <= 256 * KiB:
            return self.rng.randrange(16384, min(256 * KiB, top) + 1)
        return self.rng.randrange(256 * KiB, top + 1)

    def in_file(self) -> tuple[int, int]:
        """A non-empty range inside the current file (the model must be non-empty)."""
        size = len(self.model)
        off = self.offset() if self.rng.random() < 0.5 else self.rng.randrange(size)
        off = min(off, size - 1)
        return off, min(self.length(), size - off)

    # ---- bookkeeping and checking --------------------------------------------------
    def note(self, text: str, lo: int = -1, hi: int = -1, read: bool = False,
             data: bytes | None = None) -> None:
        self.history.append(_Hist(self.op, text, lo, hi, read, data))
        if not read and 0 <= lo < hi:
            a, b = lo // mmap.PAGESIZE, (hi - 1) // mmap.PAGESIZE + 1
            self.changed_by[a:b] = array("q", [self.op]) * (b - a)
            self.op_text[self.op] = text

    def _last_change(self, at: int) -> str:
        page = at // mmap.PAGESIZE
        if not 0 <= page < len(self.changed_by):
            return ""
        op = self.changed_by[page]
        if op < 0:
            return f"the page of offset {at} was never written\n"
        return (f"the page of offset {at} was last changed by op #{op} "
                f"({self.op_text.get(op, '?')})\n")

    def _whose(self, at: int, got: bytes) -> str:
        """Which recent write put `got` at file offset `at` (if one did)."""
        if not got or not any(got):
            return ""
        for h in reversed(self.history):
            if h.data is not None and h.lo <= at and at + len(got) <= h.hi \
                    and h.data[at - h.lo:at - h.lo + len(got)] == got:
                return f"the bytes read there are those op #{h.op} wrote ({h.text})\n"
        return "the bytes read there match no write in the history below\n"

    def _history_lines(self, bad: int | None) -> list[str]:
        lines = []
        for h in self.history:
            mark = "  "
            if bad is not None and h.lo >= 0 and h.lo <= bad < h.hi:
                mark = "r " if h.read else "* "
            lines.append(f"{mark}#{h.op} {h.text}")
        return lines

    def fail(self, what: str, *, kind: str, offset: int | None = None,
             err: int | None = None, extra: str = "") -> None:
        where = ""
        if offset is not None:
            e = self.extent_size
            where = f" [extent {offset // e} +{offset % e}]"
        legend = f" (* = changed offset {offset}, r = read it)" if offset is not None else ""
        msg = (f"fsx seed {self.seed} op #{self.op}: {what}{where}\n{extra}"
               f"last {len(self.history)} ops{legend}:\n"
               + "\n".join(self._history_lines(offset)))
        raise FsxFailure(msg, seed=self.seed, op=self.op, kind=kind, offset=offset, err=err,
                         history=[f"#{h.op} {h.text}" for h in self.history])

    def model_extend(self, size: int) -> None:
        if size > len(self.model):
            self.model.extend(bytes(size - len(self.model)))

    @staticmethod
    def _first_diff(a: bytes, b: bytes) -> int:
        n = min(len(a), len(b))
        step = 4096
        for base in range(0, n, step):
            if a[base:base + step] != b[base:base + step]:
                for i in range(base, min(n, base + step)):
                    if a[i] != b[i]:
                        return i
        return n

    def compare(self, got: bytes, off: int, how: str) -> None:
        want = bytes(self.model[off:off + len(got)]) if off < len(self.model) else b""
        if got == want:
            return
        n = min(len(got), len(want))
        bad = self._first_diff(got, want)
        # How long the differing run is (up to 16 equal bytes in a row), and what it is.
        end = i = bad
        while i < n:
            if got[i] != want[i]:
                end = i = i + 1
            elif got[i:i + 16] == want[i:i + 16]:
                break
            else:
                i += 1
        ndiff = sum(1 for i in range(bad, n) if got[i] != want[i]) if n - bad < 4 * MiB else -1
        g, w = got[bad:end], want[bad:end]
        if bad >= n:
            shape = f"length differs (read {len(got)} bytes, expected {len(want)})"
        elif not any(g):
            shape = "read zeros where data was expected (a write lost?)"
        elif not any(w):
            shape = "read data where zeros were expected (truncated/hole bytes came back?)"
        else:
            shape = "read other data than expected (stale or misplaced?)"
        extra = (f"{shape}; first run of differing bytes {off + bad}..{off + end} "
                 f"({end - bad} bytes), {ndiff} differing bytes in this read\n")
        if bad < n:
            extra += self._whose(off + bad, bytes(got[bad:min(end, bad + 64)]))
        extra += self._last_change(off + bad)
        self.fail(f"{how} off={off} len={len(got)}: first difference at file offset "
                  f"{off + bad} (got {got[bad:bad + 8].hex() or 'EOF'}, expected "
                  f"{want[bad:bad + 8].hex() or 'EOF'})", kind="mismatch" if bad < n else "short",
                  offset=off + bad, extra=extra)

    def check_size(self) -> None:
        size = os.fstat(self.fd).st_size
        if size != len(self.model):
            self.fail(f"size {size}, expected {len(self.model)}", kind="size",
                      offset=min(size, len(self.model)))

    # ---- ops -------------------------------------------------------------------------
    def do_write(self) -> None:
        off = self.offset()
        n = min(self.length(), self.max_size - off)
        data = self.rng.randbytes(n)
        self.note(f"pwrite off={off} len={n}", off, off + n, data=data)
        done = os.pwrite(self.fd, data, off)
        if done != n:
            self.fail(f"short pwrite at offset {off}: {done} of {n}", kind="short", offset=off)
        self.model_extend(off)
        self.model[off:off + n] = data

    def do_read(self) -> None:
        off = self.offset()
        n = self.length()
        self.note(f"pread off={off} len={n}", off, off + n, read=True)
        self.compare(os.pread(self.fd, n, off), off, "pread")

    def _map(self, off: int, n: int, access: int):
        start = off - off % mmap.ALLOCATIONGRANULARITY
        return start, mmap.mmap(self.fd, off + n - start, offset=start, access=access)

    def do_mmap_read(self) -> None:
        if not self.model:
            return
        off, n = self.in_file()
        self.note(f"mmap read off={off} len={n}", off, off + n, read=True)
        start, m = self._map(off, n, mmap.ACCESS_READ)
        with m:
            got = m[off - start:off - start + n]
        self.compare(got, off, "mmap read")

    def do_mmap_write(self) -> None:
        if not self.model:
            return
        off, n = self.in_file()
        data = self.rng.randbytes(n)
        self.note(f"mmap write off={off} len={n} + msync", off, off + n, data=data)
        start, m = self._map(off, n, mmap.ACCESS_WRITE)
        with m:
            m[off - start:off - start + n] = data
            self.model[off:off + n] = data  # the pages are the file now, msync or not
            m.flush()                       # msync(MS_SYNC) of the whole mapping

    def do_copy_range(self) -> None:
        size = len(self.model)
        if not size:
            return
        for _try in range(8):
            src, n = self.in_file()
            dst = self.offset()
            n = min(n, self.max_size - dst)
            if n > 0 and (dst + n <= src or dst >= src + n):
                break
        else:
            return
        self.note(f"copy_file_range src={src} dst={dst} len={n}", dst, dst + n,
                  data=bytes(self.model[src:src + n]))
        done = 0
        how = "copy_file_range"
        while done < n:
            try:
                got = os.copy_file_range(self.fd, self.fd, n - done, src + done, dst + done)
            except OSError as e:
                if e.errno not in FALLBACK_ERRNOS:
                    raise
                how = f"fallback pread+pwrite ({errno.errorcode[e.errno]})"
                self.counts["copy_range_fallback"] += 1
                self.counts[f"copy_range_fallback:{errno.errorcode[e.errno]}"] += 1
                chunk = os.pread(self.fd, n - done, src + done)
                self.compare(chunk, src + done, "pread (copy_file_range fallback)")
                got = os.pwrite(self.fd, chunk, dst + done)
            if got <= 0:
                self.fail(f"copy_file_range returned {got} after {done} of {n} bytes "
                          f"(source is inside the file)", kind="short", offset=src + done)
            done += got
        if how != "copy_file_range":
            self.history[-1].text += f" [{how}]"
            self.op_text[self.op] = self.history[-1].text
        self.model_extend(dst)
        self.model[dst:dst + n] = self.model[src:src + n]

    def _truncate_size(self) -> int:
        cur = len(self.model)
        r = self.rng.random()
        if r < 0.3:
            size = self.rng.randrange(cur + 1)                 # down, anywhere
        elif r < 0.7:
            size = self.near_edge()                            # at/around a boundary
        else:                                                  # up, by up to two extents
            size = cur + self.rng.randrange(2 * self.extent_size)
        return max(0, min(self.max_size, size))

    def _ftruncate(self, size: int) -> None:
        os.ftruncate(self.fd, size)
        if size < len(self.model):
            del self.model[size:]
        else:
            self.model_extend(size)

    def do_truncate(self) -> None:
        cur = len(self.model)
        size = self._truncate_size()
        if size < cur and self.rng.random() < 0.3:
            # Down and straight back up: the cut range must come back as zeros.
            self.note(f"ftruncate {cur} -> {size} -> {cur} (down and up)", size, cur)
            self._ftruncate(size)
            self.check_size()
            self._ftruncate(cur)
            return
        lo, hi = min(cur, size), max(cur, size)
        self.note(f"ftruncate {cur} -> {size} ({'down' if size < cur else 'up'})", lo, hi)
        self._ftruncate(size)

    def do_fsync(self) -> None:
        data = self.rng.random() < 0.5
        self.note("fdatasync" if data else "fsync")
        (os.fdatasync if data else os.fsync)(self.fd)

    def do_reopen(self) -> None:
        self.note("close+reopen")
        self.reopen()

    def reopen(self, flags: int = os.O_RDWR) -> None:
        fd, self.fd = self.fd, -1
        os.close(fd)  # the fd is gone even if close reports an error
        self.fd = os.open(self.path, flags)

    def do_drop_cache(self) -> None:
        # Clean pages can be dropped; flush first so that is all of them.
        self.note("fsync+drop page cache")
        os.fsync(self.fd)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def do_direct_read(self) -> None:
        from tierfs.direct import DirectFile, open_many
        off = self.offset()
        n = self.length()
        self.note(f"fsync + direct read off={off} len={n}", off, off + n, read=True)
        os.fsync(self.fd)  # what this descriptor wrote is the daemon's now (close-to-open)
        [f] = open_many([self.path], buffering=0)
        with f:
            if not isinstance(f, DirectFile):
                self.fail(f"direct read was served by {type(f).__name__}, not the direct "
                          "path", kind="fallback", offset=off)
            f.seek(off)
            got = bytearray()
            while len(got) < n and (piece := f.read(n - len(got))):
                got += piece
        self.compare(bytes(got), off, "direct read")

    def do_direct_write(self) -> None:
        import tierfs
        from tierfs.direct_writer import DirectWriter
        off = self.offset()
        n = min(self.length(), self.max_size - off)
        data = self.rng.randbytes(n)
        sync = self.rng.random() < 0.3
        self.note(f"fsync + direct write off={off} len={n}" + (" + fsync" if sync else ""),
                  off, off + n, data=data)
        os.fsync(self.fd)
        with tierfs.open(self.path, "r+b", buffering=0) as f:
            if not isinstance(f, DirectWriter):
                self.fail(f"direct write was served by {type(f).__name__}, not the direct "
                          "path", kind="fallback", offset=off)
            # A reader through the mount meanwhile: the kernel caches the old bytes, and
            # after close() it must not serve them (what it reads before may be either).
            os.pread(self.fd, n, off)
            f.seek(off)
            view, done = memoryview(data), 0
            while done < n:
                done += f.write(view[done:])
            os.pread(self.fd, n, off)
            if sync:
                os.fsync(f.fileno())
        self.model_extend(off)
        self.model[off:off + n] = data

    def verify_all(self, how: str, chunk: int = 4 * MiB) -> None:
        self.check_size()
        pos = 0
        while pos < len(self.model):
            got = os.pread(self.fd, chunk, pos)
            if not got:
                self.fail(f"{how}: EOF at {pos}, expected {len(self.model)} bytes", kind="short",
                          offset=pos)
            self.compare(got, pos, how)
            pos += len(got)

    def full_check(self, how: str = "full check") -> None:
        self.note(how)
        os.fsync(self.fd)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        self.verify_all(how)

    # ---- driving ---------------------------------------------------------------------
    def run(self, n_ops: int, *, deadline: float | None = None, progress=None,
            progress_every: int = 1000) -> int:
        """Do n_ops random ops (fewer if `deadline`, a time.monotonic() value, passes).
        Returns the number of ops done; raises FsxFailure on the first disagreement."""
        table = self._ops()
        names = [k for k, w in self.weights.items() if w > 0]
        weights = [self.weights[k] for k in names]
        first = self.ops_done
        for i in range(n_ops):
            self.op = first + i
            name = self.rng.choices(names, weights)[0]
            try:
                table[name]()
                self.check_size()
                if self.check_every and self.op % self.check_every == self.check_every - 1:
                    self.full_check()
            except OSError as e:
                off = self.history[-1].lo if self.history and self.history[-1].op == self.op \
                    else None
                self.fail(f"{name} raised {errno.errorcode.get(e.errno, e.errno)}: {e}",
                          kind="errno", offset=off if off is not None and off >= 0 else None,
                          err=e.errno)
            self.counts[name] += 1
            self.ops_done = self.op + 1
            if progress and self.ops_done % progress_every == 0:
                progress(self)
            if deadline is not None and time.monotonic() > deadline:
                break
        return self.ops_done - first

    def close(self, check: bool = True) -> None:
        """Close the file. close(2) can report a failed writeback (ENOSPC, EIO): with
        `check` that is an FsxFailure, without (cleaning up after one) it is ignored."""
        if self.fd < 0:
            return
        fd, self.fd = self.fd, -1
        try:
            os.close(fd)
        except OSError as e:
            if check:
                self.fail(f"close raised {errno.errorcode.get(e.errno, e.errno)}: {e}",
                          kind="errno", err=e.errno)

    def run_verify_remount(self, n_ops: int, remount, **run_kw) -> None:
        """run(n_ops), a full check, close; remount(); reopen read-only and verify
        the whole file again. `remount` is a callable (e.g. tests.harness.Mount.remount)."""
        try:
            self.run(n_ops, **run_kw)
            self.op = self.ops_done
            self.full_check("final check before remount")
        except BaseException:
            self.close(check=False)
            raise
        self.close()
        remount()
        self.note("remount; final check after remount")
        self.fd = os.open(self.path, os.O_RDONLY)
        try:
            self.verify_all("after remount")
        except BaseException:
            self.close(check=False)
            raise
        self.close()
