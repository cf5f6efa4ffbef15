"""The data engine without FUSE: the stack runtime.Daemon.prepare builds (meta,
hot, engine, space, uploader, gc, checkpointer) over an in-memory bucket, with
its background tasks running in a trio nursery.

All wiring lives in engine_stack(): constructors in tierfs/tier change, and this
is the one place to follow them.
"""
from __future__ import annotations

import logging
import os
import stat
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio

from tierfs.cold.faulty import FaultyStore
from tierfs.cold.memory import MemoryStore
from tierfs.cold.retry import RetryingStore
from tierfs.errors import ColdStoreError
from tierfs.hot import HotStore
from tierfs.meta import MetaStore
from tierfs.meta.schema import ROOT_INO, SUPERBLOCK_OBJECT, Superblock
from tierfs.tier.checkpoint import Checkpointer
from tierfs.tier.compact import Compactor
from tierfs.tier.engine import Engine
from tierfs.tier.gc import GarbageCollector
from tierfs.tier.space import Space
from tierfs.tier.uploader import Uploader

KiB = 1024
MAX_HOLD_S = 10.0  # a held store call gives up waiting, so a broken test cannot hang


class Hold:
    """Calls of one kind (op, key prefix) wait in their worker thread until release()."""

    def __init__(self, op: str, prefix: str):
        self.op, self.prefix = op, prefix
        self.entered = 0   # calls that reached the hold (in flight now or before)
        self.returned = 0  # held calls that went on after the release
        self._go = threading.Event()
        self._lock = threading.Lock()

    def wait(self) -> None:
        """In a worker thread: count this call in, wait for release()."""
        with self._lock:
            self.entered += 1
        self._go.wait(MAX_HOLD_S)
        with self._lock:
            self.returned += 1

    def release(self) -> None:
        self._go.set()

    @property
    def released(self) -> bool:
        return self._go.is_set()


class Gate:
    """Object-store wrapper that can hold calls in flight: the deterministic way
    to make "an upload/fetch is in flight while X happens" true."""

    def __init__(self, inner):
        self.inner = inner
        self._holds: list[Hold] = []
        self._lock = threading.Lock()

    def hold(self, op: str, prefix: str = "data/") -> Hold:
        h = Hold(op, prefix)
        with self._lock:
            self._holds.append(h)
        return h

    def release_all(self) -> None:
        with self._lock:
            for h in self._holds:
                h.release()

    def _pass(self, op: str, key: str) -> None:
        with self._lock:
            mine = [h for h in self._holds
                    if h.op == op and key.startswith(h.prefix) and not h.released]
        for h in mine:
            h.wait()

    def put(self, key, data):
        self._pass("put", key)
        self.inner.put(key, data)

    def get(self, key, offset=0, length=None):
        self._pass("get", key)
        return self.inner.get(key, offset, length)

    def put_file(self, key, f):
        self._pass("put", key)
        self.inner.put_file(key, f)

    def get_file(self, key, f, offset=0):
        self._pass("get", key)
        return self.inner.get_file(key, f, offset)

    def delete(self, key):
        self._pass("delete", key)
        self.inner.delete(key)

    def list(self, prefix=""):
        return self.inner.list(prefix)

    def size(self, key):
        return self.inner.size(key)

    def check(self):
        self.inner.check()

    def describe(self):
        return f"gate+{self.inner.describe()}"


