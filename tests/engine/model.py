"""Random operations on the data engine, every read checked against a model:
one bytearray per file.

Why a mismatch always means an engine bug (the concurrency design):
- Several trio tasks issue ops at once on a few files. Each file has a
  shared/exclusive lock (RWLock) held by the *driver*, never by the engine.
- Shared ("lane") ops: task t owns lane t, the bytes [t*W, (t+1)*W) of every
  extent (W = E // tasks). Under the shared lock a task reads or writes only
  inside its own lane and below the file size. So lane ops of different tasks
  hit the same extents at the same time (concurrent partial writes, fetches for
  write and for read, reads of one extent) but touch disjoint bytes, and none
  changes the size: the bytes a lane read expects cannot change while it runs.
- Exclusive ops: whatever changes the size or spans lanes (truncate, writes at
  any offset, whole-extent overwrites, cross-lane reads and sequential scans,
  flushing one file).
- Background work is never serialised: uploads, eviction (by any file's writes
  or the explicit evict op), readahead fetches left running by a scan, gc and
  checkpoints interleave with everything across every await.
- With raw faults (no retries) the store's transient errors reach the engine as
  EIO; such an op must have changed nothing (the engine fetches before it
  writes), and the model treats it so. Any other error is a bug.

The seed fixes each task's op sequence; the interleaving also depends on worker
thread timing, so a failure names seed, op index, file, offset and the recent
history of all tasks.
"""
from __future__ import annotations

import collections
import errno
import os
import random
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio

from tierfs.errors import ColdStoreError, FsError
from tierfs.tier import actions
from tierfs.tier.direct_write import DirectWrites

from .harness import Stack, leaves


def _drop_page_cache(paths: list[str]) -> None:
    """Write these files to the disk and drop them from the page cache (blocking)."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue  # evicted meanwhile
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class ModelMismatch(AssertionError):
    pass


class RWLock:
    """Many shared holders or one exclusive; FIFO (trio.Lock is fair), so an
    exclusive op waiting keeps new shared ones out."""

    def __init__(self):
        self._gate = trio.Lock()
        self._readers = 0
        self._idle = trio.Event()
        self._idle.set()

    @asynccontextmanager
    async def shared(self):
        async with self._gate:
            if self._readers == 0:
                self._idle = trio.Event()
            self._readers += 1
        try:
            yield
        finally:
            self._readers -= 1
            if self._readers == 0:
                self._idle.set()

    @asynccontextmanager
    async def exclusive(self):
        async with self._gate:
            await self._idle.wait()
            yield


@dataclass
class File:
    name: str
    ino: int
    data: bytearray
    lock: RWLock
    versions: dict = field(default_factory=dict)  # extent -> recent (op, content)


@dataclass
class Config:
    seed: int
    tasks: int = 4
    files: int = 3
    ops: int = 400          # in all, over all tasks
    max_extents: int = 16   # no file grows past this many extents
    eio_ok: bool = False    # raw faults: EIO allowed, and must change nothing
    outages: bool = False   # toggle a short bucket outage now and then


# op name -> weight
MIX = {"lane_write": 30, "lane_read": 30, "write": 8, "whole": 6, "truncate": 8, "read": 6,
       "scan": 4, "scan_overwrite": 3, "truncate_rewrite": 3, "fsync": 2, "flush_file": 2,
       "flush_all": 1, "checkpoint": 1, "evict": 2, "direct_write": 4, "hint": 3,
       "forget_checks": 2}
FAILED = object()


class _Entry(list):
    """One line of op history (what, args, outcome); .op = (index, task, file)."""
    op: tuple


class Driver:
    def __init__(self, stack: Stack, cfg: Config):
        self.s = stack
        self.cfg = cfg
        self.E = stack.E
        self.max_size = cfg.max_extents * self.E
        self.files: list[File] = []
        self.history: collections.deque[list] = collections.deque(maxlen=40)
        self.direct = DirectWrites(stack.engine)
        self.n = 0
        self.counts: collections.Counter[str] = collections.Counter()

    # ---- running --------------------------------------------------------------
    async def run(self) -> None:
        rng = random.Random(f"{self.cfg.seed}/setup")
        for k in range(self.cfg.files):
            f = File(f"m{k}", self.s.create(f"m{k}"), bytearray(), RWLock())
            self.files.append(f)
            # Start from files a few times the hot tier: most of each is cold soon.
            size = rng.randint(self.cfg.max_extents // 2, self.cfg.max_extents) * self.E
            for off in range(0, size, self.E):
                await self._write(rng, -1, -1, f, off, self.E, "fill")
        try:
            async with trio.open_nursery() as nursery:
                if self.cfg.outages:
                    nursery.start_soon(self._outages)
                async with trio.open_nursery() as tasks:
                    for t in range(self.cfg.tasks):
                        tasks.start_soon(self._task, t)
                nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:  # the first mismatch says it all
            first = next((e for e in leaves(group) if isinstance(e, ModelMismatch)), None)
            if first is None:
                raise
            raise first from None
        self.s.faulty.outage = False
        await self.final_check()

    async def _task(self, t: int) -> None:
        rng = random.Random(f"{self.cfg.seed}/{t}")
        kinds, weights = list(MIX), list(MIX.values())
        while self.n < self.cfg.ops:
            i = self.n
            self.n += 1
            f = rng.choice(self.files)
            kind = rng.choices(kinds, weights)[0]
            self.counts[kind] += 1
            await getattr(self, "op_" + kind)(rng, i, t, f)

    async def _outages(self) -> None:
        rng = random.Random(f"{self.cfg.seed}/outages")
        while True:
            await trio.sleep(rng.uniform(0.2, 0.5))
            self.s.faulty.outage = True
            await trio.sleep(rng.uniform(0.05, 0.2))
            self.s.faulty.outage = False

    async def final_check(self) -> None:
        """Everything uploaded, then every byte read back from the bucket."""
        s = self.s
        s.faulty.fail_rate = 0.0
        with trio.move_on_after(10):
            await s.uploader.flush(None)
        stuck = [s.describe(*key) for key in s.engine.index.dirty]
        assert not stuck, "final flush: extents still dirty after 10 s:\n" + "\n".join(stuck)
        for f in self.files:
            assert s.size(f.ino) == len(f.data), f"{f.name}: size {s.size(f.ino)} != model"
            s.evict_all()
            await self._read(-1, -1, f, 0, len(f.data) + 1, "final cold read")
            await self._read(-1, -1, f, 0, len(f.data) + 1, "final read")

    # ---- lanes ------------------------------------------------------------------
    def _pick_extent(self, rng: random.Random, f: File, last: int) -> int:
        """Favour a few extents (so tasks meet on them) and cold ones."""
        r = rng.random()
        if r < 0.3:
            cold = [i for i, x in self.s.meta.all_extents(f.ino).items()
                    if i <= last and not x.hot]
            if cold:
                return rng.choice(cold)
        if r < 0.65:
            return rng.randint(0, min(2, last))
        return rng.randint(0, last)

    def _lane(self, rng: random.Random, t: int, f: File) -> tuple[int, int] | None:
        size = len(f.data)
        if size == 0:
            return None
        idx = self._pick_extent(rng, f, (size - 1) // self.E)
        w = self.E // self.cfg.tasks
        lo = idx * self.E + t * w
        hi = min(size, idx * self.E + (self.E if t == self.cfg.tasks - 1 else (t + 1) * w))
        if lo >= hi:
            return None
        off = rng.randrange(lo, hi)
        return off, rng.randint(1, hi - off)

    async def op_lane_write(self, rng, i, t, f):
        async with f.lock.shared():
            r = self._lane(rng, t, f)
            if r:
                await self._write(rng, i, t, f, *r, "lane_write")

    async def op_lane_read(self, rng, i, t, f):
        async with f.lock.shared():
            r = self._lane(rng, t, f)
            if r:
                await self._read(i, t, f, *r, "lane_read")

    # ---- exclusive ops ------------------------------------------------------------
    async def op_write(self, rng, i, t, f):
        async with f.lock.exclusive():
            off = rng.randrange(0, min(len(f.data) + self.E, self.max_size))
            n = rng.choice([rng.randint(1, 4096), rng.randint(1, 2 * self.E)])
            await self._write(rng, i, t, f, off, min(n, self.max_size - off), "write")

    async def op_whole(self, rng, i, t, f):
        async with f.lock.exclusive():
            last = min(len(f.data) // self.E, self.cfg.max_extents - 1)
            idx = self._pick_extent(rng, f, last)
            await self._write(rng, i, t, f, idx * self.E, self.E, "whole")

    async def op_truncate(self, rng, i, t, f):
        async with f.lock.exclusive():
            base = rng.randint(0, self.cfg.max_extents) * self.E
            delta = rng.choice([0, 0, 1, -1, rng.randint(-100, 100), rng.randrange(self.E)])
            size = max(0, min(self.max_size, base + delta))
            entry = self._log(i, t, f, "truncate", size, len(f.data))
            if await self._call(entry, f"truncate to {size}",
                                self.s.engine.truncate(f.ino, size)) is FAILED:
                return
            old = len(f.data)
            if size < old:
                del f.data[size:]
            else:
                f.data.extend(bytes(size - old))
            self._changed(i, f, min(size, old), max(size, old))
            self._check_size(i, t, f, "truncate")

    async def op_read(self, rng, i, t, f):
        async with f.lock.exclusive():
            off = rng.randrange(0, len(f.data) + self.E)
            await self._read(i, t, f, off, rng.randint(1, 3 * self.E), "read")
            self._check_size(i, t, f, "read")

    async def op_scan(self, rng, i, t, f):
        """Sequential reads from 0 (readahead), often stopping early so prefetches
        are still in flight when the next op on the file comes."""
        async with f.lock.exclusive():
            stop = len(f.data) if rng.random() < 0.4 else rng.randint(0, len(f.data))
            chunk = rng.choice([self.E // 2, self.E, 3 * self.E // 2])
            for off in range(0, max(stop, 1), chunk):
                await self._read(i, t, f, off, chunk, "scan")

    async def op_scan_overwrite(self, rng, i, t, f):
        """Read sequentially up to extent k, then overwrite extent k+1 whole while
        its readahead fetch is likely still in flight; read it back."""
        async with f.lock.exclusive():
            n = len(f.data) // self.E
            if n < 2:
                return
            k = rng.randrange(0, n - 1)
            for off in range(0, (k + 1) * self.E, self.E):
                await self._read(i, t, f, off, self.E, "scan_overwrite")
            await self._write(rng, i, t, f, (k + 1) * self.E, self.E, "scan_overwrite")
            await self._read(i, t, f, (k + 1) * self.E, self.E, "scan_overwrite")

    async def op_truncate_rewrite(self, rng, i, t, f):
        """Drop the last extents (their uploads may be in flight) and write each
        again once: the same number of writes as a freshly filled extent had."""
        async with f.lock.exclusive():
            n = len(f.data) // self.E
            if n < 1:
                return
            k = rng.randrange(max(0, n - 3), n)
            entry = self._log(i, t, f, "truncate_rewrite", k * self.E, len(f.data))
            if await self._call(entry, f"truncate to {k * self.E}",
                                self.s.engine.truncate(f.ino, k * self.E)) is FAILED:
                return
            old = len(f.data)
            del f.data[k * self.E:]
            self._changed(i, f, k * self.E, old)
            for idx in range(k, n):
                await self._write(rng, i, t, f, idx * self.E, self.E, "truncate_rewrite")

    async def op_direct_write(self, rng, i, t, f):
        """A direct writer (tierfs.open for writing), as the client does it: hold a
        range, pwrite into the extent files granted with awaits in between (uploads,
        evictions, fsync interleave), release them, hold the rest; it never waits for
        room while it holds extents. A hold that fails (EIO under raw faults) ends the
        op: what was written before it is the file's."""
        E = self.E
        async with f.lock.exclusive():
            off = rng.randrange(0, min(len(f.data) + E, self.max_size - 1))
            n = rng.randint(1, min(3 * E, self.max_size - off))
            data = rng.randbytes(n)
            entry = self._log(i, t, f, "direct_write", off, n)
            last = (off + n - 1) // E
            pos = off
            while pos < off + n:
                got = await self._call(entry, f"direct_write: hold {pos // E}-{last}",
                                       self.direct.hold(f.ino, pos // E, last, os.O_RDWR))
                if got is FAILED:
                    break
                held = dict(got)
                try:
                    while pos < off + n and pos // E in held:
                        idx, at = divmod(pos, E)
                        piece = data[pos - off:min(off + n, (idx + 1) * E) - off]
                        os.pwrite(held[idx], piece, at)
                        pos += len(piece)
                        if rng.random() < 0.2:
                            await self.s.engine.fsync(f.ino)  # settles what is held so far
                        else:
                            await trio.sleep(0)
                finally:
                    for fd in held.values():
                        os.close(fd)
                    self.direct.release(f.ino, sorted(held))
            if pos == off:
                return
            if off > len(f.data):
                f.data.extend(bytes(off - len(f.data)))
            f.data[off:pos] = data[:pos - off]
            self._changed(i, f, off, pos)
            self._check_size(i, t, f, "direct_write")

    async def op_flush_file(self, rng, i, t, f):
        async with f.lock.exclusive():  # nobody dirties it meanwhile: flush ends
            self._log(i, t, f, "flush_file")
            await self.s.uploader.flush({f.ino})

    # ---- ops on everything (no lock) ---------------------------------------------------
    async def op_fsync(self, rng, i, t, f):
        ino = f.ino if rng.random() < 0.7 else None
        self._log(i, t, f, "fsync", ino)
        await self.s.engine.fsync(ino)

    async def op_flush_all(self, rng, i, t, f):
        self._log(i, t, f, "flush_all")
        with trio.move_on_after(1.0):  # other tasks keep dirtying: flush(None) may not end
            await self.s.uploader.flush(None)

    async def op_checkpoint(self, rng, i, t, f):
        self._log(i, t, f, "checkpoint")
        try:
            await self.s.checkpointer.checkpoint()
        except ColdStoreError:
            if not (self.cfg.eio_ok or self.cfg.outages):
                raise

    async def op_hint(self, rng, i, t, f):
        """A hinted prefetch of this file with every file wanted: its GET brings along
        the packed extents of other files, which other tasks may be writing meanwhile."""
        async with f.lock.exclusive():
            entry = self._log(i, t, f, "hint")
            await self._call(entry, "hinted prefetch", actions.prefetch(
                self.s.engine, f.ino, parallel=2, for_write=False, wanted=lambda ino: True))

    async def op_forget_checks(self, rng, i, t, f):
        """What a new mount starts with: no hot copy checked yet, and this file's
        copies written out of the page cache; then a scan of the file, whose reads
        check its copies against their records again (inline where readahead cached
        them, else in worker threads) while the other tasks go on."""
        self._log(i, t, f, "forget_checks")
        self.s.forget_checks()
        paths = [self.s.hot.path(f.ino, idx) for idx in self.s.engine.index.indices(f.ino)]
        await trio.to_thread.run_sync(_drop_page_cache, paths)
        await self.op_scan(rng, i, t, f)

    async def op_evict(self, rng, i, t, f):
        self._log(i, t, f, "evict", self.s.evict_all())

    # ---- engine calls, checked ---------------------------------------------------------
    async def _write(self, rng, i, t, f, off, n, what):
        data = rng.randbytes(n)
        entry = self._log(i, t, f, what, off, n)
        got = await self._call(entry, f"{what}: write {off}+{n}",
                               self.s.engine.write(f.ino, off, data))
        if got is FAILED:
            return
        if got != n:
            self._fail(i, t, f, off, f"{what}: write {off}+{n} returned {got}")
        if off > len(f.data):
            f.data.extend(bytes(off - len(f.data)))
        f.data[off:off + n] = data
        self._changed(i, f, off, off + n)

    async def _read(self, i, t, f, off, n, what):
        entry = self._log(i, t, f, what, off, n)
        got = await self._call(entry, f"{what}: read {off}+{n}",
                               self.s.engine.read(f.ino, off, n))
        if got is FAILED:
            return
        expected = f.data[off:off + n]
        if bytes(got) != bytes(expected):
            got = bytes(got)
            k = next((k for k, (a, b) in enumerate(zip(got, expected)) if a != b),
                     min(len(got), len(expected)))
            at = (off + k) // self.E * self.E  # compare from the extent's start on
            start = max(off, at)
            self._fail(i, t, f, off + k,
                       f"{what}: read {off}+{n}: got {len(got)} bytes, expected {len(expected)}; "
                       f"first difference at file offset {off + k}: got {got[k:k + 8].hex()} "
                       f"expected {bytes(expected[k:k + 8]).hex()}; "
                       + self._which_version(f, start, got[start - off:]))

    async def _call(self, entry, what, coro):
        """Await an engine call; EIO under raw faults is FAILED, any other error a bug."""
        try:
            return await coro
        except FsError as e:
            if self.cfg.eio_ok and e.errno == errno.EIO:
                entry.append("-> EIO")
                self.counts["EIO"] += 1
                return FAILED
            i, t, f = entry.op
            self._fail(i, t, f, None, f"{what} failed: {e!r} "
                       f"(errno {errno.errorcode.get(e.errno, e.errno)})", cause=e)

    def _check_size(self, i, t, f, what):
        if self.s.size(f.ino) != len(f.data):
            self._fail(i, t, f, None, f"after {what}: engine size {self.s.size(f.ino)}, "
                       f"model {len(f.data)}")

    def _log(self, i, t, f, *what) -> "_Entry":
        entry = _Entry([f"#{i} task {t} {f.name}:", *what])
        entry.op = (i, t, f)
        self.history.append(entry)
        return entry

    def _changed(self, i, f, lo, hi):
        """Remember the content of extents [lo, hi) after op i (for diagnosis)."""
        E = self.E
        for idx in range(lo // E, min(hi, self.max_size) // E + 1):
            f.versions.setdefault(idx, collections.deque(maxlen=8)).append(
                (i, bytes(f.data[idx * E:(idx + 1) * E])))

    def _which_version(self, f, off, got) -> str:
        """Which earlier content of the extent at `off` a wrong read returned."""
        E = self.E
        idx = off // E
        hi = min(len(got), (idx + 1) * E - off)
        for i, content in reversed(f.versions.get(idx, ())):
            old = content[off - idx * E:off - idx * E + hi]
            if got[:hi] == old + bytes(hi - len(old)):
                return f"the bytes read are extent {idx}'s content after op #{i}"
        return f"the bytes read match none of extent {idx}'s last contents"

    def _fail(self, i, t, f, off, problem, cause=None):
        lines = [f"seed {self.cfg.seed} op #{i} task {t} file {f.name} (ino {f.ino}) "
                 f"offset {off}: {problem}"]
        if off is not None:
            idx = off // self.E
            lines.append(self.s.describe(f.ino, idx))
        lines.append(self.s.describe_space())
        lines.append("recent ops, oldest first:")
        lines += ["  " + " ".join(map(str, h)) for h in self.history]
        raise ModelMismatch("\n".join(lines)) from cause