class LogRecords(logging.Handler):
    """WARNING and worse from the tierfs loggers, to assert on."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def unexpected(self, allowed: tuple[str, ...] = ()) -> list[str]:
        out = []
        for r in self.records:
            msg = r.getMessage()
            if r.levelno >= logging.ERROR and not any(a in msg for a in allowed):
                out.append(f"{r.levelname} {r.name}: {msg}" + (f"\n{r.exc_text}" if r.exc_text
                                                               else ""))
        return out


@dataclass
class Stack:
    engine: Engine
    space: Space
    uploader: Uploader
    gc: GarbageCollector
    checkpointer: Checkpointer
    meta: MetaStore
    hot: HotStore
    cold: object          # what the engine talks to
    faulty: FaultyStore
    gate: Gate
    memory: MemoryStore
    logs: LogRecords
    E: int
    nursery: trio.Nursery
    names: int = field(default=0)

    def create(self, name: str | None = None) -> int:
        """A new empty regular file in the root; its inode number."""
        self.names += 1
        name = name or f"f{self.names}"
        node = self.meta.create_node(ROOT_INO, name.encode(), stat.S_IFREG | 0o644, 0, 0)
        return node.ino

    def size(self, ino: int) -> int:
        return self.meta.get_inode(ino).size

    def record(self, ino: int, idx: int):
        return self.meta.get_extents(ino, idx, idx)[1].get(idx)

    def fetches_in_flight(self) -> int:
        return len(self.engine._fetching)

    def hold_hot_installs(self) -> Hold:
        """Make fetched copies wait in their worker thread before they are written
        to the hot tier: while held, their room stays reserved."""
        h = Hold("hot-install", "")
        hot = self.hot
        names = [name for name in ("write_temp", "write_temps", "store_whole")  # older engines
                 if hasattr(hot, name)][:2]
        for name in names:
            inner = getattr(hot, name)

            def held(*args, inner=inner):
                h.wait()
                return inner(*args)

            setattr(hot, name, held)
        with self.gate._lock:
            self.gate._holds.append(h)  # released with the others at exit
        return h

    def forget_checks(self) -> None:
        """What a new mount starts with: every clean hot copy is to be checked against
        its record on its next read."""
        index = self.engine.index
        for key in list(index.sizes):
            index.uncheck(key)

    def hold_hot_checks(self) -> tuple[Hold, Hold]:
        """Make the worker-thread checks of hot copies against their records wait
        twice: before they open the extent file, and after they have read it."""
        before, after = Hold("hot-check-before", ""), Hold("hot-check-after", "")
        inner = self.hot.copy_matches

        def held(*args):
            before.wait()
            try:
                return inner(*args)
            finally:
                after.wait()

        self.hot.copy_matches = held
        with self.gate._lock:
            self.gate._holds += [before, after]  # released with the others at exit
        return before, after

    def drop_page_cache(self, ino: int, idx: int) -> None:
        """Push an extent file to the disk and out of the page cache, as a remount
        after a cache drop finds it: its first read is checked in a worker thread."""
        fd = os.open(self.hot.path(ino, idx), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def evict_all(self) -> int:
        """Drop every clean, unpinned, idle extent from the hot tier."""
        return self.space.evict(self.space.high + self.E)

    def describe_space(self) -> str:
        idx, sp = self.engine.index, self.space
        return (f"hot tier: {idx.total} bytes of {sp.high} (+{sp.reserved} reserved for "
                f"fetches), {len(idx.dirty)} dirty, {len(idx.lru)} evictable, "
                f"{len(self.engine.busy)} busy, {self.fetches_in_flight()} fetches and "
                f"{len(self.uploader.in_flight)} uploads in flight")

    def describe(self, ino: int, idx: int) -> str:
        """One extent's state everywhere, for failure messages."""
        key = (ino, idx)
        dirty = self.engine.index.dirty.get(key)
        return (f"extent ({ino},{idx}): record={self.record(ino, idx)} "
                f"hot_size={self.engine.index.sizes.get(key)} "
                f"dirty_gen={dirty.gen if dirty else None} "
                f"uploading={key in self.uploader.in_flight} "
                f"fetching={key in self.engine._fetching} busy={key in self.engine.busy}")


async def until(pred, timeout: float = 5.0, what: str = "condition") -> None:
    """Wait for observable state, polling; fails the test after `timeout`."""
    try:
        with trio.fail_after(timeout):
            while not pred():
                await trio.sleep(0.01)
    except trio.TooSlowError:
        raise AssertionError(f"timed out after {timeout}s waiting for {what}") from None


async def settle(stack: Stack, timeout: float = 5.0) -> None:
    """Everything uploaded, no upload or fetch in flight."""
    await until(lambda: not stack.engine.index.dirty and not stack.uploader.in_flight
                and not stack.fetches_in_flight(), timeout, "uploads to settle")


async def _checkpoints(checkpointer: Checkpointer, every: float) -> None:
    while True:
        await trio.sleep(every)
        try:
            await checkpointer.checkpoint()
        except ColdStoreError:
            pass  # faults: the next one retries, as Checkpointer.run does


@asynccontextmanager
async def engine_stack(tmp_path, *, extent_size: int, cache_size: int, upload_delay: float,
                       faults: dict | None = None, seed: int = 0, retry_timeout: float = 5.0,
                       upload_parallel: int = 4, gc_interval: float = 0.05,
                       checkpoint_every: float = 0.25, checkpoint_keep: int = 2,
                       allowed_errors: tuple[str, ...] = (), pack_below: int = 0,
                       pack_size: int = 64 << 20, compact_dead: float = 1.0,
                       bucket=None):
    """The engine stack of Daemon.prepare + Daemon._background, FUSE-free.

    faults: FaultyStore attributes (fail_rate, latency_s, ...) set once the stack
    runs. retry_timeout: RetryingStore budget as the daemon has it; 0 = none, so
    transient faults reach the engine. A body that ends well fails if the engine
    logged an ERROR (a swallowed exception in the uploader, a lost hot file...)
    that contains none of `allowed_errors`. pack_below, pack_size: the uploader's
    packing of small files (off unless asked for); compact_dead: compaction of packs
    this dead (1: none), every 50 ms, unbounded rate. bucket: the store under the
    faults (a MemoryStore unless given; Stack.memory either way)."""
    tmp = str(tmp_path)
    memory = MemoryStore() if bucket is None else bucket
    faulty = FaultyStore(memory, seed=seed)
    gate = Gate(faulty)
    cold = RetryingStore(gate, timeout=retry_timeout, base=0.005, cap=0.05) \
        if retry_timeout else gate
    sb = Superblock(fs_id=f"engine-test-{seed}", extent_size=extent_size,
                    created_ns=time.time_ns())
    memory.put(SUPERBLOCK_OBJECT, sb.encode())
    meta = MetaStore(os.path.join(tmp, "meta"), map_size=1 << 30)
    meta.format(sb, os.getuid(), os.getgid())
    hot = HotStore(os.path.join(tmp, "hot"))
    logs = LogRecords()
    logger = logging.getLogger("tierfs")
    logger.addHandler(logs)
    try:
        engine = Engine(meta, hot, cold, extent_size)
        assert engine.load_index() == []
        space = Space(engine, cache_size=cache_size, min_free=0)
        engine.space = space
        uploader = Uploader(engine, space, delay=upload_delay, parallel=upload_parallel,
                            pack_below=pack_below, pack_size=pack_size)
        gc = GarbageCollector(engine, interval=gc_interval)
        compactor = Compactor(engine, dead_share=compact_dead, rate=1 << 40,
                              pack_size=pack_size, interval=0.05)
        checkpointer = Checkpointer(engine, tmp, interval=0, keep=checkpoint_keep)
        checkpointer.load()
        async with trio.open_nursery() as nursery:
            engine.nursery = nursery  # readahead runs here
            nursery.start_soon(uploader.run)
            nursery.start_soon(gc.run)
            nursery.start_soon(compactor.run)
            if checkpoint_every:
                nursery.start_soon(_checkpoints, checkpointer, checkpoint_every)
            for name, value in (faults or {}).items():
                assert hasattr(faulty, name), name
                setattr(faulty, name, value)
            stack = Stack(engine, space, uploader, gc, checkpointer, meta, hot, cold, faulty,
                          gate, memory, logs, extent_size, nursery)
            try:
                yield stack
                unexpected = logs.unexpected(allowed_errors)
                assert not unexpected, "engine logged errors:\n" + "\n".join(unexpected)
            finally:
                # Held or failing store calls would keep worker threads (which trio
                # cannot cancel) and so the nursery alive.
                faulty.outage, faulty.fail_rate, faulty.latency_s = False, 0.0, 0.0
                faulty.denied = False
                gate.release_all()
                nursery.cancel_scope.cancel()
    finally:
        logger.removeHandler(logs)
        hot.close()
        meta.close()


def run(async_fn, *args, timeout: float = 20.0):
    """trio.run with a bound; a lone exception out of the nurseries is unwrapped
    so pytest shows the assertion itself."""
    async def bounded():
        with trio.fail_after(timeout):
            return await async_fn(*args)
    try:
        return trio.run(bounded)
    except BaseExceptionGroup as group:
        found = leaves(group)
        if len(found) == 1:
            raise found[0] from None
        raise


def leaves(group: BaseExceptionGroup) -> list[BaseException]:
    """The exceptions inside nested groups."""
    out = []
    for e in group.exceptions:
        out += leaves(e) if isinstance(e, BaseExceptionGroup) else [e]
    return out
