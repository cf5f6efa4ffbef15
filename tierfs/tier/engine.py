"""The data engine: read, write, truncate and fsync by (inode, offset) over
fixed-size extents that live on the hot tier, in the bucket, or both.

Runs on the trio thread. Hot-tier preads/pwrites are inline (page-cache fast);
object store calls, fsync and checksums of whole extents go to worker threads.
After every await the extent record is read again: it may have changed.
"""
from __future__ import annotations

import errno
import logging
import os
import stat
import time
from dataclasses import replace

import trio

from ..checksum import hot_copy_matches, object_matches
from ..errors import (ChecksumMismatch, ColdStoreError, ColdUnavailable, FsError,
                      ObjectNotFound)
from ..hot import HotStore, pagecache
from ..meta import MetaStore, scan
from ..meta.schema import DIRTY, HOT, Extent, Inode, object_name
from .cache import HotIndex, Key
from .meta_sync import MetaSync
from .state import NodeState
from .stats import Stats

log = logging.getLogger(__name__)

# Clean hot extents up to this size are verified on the trio thread when their file is
# in the page cache: hashing 1 MiB (xxh3) costs less than the worker-thread hop it saves
# on the first read after mount (a data loader reading small files pays it per file).
INLINE_VERIFY_MAX = 1 << 20


# A miss of a packed extent also fetches the cold neighbours packed in the same window of
# this many bytes (aligned to it, aligned_window) in the same GET, while the hot tier has room.
READ_AROUND = 4 << 20
READ_AROUND_EXTENTS = 256  # and at most this many: each costs a record read on this thread

# A fetch for hints (or a prefetch of many files) also fetches the wanted extents packed
# next to it without a gap within its aligned window of WANTED_SPAN bytes, in one GET: a
# random epoch order then costs about one GET per window of a pack, not one per file.
WANTED_SPAN = 8 << 20
WANTED_SPAN_EXTENTS = 1024
WANTED_GAP = 256 << 10  # dead bytes between two wanted pieces read along, at most
REFS_CHUNK = 512 << 10  # of a pack's references read at a time while looking for a run
# Neighbours fetched along (read-around and wanted) and not installed yet, at most: the
# memory they hold while their GETs run and their installs wait. A cold epoch's hinted
# GETs run far ahead of the installs; when this is used up, a fetch reads only its own
# extent, one GET each, which costs more per file than a wide GET.
NEIGHBOURS_IN_MEMORY = 128 << 20
# Worker threads installing fetched neighbours at once (each hands its run to a copy
# writer process of the hot store's, which has as many): the rest of the I/O threads
# stay free for the extents readers are waiting for.
AROUND_INSTALL_THREADS = 2
# Extent records one part of a shrinking truncate drops, at most (and no more than the
# store's purge_batch): each hot copy dropped costs a rename on this thread (20-45 us
# on a test VM's ext4), so parts of 4,096 held the mount for 170-230 ms, of 512 ~20 ms.
SHRINK_BATCH = 512


def aligned_window(offset: int, size: int) -> tuple[int, int]:
    """The `size` bytes of a pack, aligned to `size`, that hold `offset`. A fetch reads
    along only the pieces that start in its own extent's window: windows around files
    of a random order then never overlap, nor leave slivers between them that would
    each cost a GET of their own."""
    lo = offset - offset % size
    return lo, lo + size


class _Moved(Exception):
    """A fetched extent's record changed during the GET (its object may be gone)."""


class _Fetch:
    """One extent on its way from the bucket; readers that see the record being fetched
    (`ext`) wait for it and share its bytes; one that sees a newer record (the extent
    was rewritten, uploaded and evicted during the GET) fetches that on its own.
    `ready`: the bytes are verified (or the GET failed: data None); `done`: installed on
    the hot tier, or given up. Readers need only `ready`; writers wait for `done`.
    `failed`: the error the GET ended with, which those that waited for it get too (a
    GET of their own would make the last of n readers of a silent bucket wait n
    --cold-timeouts)."""
    __slots__ = ("ready", "done", "data", "ext", "failed")

    def __init__(self, ext: Extent):
        self.ready = trio.Event()
        self.done = trio.Event()
        self.data: bytes | None = None
        self.ext = ext
        self.failed: FsError | None = None

    def finish(self) -> None:
        self.ready.set()
        self.done.set()


def kill_suid(mode: int) -> int:
    """Mode after a write/truncate/chown: setuid goes, setgid too if group-executable."""
    mode &= ~stat.S_ISUID
    if mode & stat.S_IXGRP:
        mode &= ~stat.S_ISGID
    return mode


class Engine:
    def __init__(self, meta: MetaStore, hot: HotStore, cold, extent_size: int,
                 stats: Stats | None = None, s3_threads: int = 32, io_threads: int = 8,
                 *, cold_timeout: float = 30.0, state: NodeState | None = None):
        self.meta = meta
        self.hot = hot
        self.cold = cold
        self.E = extent_size
        self.stats = stats or Stats()
        self.state = state or NodeState()
        self.cold_timeout = cold_timeout  # no reader waits longer for the bucket
        self.index = HotIndex()
        self.s3_limiter = trio.CapacityLimiter(s3_threads)
        self.io_limiter = trio.CapacityLimiter(io_threads)
        self.meta_sync = MetaSync(meta, self.io_limiter)
        self._writeback_limiter = trio.CapacityLimiter(2)
        self._around_limiter = trio.CapacityLimiter(AROUND_INSTALL_THREADS)
        self.read_around = READ_AROUND  # bytes of a pack fetched around a miss (0: none)
        self._fetching: dict[Key, _Fetch] = {}
        self._neighbour_bytes = 0  # of neighbours fetched along, until installed
        self.on_miss = lambda ino: None  # a read had to wait for the bucket (hints adapt)
        # Background work on the trio thread awaits this before each step: the mount
        # makes it wait while FUSE requests are queued (fs/request_wait.py).
        self.give_way = trio.lowlevel.checkpoint
        self.gc_guard = lambda epoch: True  # may an object dropped in `epoch` go?
        self.busy: set[Key] = set()  # extents being changed: never evicted meanwhile
        # Clean hot copies found at mount are checked on their first read
        # (index.unchecked); those being checked now:
        self._verifying: dict[Key, trio.Event] = {}
        self._copy_let_go: set[Key] = set()  # of those, let go while being checked
        self.verify_hot = True
        self.space = None  # set by the tiering layer: awaits room on the hot tier
        # With the kernel's writeback cache the kernel owns mtime/ctime of written
        # files and sends them with setattr; stamping our own on every write would
        # differ from the kernel's and make it drop the file's page cache.
        self.kernel_times = False
        self.nursery = None  # set once background tasks run: readahead lives there
        self.readahead_max = 16  # extents ahead of a sequential reader
        # ino -> [next offset, window, extent being read, last extent already read ahead]
        self._streams: dict[int, list[int]] = {}

    @property
    def fetches_in_flight(self) -> int:
        """Extents on their way from the bucket, their installs included."""
        return len(self._fetching)

    # ---- startup ----------------------------------------------------------------
    def load_index(self) -> list[str]:
        """Rebuild the in-memory hot index from metadata and the hot directory.
        Returns human-readable problems found (missing hot files)."""
        problems = []
        on_disk = {(ino, idx): (size, mtime) for ino, idx, size, mtime in self.hot.scan()}
        fixes: dict[Key, Extent | None] = {}
        past_end: dict[Key, None] = {}
        gc = []
        file_sizes: dict[int, int | None] = {}  # of the inodes with dirty extents
        now_mono, now_wall = time.monotonic(), time.time()
        for ino, idx, ext in scan.extents(self.meta):
            key = (ino, idx)
            size, mtime = on_disk.pop(key, (None, 0.0))
            if ext.hot and ext.dirty:
                room = self._room_in_file(ino, idx, file_sizes)
                if room is not None and room <= 0:
                    # Held by a direct writer when the last daemon died, past the end
                    # its last fsync recorded: never the file's, dropped.
                    if size is not None:
                        self.hot.remove(ino, idx)
                    past_end[key] = None
                    if ext.obj_id:
                        gc.append(ext.ref)
                    continue
                if room is not None and size is not None and size > room:
                    # Bytes past the file's end (written, never recorded): a later
                    # extension of the file must read zeros there, not them.
                    self.hot.truncate(ino, idx, room)
                    size = room
            if ext.hot and size is None:
                if ext.dirty:
                    # Keep the record: reads of it fail with EIO instead of zeros. And
                    # count it dirty: sync --wait and unmount say it is lost.
                    problems.append(f"inode {ino} extent {idx}: dirty hot file missing, "
                                    f"its data is lost (reads give EIO; fsck --repair drops it)")
                    node, _exts = self.meta.get_extents(ino, idx, idx)
                    lost = max(0, min(self.E, node.size - idx * self.E))
                    self.index.add(key, lost, dirty=True, checked=False, pinned=ext.pinned,
                                   last_write=now_mono)
                else:
                    fixes[key] = replace(ext, flags=ext.flags & ~HOT)
                continue
            if not ext.hot:
                if size is not None:
                    self.hot.remove(ino, idx)
                continue
            # A dirty extent is as old as its file's last write (the monotonic clock
            # restarts at boot; the file's mtime does not).
            self.index.add(key, size, dirty=ext.dirty, checked=False, pinned=ext.pinned,
                           last_write=now_mono - max(0.0, now_wall - mtime))
        for ino, idx in on_disk:
            self.hot.remove(ino, idx)
        if on_disk:  # deleted files the trash had not got to, writes never committed
            log.info("removed %d hot files that no extent record names (left by the last "
                     "shutdown)", len(on_disk))
        for (ino, idx), ext in fixes.items():
            self.meta.update(None, {(ino, idx): ext})
        if past_end:
            self.meta.update(None, past_end, gc)
        return problems

    def _room_in_file(self, ino: int, idx: int, file_sizes: dict) -> int | None:
        """Bytes of extent `idx` that lie within its file's size (<= 0: it lies past
        the end); None if the inode is gone. `file_sizes` keeps the sizes read."""
        if ino not in file_sizes:
            try:
                file_sizes[ino] = self.meta.get_inode(ino).size
            except FsError:
                file_sizes[ino] = None
        size = file_sizes[ino]
        return None if size is None else min(self.E, size - idx * self.E)

    # ---- reads --------------------------------------------------------------------
    async def read(self, ino: int, off: int, size: int):
        """Bytes [off, off+size) of a file (a bytearray: pyfuse3 takes any buffer)."""
        E = self.E
        if size <= 0:
            return b""
        node, exts = self.meta.get_extents(ino, off // E, (off + size - 1) // E)
        end = min(off + size, node.size)
        if off >= end:
            return b""
        buf = bytearray(end - off)  # zero-filled: holes need no work
        view = memoryview(buf)
        pos = off
        while pos < end:
            idx = pos // E
            start = idx * E
            n = min(end, start + E) - pos
            out = view[pos - off:pos - off + n]
            ext = exts.get(idx)
            if ext is not None and not (ext.hot and await self._read_hot(ino, idx, ext,
                                                                         pos - start, out)):
                self.on_miss(ino)
                data = await self.fetch(ino, idx, bytes_only=True)
                piece = data[pos - start:pos - start + n]
                out[:len(piece)] = piece
                self.stats.inc("miss_read_bytes", n)
            pos += n
        self._readahead(ino, off, end, node.size)
        return buf

    async def _read_hot(self, ino: int, idx: int, ext: Extent, offset: int, out) -> bool:
        """Fill `out` from the hot copy. False if there is no usable hot copy (any
        more): the caller fetches from the bucket."""
        key = (ino, idx)
        try:
            if self.needs_ready(ino, idx, ext):  # hot: a copy found at mount, unchecked
                whole = self.verify_inline(ino, idx, ext)
                if whole is not None:  # checked on this thread, no hop: serve from it
                    piece = whole[offset:offset + len(out)]
                    out[:len(piece)] = piece
                    self.index.touch(key)
                    self.stats.inc("hot_read_bytes", len(out))
                    return True
                if not await self.verify_hot_copy(ino, idx):
                    return False
            # Inline when the page cache has it; otherwise the disk read goes to a
            # thread so that other requests are served meanwhile.
            got = self.hot.read_cached(ino, idx, offset, out)
            if got < len(out):
                fd = self.hot.dup_fd(ino, idx)
                if fd is None:
                    raise FileNotFoundError
                await trio.to_thread.run_sync(self.hot.read_into, fd, offset + got, out[got:],
                                              limiter=self.io_limiter)
        except FileNotFoundError:
            await self._hot_file_lost(ino, idx)
            return False
        self.index.touch(key)
        self.stats.inc("hot_read_bytes", len(out))
        return True

    def verify_inline(self, ino: int, idx: int, ext: Extent) -> bytes | None:
        """Verify a small clean hot extent on the trio thread when the page cache holds
        all of it (open() asked the kernel to read it ahead): the bytes if they match
        the checksum. None when it is not small, not cached, or does not match (the
        worker-thread check then decides, and drops a damaged copy)."""
        if ext.length > INLINE_VERIFY_MAX:
            return None
        data = self.hot.read_whole_cached(ino, idx, ext.length + 1)
        if data is None or not hot_copy_matches(data, ext.length, ext.checksum):
            return None
        self.index.unchecked.discard((ino, idx))
        self.stats.inc("hot_verified_inline")
        return data

    async def verify_hot_copy(self, ino: int, idx: int) -> bool:
        """Whether the hot copy of an extent may be served. A clean copy not checked
        yet (index.unchecked) is checked against its record now (in a thread); a
        damaged one is dropped. False: there is no hot copy (any more), fetch it."""
        key = (ino, idx)
        while True:
            pending = self._verifying.get(key)
            if pending is not None:  # another request is checking it: its verdict
                await pending.wait()
                continue
            ext = self._record(ino, idx)
            if ext is None or not ext.hot:
                return False
            if ext.dirty or key not in self.index.unchecked:
                return True
            self._verifying[key] = event = trio.Event()
            try:
                verdict = await self._check_copy(ino, idx, ext)
            finally:
                del self._verifying[key]
                self._copy_let_go.discard(key)
                event.set()
            if verdict is not None:
                return verdict

    async def _check_copy(self, ino: int, idx: int, ext: Extent) -> bool | None:
        """Check the hot copy of a clean extent against its record `ext` in a thread.
        None: the copy was let go (evicted, and maybe fetched again or rewritten) or
        the record changed while the thread read, so the verdict is about a copy that
        is not in place any more: look again."""
        key = (ino, idx)
        try:
            ok = await trio.to_thread.run_sync(self.hot.copy_matches, ino, idx, ext.length,
                                               ext.checksum, limiter=self.io_limiter)
        except FileNotFoundError:
            ok = False
        if key in self._copy_let_go or self._record(ino, idx) != ext:
            return None
        if ok:
            self.index.unchecked.discard(key)
            self.stats.inc("hot_verified_in_thread")
            return True
        self.stats.inc("hot_checksum_errors")
        log.error("inode %d extent %d: hot copy is damaged; dropping it and refetching "
                  "from the bucket", ino, idx)
        self.drop_hot(ino, idx, ext)
        return False

    def _record(self, ino: int, idx: int) -> Extent | None:
        """An extent's record now (None: a hole, or the inode is gone)."""
        try:
            return self.meta.get_extents(ino, idx, idx)[1].get(idx)
        except FsError:
            return None

    def forget_hot(self, ino: int, idx: int, gone: bool = False) -> None:
        """The one rule for letting go of a hot copy: its file, its index entry,
        its unchecked mark. The caller commits the record (cleared HOT or deleted),
        possibly batched with others. `gone`: the inode is purged, so nothing takes
        the file's place and its removal is left to the trash's thread whole."""
        key = (ino, idx)
        try:
            if gone:
                self.hot.remove_later(ino, idx, self.index.sizes.get(key, 0))
            else:
                self.hot.remove(ino, idx)
        finally:  # whatever the disk says, the index must not keep a copy let go
            self.index.remove(key)
            if key in self._verifying:  # its check is about this copy, not the next one
                self._copy_let_go.add(key)

    def drop_hot(self, ino: int, idx: int, ext: Extent) -> None:
        """Drop the hot copy of a clean extent (it stays in the bucket)."""
        self.forget_hot(ino, idx)
        self.meta.update(None, {(ino, idx): replace(ext, flags=ext.flags & ~HOT)})

    def opened(self, ino: int) -> None:
        """A file was opened: start the disk read of its first MiB if it is hot, so the
        first read request most likely finds it cached and is served inline."""
        if (ino, 0) in self.index.sizes:
            self.hot.will_need(ino, 0, 1 << 20)

    def _readahead(self, ino: int, off: int, end: int, size: int) -> None:
        """Sequential readers get the next extents fetched in parallel, with a
        window that doubles each time the reader enters a new extent."""
        if self.nursery is None:
            return
        stream = self._streams.get(ino)
        if stream is None or stream[0] != off:
            if len(self._streams) > 4096:
                self._streams.clear()
            stream = self._streams[ino] = [end, 1, (end - 1) // self.E, (end - 1) // self.E]
            if off != 0:
                return
        stream[0] = end
        idx = (end - 1) // self.E
        if idx == stream[2] and off != 0:
            return
        stream[2] = idx
        window = stream[1]
        stream[1] = min(window * 2, self.readahead_max)
        last = min(idx + window, (size - 1) // self.E)
        first = max(idx, stream[3]) + 1  # extents already in the window were asked for once
        if last < first:
            return
        stream[3] = last
        _n, exts = self.meta.get_extents(ino, first, last)
        for i, ext in exts.items():
            if ext.hot:
                self.hot.will_need(ino, i)  # the disk reads it ahead, in parallel
            elif (ino, i) not in self._fetching:
                self.nursery.start_soon(self._prefetch_quietly, ino, i)

    async def _prefetch_quietly(self, ino: int, idx: int) -> None:
        try:
            await self.fetch(ino, idx)
            self.stats.inc("readahead_extents")
        except Exception as e:  # the reader will see the error if it gets there
            log.debug("readahead of inode %d extent %d failed: %s", ino, idx, e)

    async def _hot_file_lost(self, ino: int, idx: int) -> None:
        """A hot extent file vanished behind our back: mark it cold if the bucket
        has it (the caller fetches it again), else EIO."""
        _node, exts = self.meta.get_extents(ino, idx, idx)
        ext = exts.get(idx)
        if not (ext is not None and ext.hot and ext.dirty):
            # A dirty one stays dirty in the index: sync --wait and unmount must go
            # on saying it is not in the bucket.
            self.forget_hot(ino, idx)
        if ext is None or not ext.hot:
            return
        if ext.dirty or not ext.obj_id:
            log.error("inode %d extent %d: hot file missing and not in the bucket", ino, idx)
            self.stats.inc("hot_file_lost")
            raise FsError(errno.EIO, "hot extent file lost")
        self.meta.update(None, {(ino, idx): replace(ext, flags=ext.flags & ~HOT)})

    async def fetch(self, ino: int, idx: int, for_write: bool = False,
                    around: bool = True, wanted=None, bytes_only: bool = False) -> bytes:
        """Bring one extent hot from the bucket (single-flight) and return its bytes.
        A fetch for a write always installs the extent (waiting for room); a
        fetch for a read may be served uncached when the cache policy says so, and
        (around) brings the cold neighbours packed next to it along. With `wanted`
        (inode -> bool: files asked for next) the neighbours are the wanted extents
        packed next to it instead. It returns once the extent is installed (or the
        policy declined it); bytes_only (a read) returns as soon as the bytes are
        verified, though they may be a neighbour's that are still being installed."""
        while True:
            try:
                return await self._fetch_once(ino, idx, for_write, around, wanted, bytes_only)
            except _Moved:
                # Rewritten and uploaded, or compacted, during the GET: the old object
                # may be gone already. What the record says now is what to read.
                self.stats.inc("fetch_retried")

    async def _fetch_once(self, ino: int, idx: int, for_write: bool, around: bool,
                          wanted, bytes_only: bool) -> bytes:
        key = (ino, idx)
        while True:
            _node, exts = self.meta.get_extents(ino, idx, idx)
            ext = exts.get(idx)
            if ext is None:
                return b""
            if ext.hot:
                try:
                    return self.hot.pread(ino, idx, 0, self.E)
                except FileNotFoundError:
                    await self._hot_file_lost(ino, idx)
                    continue
            pending = self._fetching.get(key)
            if pending is None or pending.ext != ext:
                # None on the way, or an older version (this one was rewritten and
                # uploaded since that GET began): this version needs a GET of its own.
                break
            if bytes_only and not for_write:
                await pending.ready.wait()
                if pending.data is not None:
                    return pending.data  # a reader needs the bytes, not a re-read of the file
            await pending.done.wait()
            if pending.data is not None and not for_write:
                return pending.data  # installed, or declined by the cache policy
            if pending.failed is not None and self._record(ino, idx) == ext:
                e = pending.failed
                raise (ColdUnavailable(str(e)) if isinstance(e, ColdUnavailable)
                       else FsError(e.errno, str(e)))
        shared = pending is None  # readers of this version may wait for this GET
        pending = _Fetch(ext)
        if shared:
            self._fetching[key] = pending
        if not shared:
            around = []
        elif wanted is not None:
            around = self._wanted_neighbours(key, ext, wanted)
        else:
            around = self._neighbours(key, ext) if around and not for_write else []
        self._neighbour_bytes += sum(nx.obj_len for _k, nx, _p in around)
        more = []
        try:
            try:
                data, more = await self._get_around(ext, ino, idx, around)
            except FsError as e:
                pending.failed = e
                raise
            pending.data = data
            # Readers sharing this GET have what they need once the bytes are verified,
            # also when a writer's fetch then waits for room to install them.
            pending.ready.set()
            if bytes_only and not for_write and self.nursery is not None:
                # The install of a reader's extent follows in the background (then its
                # neighbours'), so a reader never waits behind the installs of others.
                try:
                    self.nursery.start_soon(self._install_fetched, ino, idx, ext, pending,
                                            around, more)
                    around = more = None  # the task settles them
                    return data
                except RuntimeError:  # the background nursery is closing
                    pass
            await self._keep(ino, idx, ext, data, for_write)
            return data
        finally:
            if around is not None:
                await self._settle((ino, idx), pending, around, more)

    async def _install_fetched(self, ino: int, idx: int, ext: Extent, pending: _Fetch,
                               around: list, more: list) -> None:
        """Install an extent whose reader already has its bytes, in the background."""
        try:
            await self._keep(ino, idx, ext, pending.data, False)
        except Exception as e:  # it stays cold: the next read fetches it again
            log.warning("installing inode %d extent %d after its read failed: %s", ino, idx, e)
        finally:
            await self._settle((ino, idx), pending, around, more)

    async def _settle(self, key: Key, pending: _Fetch, around: list, more: list) -> None:
        """A fetch is over: its readers and writers may go on, the neighbours that did
        not verify are let go, and those that did are installed."""
        if self._fetching.get(key) is pending:
            del self._fetching[key]
        pending.finish()
        installing = {nkey for nkey, _nx, _p, _piece in more}
        for nkey, nx, npending in around:  # neighbours that did not verify
            if nkey not in installing:
                if self._fetching.get(nkey) is npending:
                    del self._fetching[nkey]
                npending.finish()
                self._neighbour_bytes -= nx.obj_len
                if self.space is not None:
                    self.space.release(nx.obj_len)
        if more:  # their readers have the bytes already: install after this reader's
            try:
                self.nursery.start_soon(self._install_around, more)
            except (AttributeError, RuntimeError):  # no background tasks (any more)
                await self._install_around(more)

    def _moved(self, ino: int, idx: int, ext: Extent) -> bool:
        """Whether the extent's record is no longer `ext` (rewritten, compacted...)."""
        return self._record(ino, idx) != ext

    async def _keep(self, ino: int, idx: int, ext: Extent, data: bytes, for_write: bool) -> None:
        """Install a fetched extent on the hot tier, as room and the cache policy allow."""
        admitted = 0
        if self.space is not None:
            if for_write:
                await self.space.reserve(len(data))
                self.space.reserved += len(data)
                admitted = len(data)
            elif not self.space.admit_fetch(len(data)):
                self.stats.inc("fetch_not_cached")
                return  # policy keeps the hot tier as it is: serve uncached
            else:
                admitted = len(data)
        try:
            tmp = await trio.to_thread.run_sync(self.hot.write_temp, ino, idx, data,
                                                limiter=self.io_limiter)
        finally:
            if admitted:
                self.space.release(admitted)
        self._install(ino, idx, ext, tmp, len(data))

    def _neighbours(self, key: Key, ext: Extent) -> list:
        """Cold extents of other files packed next to `ext` (in its aligned window of
        READ_AROUND bytes, the nearest READ_AROUND_EXTENTS) to fetch with it in the same ranged GET, while the hot tier has room for them
        without evicting anything: files written together are mostly read together,
        and one GET then serves many. Each is registered as being fetched (readers of
        it wait for this GET) and its room reserved."""
        if (self.space is None or not self.read_around or ext.dirty
                or self._neighbour_bytes + self.read_around > NEIGHBOURS_IN_MEMORY
                or self.meta.pack(ext.obj_id) is None):
            return []
        lo, hi = aligned_window(ext.obj_off, self.read_around)
        refs = self.meta.pack_refs(ext.obj_id, lo, hi)
        refs.sort(key=lambda r: abs(r.offset - ext.obj_off))  # the nearest ones
        picked = []
        for ref in refs[:READ_AROUND_EXTENTS]:
            nx = self._cold_piece(key, ext, ref)
            if nx is not None:
                picked.append(((ref.ino, ref.index), nx))
        return self._register(picked)

    def _cold_piece(self, key: Key, ext: Extent, ref) -> Extent | None:
        """The record of the extent that `ref` (into ext's pack) names, if it can be
        fetched along with `ext`: another extent, cold, clean, not on its way already,
        and its record still pointing there."""
        nkey = (ref.ino, ref.index)
        if nkey == key or nkey in self._fetching or nkey in self.index.sizes:
            return None
        try:
            nx = self.meta.get_extents(ref.ino, ref.index, ref.index)[1].get(ref.index)
        except FsError:
            return None
        if nx is None or nx.hot or nx.dirty or nx.ref != (ext.obj_id, ref.offset, ref.length):
            return None
        return nx

    def _register(self, picked: list) -> list:
        """[(key, record)] picked to fetch along: if the hot tier has room for all of them
        without evicting, reserve it and register each as being fetched (its readers wait
        for this GET); [(key, record, _Fetch)], or [] when there is no room."""
        if not picked or not self.space.admit_without_evicting(
                sum(nx.obj_len for _k, nx in picked)):
            return []
        around = []
        for nkey, nx in picked:
            pending = self._fetching[nkey] = _Fetch(nx)
            around.append((nkey, nx, pending))
        return around

    def _wanted_neighbours(self, key: Key, ext: Extent, wanted) -> list:
        """The run of cold extents of wanted files packed right after and before `ext`
        (up to WANTED_GAP bytes between two of them read along: dead, unwanted, hot or
        already on their way), those starting in ext's aligned window of WANTED_SPAN
        bytes, up to what is left of NEIGHBOURS_IN_MEMORY, while the hot tier has room for them
        without evicting. The pack's references are read outwards a little at a time:
        a run usually ends long before WANTED_SPAN."""
        # The window's last piece may end past it (by an extent at most).
        budget = min(WANTED_SPAN + self.E, NEIGHBOURS_IN_MEMORY - self._neighbour_bytes) \
            - ext.obj_len
        if (self.space is None or budget <= 0 or ext.dirty
                or self.meta.pack(ext.obj_id) is None):
            return []
        limit = budget + ext.obj_len  # of the whole span, from its first byte to its last
        window_lo, window_hi = aligned_window(ext.obj_off, WANTED_SPAN)
        picked, lo, hi = [], ext.obj_off, ext.obj_off + ext.obj_len

        def take(ref) -> bool:
            nx = self._cold_piece(key, ext, ref) if wanted(ref.ino) else None
            if nx is not None:
                picked.append(((ref.ino, ref.index), nx))
            return nx is not None

        # Forward first (packs hold files in creation order), then backward. A piece not
        # wanted, or hot or on its way already, is read over if it is short.
        for ref in self._refs_after(ext.obj_id, hi, window_hi):
            if ref.offset + ref.length - lo > limit or len(picked) >= WANTED_SPAN_EXTENTS:
                break
            if ref.offset - hi <= WANTED_GAP and take(ref):
                hi = ref.offset + ref.length
            elif ref.offset + ref.length - hi > WANTED_GAP:
                break
        for ref in self._refs_before(ext.obj_id, max(window_lo, hi - limit), lo):
            if hi - ref.offset > limit or len(picked) >= WANTED_SPAN_EXTENTS:
                break
            if lo - (ref.offset + ref.length) <= WANTED_GAP and take(ref):
                lo = ref.offset
            elif lo - ref.offset > WANTED_GAP:
                break
        return self._register(picked)

    def _refs_after(self, obj_id: int, start: int, end: int):
        """References into a pack at offsets start <= offset < end, nearest first,
        REFS_CHUNK bytes of the pack at a time."""
        while start < end:
            stop = min(end, start + REFS_CHUNK)
            yield from self.meta.pack_refs(obj_id, start, stop)
            start = stop

    def _refs_before(self, obj_id: int, start: int, end: int):
        """References into a pack at offsets start <= offset < end, nearest (last) first."""
        start = max(0, start)
        while end > start:
            begin = max(start, end - REFS_CHUNK)
            yield from reversed(self.meta.pack_refs(obj_id, begin, end))
            end = begin

    async def _get_around(self, ext: Extent, ino: int, idx: int, around: list):
        """The bytes of `ext` (verified), and [(key, record, pending, bytes)] of the
        neighbours that verified, from one ranged GET over all of them."""
        if not around:
            return await self.get_verified(ext, ino, idx, record=ext), []
        lo = min([ext.obj_off] + [nx.obj_off for _k, nx, _p in around])
        hi = max([ext.obj_off + ext.obj_len] + [nx.obj_off + nx.obj_len for _k, nx, _p in around])
        span = replace(ext, obj_off=lo, obj_len=hi - lo)

        def split(blob: bytes):
            """Each piece (None: it does not match) verified on its own, in the GET's
            worker thread: a span of up to WANTED_SPAN bytes is too much hashing for
            the trio thread. Pieces are views of the span, not copies: slicing bytes
            copies them while holding the GIL, which the trio thread then waits for."""
            view = memoryview(blob)

            def piece(x: Extent) -> memoryview | None:
                data = view[x.obj_off - lo:x.obj_off - lo + x.obj_len]
                return data if object_matches(data, x.obj_len, x.checksum) else None
            return piece(ext), [piece(nx) for _k, nx, _p in around]

        data, pieces = await self.get_verified(span, ino, idx, check=False, record=ext,
                                               then=split)
        if data is None:
            if self._moved(ino, idx, ext):
                raise _Moved
            self.stats.inc("checksum_errors")
            log.error("checksum mismatch on object %s (%d bytes at %d) for inode %d extent %d: "
                      "returning EIO", object_name(ext.obj_id), ext.obj_len, ext.obj_off, ino, idx)
            raise FsError(errno.EIO, "checksum mismatch")
        more = []
        for (nkey, nx, pending), piece in zip(around, pieces):
            if piece is not None:
                pending.data = piece
                pending.ready.set()  # its readers need not wait for the install
                more.append((nkey, nx, pending, piece))
            # else: left cold; its own read fetches (and reports) it
        return data, more

    async def _install_around(self, more: list) -> None:
        """Install the neighbours a read-around fetched: their temp files written in one
        thread hop, their records set in one transaction (a neighbour each would cost
        more than its GET saved). Runs after the reader that fetched them has its bytes;
        a failure only leaves them cold. The time a run waits for an install thread and
        the time its copies take to write, and the event loop's time for its records and
        renames go to fetched_install_seconds (where a cold epoch's prefetch waits: its
        neighbours hold their memory until installed)."""
        queued = time.monotonic()
        started = queued

        def write_all() -> list[str]:
            nonlocal started
            started = time.monotonic()
            return self.hot.write_temps([(nino, nidx, piece)
                                         for (nino, nidx), _nx, _p, piece in more])

        try:
            temps = await trio.to_thread.run_sync(write_all, limiter=self._around_limiter)
            self.stats.observe("fetched_install_seconds", "wait", started - queued)
            self.stats.observe("fetched_install_seconds", "write", time.monotonic() - started)
            try:
                await self.give_way()  # the records and renames are a step of milliseconds
            except BaseException:  # cancelled (the daemon stops): no temp files left behind
                self.hot.discard_temps(temps)
                raise
            installing = time.monotonic()
            self._install_many([(key, nx, tmp, len(piece))
                                for (key, nx, _p, piece), tmp in zip(more, temps)])
            self.stats.observe("fetched_install_seconds", "install",
                               time.monotonic() - installing)
            self.stats.inc("read_around_extents", len(more))
        except OSError as e:  # a full or failing hot tier: they stay in the bucket
            log.warning("installing %d fetched neighbours failed: %s", len(more), e)
        except Exception:  # in the background: never take the mount down
            log.exception("installing %d fetched neighbours failed", len(more))
        finally:
            for key, _nx, pending, _piece in more:
                if self._fetching.get(key) is pending:
                    del self._fetching[key]
                pending.finish()
            nbytes = sum(nx.obj_len for _k, nx, _p, _piece in more)
            self._neighbour_bytes -= nbytes
            if self.space is not None:
                self.space.release(nbytes)

    def _install_many(self, items: list) -> None:
        """_install() of [(key, record fetched, temp file, size)], in one transaction."""
        todo = [(key, nx, tmp, size) for key, nx, tmp, size in items
                if key not in self.index.sizes]
        ok = self.meta.put_extents_if([(key, nx, replace(nx, flags=nx.flags | HOT))
                                       for key, nx, _t, _s in todo])
        done = {key for key, nx, tmp, size in (t for t, won in zip(todo, ok) if won)}
        for key, nx, tmp, size in items:
            if key not in done:
                self.hot.discard_temp(tmp)
                self.stats.inc("fetch_superseded")
                continue
            self.hot.install_temp(tmp, *key)
            self.index.add(key, size, dirty=False, checked=True, pinned=nx.pinned)

    def _install(self, ino: int, idx: int, fetched: Extent, tmp: str, size: int) -> None:
        """Put a fetched copy in place, on the trio thread with no await between the
        check and the rename: only if the record is still the one fetched and no
        hot file appeared meanwhile (a write covering the whole extent, a truncate
        and a rewrite). Otherwise the copy is stale and newer data must win."""
        key = (ino, idx)
        if key in self.index.sizes or not self.meta.put_extent_if(
                ino, idx, fetched, replace(fetched, flags=fetched.flags | HOT)):
            self.hot.discard_temp(tmp)
            self.stats.inc("fetch_superseded")
            return
        self.hot.install_temp(tmp, ino, idx)
        self.index.add(key, size, dirty=False, checked=True, pinned=fetched.pinned)

    async def get_verified(self, ext: Extent, ino: int = 0, idx: int = 0,
                           check: bool = True, record: Extent | None = None, then=None):
        """Read an extent's object range and verify its xxh3 (in a worker thread;
        check=False: a span whose pieces the caller verifies). Errors are logged with
        the object and the inode and extent that need it (a pack holds many files:
        only this one gets the EIO). With `record`, a missing or mismatching object
        of an extent whose record has changed since raises _Moved, unlogged. With
        `then`, what then(bytes) returns, run in the same worker thread after the GET."""
        name = object_name(ext.obj_id)
        of = f"inode {ino} extent {idx}"

        def get_and_check():
            data = self.cold.get(name, ext.obj_off, ext.obj_len)
            # A span is checked piece by piece, lengths included: one cut short (a pack
            # whose end is lost) fails only the pieces it lacks, not the whole span.
            if check and not object_matches(data, ext.obj_len, ext.checksum):
                raise ChecksumMismatch(name)
            return data if then is None else then(data)

        t0 = time.monotonic()
        try:
            # The whole wait (a free S3 thread, retries, a bucket that never answers)
            # fits in --cold-timeout; a thread still stuck then is left to its own
            # socket timeout.
            with trio.fail_after(self.cold_timeout):
                data = await trio.to_thread.run_sync(get_and_check, limiter=self.s3_limiter,
                                                     abandon_on_cancel=True)
        except trio.TooSlowError:
            self.stats.inc("cold_errors")
            log.error("cold read of %s for %s: the bucket did not answer within %.0fs "
                      "(--cold-timeout): returning EIO", name, of, self.cold_timeout)
            raise ColdUnavailable("bucket timeout") from None
        except ChecksumMismatch:
            if record is not None and self._moved(ino, idx, record):
                raise _Moved from None
            self.stats.inc("checksum_errors")
            log.error("checksum mismatch on object %s (%d bytes at %d) for %s: returning EIO",
                      name, ext.obj_len, ext.obj_off, of)
            raise FsError(errno.EIO, "checksum mismatch") from None
        except ObjectNotFound:
            if record is not None and self._moved(ino, idx, record):
                raise _Moved from None
            self.stats.inc("cold_errors")
            log.error("object %s is missing from the bucket (%s): returning EIO", name, of)
            raise FsError(errno.EIO, "object missing") from None
        except ColdStoreError as e:
            self.stats.inc("cold_errors")
            log.error("cold read of %s for %s failed: %s", name, of, e)
            raise ColdUnavailable(str(e)) from None
        self.stats.inc("cold_read_bytes", ext.obj_len)
        self.stats.inc("cold_reads")
        self.stats.observe("cold_fetch_seconds", "", time.monotonic() - t0)
        return data

    async def verify_cold(self, ino: int, idx: int, ext: Extent) -> bool:
        """Read and verify an extent's object (scrub). A record that changes during
        the GET (rewritten and uploaded, compacted, cut: the old object may be gone
        already) is checked as it is then. False: it has no object to check any more
        (dirty, or gone); FsError(EIO) if the object is damaged or missing."""
        while True:
            try:
                await self.get_verified(ext, ino, idx, record=ext)
                return True
            except _Moved:
                ext = self._record(ino, idx)
                if ext is None or ext.dirty or not ext.obj_id:
                    return False

    def needs_ready(self, ino: int, idx: int, ext: Extent) -> bool:
        """Whether `ext` must be made ready (ensure_hot) before it is changed in place:
        it is cold, or its hot copy was found at mount and not checked yet."""
        return not ext.hot or (self.verify_hot and not ext.dirty
                               and (ino, idx) in self.index.unchecked)

    async def ensure_hot(self, ino: int, idx: int) -> None:
        """Make an extent hot before changing it in place: fetched if cold, and a copy
        found at mount checked first. Changed in place, a damaged copy's bytes would
        become the file's (dirty, then uploaded over the good object)."""
        while True:
            ext = self._record(ino, idx)
            if self._copy_lost(ino, idx, ext):
                await self._hot_file_lost(ino, idx)  # cold now, if the bucket has it
                continue
            if ext is None or not self.needs_ready(ino, idx, ext):
                return
            if not ext.hot:
                await self.fetch(ino, idx, for_write=True)
                return
            await self.verify_hot_copy(ino, idx)  # a damaged copy is dropped: fetch it

    def needs_ensure_hot(self, ino: int, idx: int, ext: Extent) -> bool:
        """Whether an extent needs ensure_hot() before part of it changes in place."""
        return self.needs_ready(ino, idx, ext) or self._copy_lost(ino, idx, ext)

    def _copy_lost(self, ino: int, idx: int, ext: Extent | None) -> bool:
        """Whether a hot extent's file vanished behind the daemon's back. Changed in
        place, it would be made again empty: zeros, dirty, then uploaded over the
        good object. (A descriptor held here keeps the file: that counts as there.)"""
        return (ext is not None and ext.hot and (ino, idx) not in self.index.held
                and not self.hot.exists(ino, idx))

    # ---- writes ---------------------------------------------------------------------
    async def write(self, ino: int, off: int, data) -> int:
        E = self.E
        length = len(data)
        self.state.check_writable()
        if length == 0:
            return 0
        end = off + length
        first, last = off // E, (end - 1) // E
        keys = [(ino, i) for i in range(first, last + 1)]
        self.busy.update(keys)  # not evictable while this write is under way
        try:
            node, exts = await self._prepare_write(ino, off, end)
        finally:
            self.busy.difference_update(keys)
        self.state.check_writable()  # fenced while this write waited: it must not land
        # Clean hot copies this write changes in place are recorded dirty before their
        # bytes change: a commit that fails afterwards (a full disk) must not leave a
        # clean record over changed bytes (the bucket's bytes read back once evicted,
        # the copy called damaged at its next check).
        clean = {i: x for i, x in exts.items() if x.hot and not x.dirty}
        if clean:
            self.meta.update(None, {(ino, i): replace(x, flags=x.flags | DIRTY)
                                    for i, x in clean.items()})
            exts.update((i, replace(x, flags=x.flags | DIRTY)) for i, x in clean.items())
        sizes = {key: self.index.sizes.get(key) for key in keys}  # of the files before
        view = memoryview(data)
        changed = {}
        filled = []
        written = []
        pos = off
        t = time.time_ns()
        try:
            while pos < end:
                idx = pos // E
                start = idx * E
                n = min(end, start + E) - pos
                self.hot.pwrite(ino, idx, pos - start, view[pos - off:pos - off + n])
                written.append((ino, idx))
                ext = exts.get(idx)
                if ext is None:
                    changed[(ino, idx)] = Extent(flags=HOT | DIRTY)
                elif not (ext.hot and ext.dirty):
                    changed[(ino, idx)] = replace(ext, flags=ext.flags | HOT | DIRTY)
                self.index.written((ino, idx), pos - start + n)
                if pos - start + n == E:
                    filled.append(idx)
                pos += n
        except BaseException:
            failed = pos // E
            self._cut_failed_write(ino, failed)
            for i, x in clean.items():  # not written: their records as they were
                if i >= failed:
                    changed[(ino, i)] = x
            # A clean copy the failed pwrite may have changed in place: let go, so the
            # file reads the bucket's bytes, as before the write.
            let_go = failed in clean and pos % E < (sizes[(ino, failed)] or 0)
            if let_go:
                changed[(ino, failed)] = replace(clean[failed], flags=clean[failed].flags & ~HOT)
            # An extent after the first failed (a full disk): those written are the
            # file's now, in the index already; their records must say so too, or a
            # later write would wait for a fetch the index declines forever.
            if changed:
                node.size = max(node.size, pos)
                try:
                    self._commit_write(node, changed, written, sizes)
                except BaseException:
                    for i in clean:  # their records stay dirty: so must the index
                        if i >= failed:
                            self.index.written((ino, i), sizes[(ino, i)])
                    raise
            if let_go:
                self.forget_hot(ino, failed)
            raise
        if end > node.size:
            node.size = end
        if node.mode & (stat.S_ISUID | stat.S_ISGID):
            node.mode = kill_suid(node.mode)  # the kernel leaves this to us (killpriv)
        if not self.kernel_times:
            node.mtime_ns = node.ctime_ns = t
        self._commit_write(node, changed, written, sizes)
        self.stats.inc("write_bytes", length)
        for idx in filled:
            self._start_writeback(ino, idx)
        return length

    def _commit_write(self, node: Inode, changed: dict, written: list[Key],
                      sizes: dict[Key, int | None]) -> None:
        """Commit a write's inode and records. If that fails (ENOSPC: the disk under the
        metadata is full), the file keeps its size: the write's bytes in extent files
        that had none (`sizes` before: None) go, and those past what a file held before
        are cut off, or a later extension would show them. Bytes it changed in place
        stay: their records say dirty (clean ones were made so before the pwrite)."""
        try:
            self.meta.update(node, changed)
        except BaseException:
            for ino, idx in written:
                before = sizes[(ino, idx)]
                try:
                    if before is None:
                        self.forget_hot(ino, idx)
                    elif (self.hot.file_size(ino, idx) or 0) > before:
                        self.hot.truncate(ino, idx, before)
                        self.index.set_size((ino, idx), before)
                except OSError as e:
                    log.warning("inode %d extent %d: taking back a write whose commit "
                                "failed: %s", ino, idx, e)
            raise

    def _cut_failed_write(self, ino: int, idx: int) -> None:
        """A write into extent `idx` failed, maybe after some of its bytes went in (a
        short write on a full disk): the bytes past what the index knows of the file
        are cut off (the file removed if this write made it), or a later extension of
        the file would show them where a hole must read zeros."""
        key = (ino, idx)
        if key in self.index.held:
            return  # a direct writer's file: counted whole, its writes are its own
        known = self.index.sizes.get(key)
        try:
            if known is None:
                self.hot.remove(ino, idx)
            elif (self.hot.file_size(ino, idx) or 0) > known:
                self.hot.truncate(ino, idx, known)
        except OSError as e:
            log.warning("inode %d extent %d: cutting a failed write off its hot file "
                        "failed: %s", ino, idx, e)

    def _start_writeback(self, ino: int, idx: int) -> None:
        """An extent file was written up to its end: start its disk write in a worker
        thread, so that an fsync later (a checkpoint's) finds most of the file written."""
        if self.nursery is None or pagecache.sync_file_range is None:
            return
        fd = self.hot.dup_fd(ino, idx)
        if fd is None:
            return

        async def run() -> None:
            try:
                await trio.to_thread.run_sync(pagecache.start_writeback, fd,
                                              limiter=self._writeback_limiter)
            finally:
                os.close(fd)

        try:
            self.nursery.start_soon(run)
        except RuntimeError:  # the background nursery is closing: the fsync does it all
            os.close(fd)

    async def _prepare_write(self, ino: int, off: int, end: int):
        """Fetch partially overwritten cold extents (and check such copies found at
        mount) and wait for room; loops because every await may change what the
        records say."""
        E = self.E
        first, last = off // E, (end - 1) // E
        while True:
            node, exts = self.meta.get_extents(ino, first, last)
            cold = [i for i, x in exts.items() if self.needs_ensure_hot(ino, i, x)
                    and not (off <= i * E and end >= i * E + x.length)]
            if cold:
                for idx in cold:
                    await self.ensure_hot(ino, idx)
                continue
            growth = self._growth(ino, off, end)
            if growth and self.space is not None and self.space.needs_room(growth):
                await self.space.reserve(growth)
                continue
            return node, exts

    def _growth(self, ino: int, off: int, end: int) -> int:
        """How many bytes the hot extent files grow by writing [off, end)."""
        E = self.E
        growth = 0
        for idx in range(off // E, (end - 1) // E + 1):
            new_end = min(end - idx * E, E)
            growth += max(0, new_end - self.index.sizes.get((ino, idx), 0))
        return growth

    async def truncate(self, ino: int, new_size: int) -> None:
        """Set a file's size; shrinking drops whole extents and cuts the last one."""
        E = self.E
        cut_idx = new_size // E
        self.state.check_writable()
        await self._shrink_in_parts(ino, new_size)
        while True:
            # Only the extents from the cut on change: the rest is not read.
            node, exts = self.meta.get_extents(ino, cut_idx, (1 << 64) - 1)
            ext = exts.get(cut_idx)
            if (new_size < node.size and new_size % E and ext is not None
                    and self.needs_ensure_hot(ino, cut_idx, ext)):
                await self.ensure_hot(ino, cut_idx)  # cut it in place on the hot tier
                continue
            break
        self.state.check_writable()
        self._set_size(ino, node, exts, new_size)

    async def _shrink_in_parts(self, ino: int, new_size: int) -> None:
        """Shrink a file with more extent records past new_size than one transaction
        should drop (SHRINK_BATCH) from its end, a part at a time, the event loop
        free between parts. Each part is a truncate to the start of the lowest extent
        it drops: a crash between parts leaves the file at that size with its data up
        to there and no record past its end, so nothing cut comes back later."""
        batch = self.meta.purge_batch and min(self.meta.purge_batch, SHRINK_BATCH)
        first = -(-new_size // self.E)  # the first extent wholly past the new size
        while batch:
            last = self.meta.last_extent_indices(ino, first, batch + 1)
            if len(last) <= batch:
                return  # the rest goes in one transaction
            node, exts = self.meta.get_extents(ino, last[batch - 1], (1 << 64) - 1)
            part_end = last[batch - 1] * self.E
            if node.size <= part_end:  # records past the end (a direct writer's)
                return
            self._set_size(ino, node, exts, part_end)
            await trio.sleep(0)
            self.state.check_writable()

    def _set_size(self, ino: int, node: Inode, exts: dict[int, Extent], new_size: int
                  ) -> None:
        """In one transaction: the file's size and times; shrinking drops the extents
        past new_size (`exts`: at least every record from new_size // E on) and cuts
        the one it ends in, which must be hot. The hot files change only once that
        transaction is committed: a commit that fails (ENOSPC) leaves the file as it
        was, and a crash after it leaves bytes past the end that the next mount cuts."""
        E = self.E
        changed: dict[Key, Extent | None] = {}
        gc = []
        cuts: dict[int, int] = {}  # extent -> bytes its hot file keeps (0: emptied)
        if new_size < node.size:
            for idx, ext in exts.items():
                start = idx * E
                if start >= new_size:
                    if ext.obj_id:
                        gc.append(ext.ref)
                    if (ino, idx) in self.index.held:
                        # A direct writer's descriptor points at this file: empty it,
                        # so its later writes land in the file, as on a local disk.
                        cuts[idx] = 0
                        changed[(ino, idx)] = Extent(flags=HOT | DIRTY)
                        continue
                    changed[(ino, idx)] = None
                elif start + E > new_size and ext.hot:
                    cuts[idx] = new_size - start
                    changed[(ino, idx)] = replace(ext, flags=ext.flags | DIRTY)
        node.size = new_size
        node.mtime_ns = node.ctime_ns = time.time_ns()
        self.meta.update(node, changed, gc)
        for (_ino, idx), ext in changed.items():
            key = (ino, idx)
            if ext is None:
                self.forget_hot(ino, idx)
                continue
            self.hot.truncate(ino, idx, cuts[idx])
            if key not in self.index.held:  # held: counted as a whole extent
                self.index.set_size(key, cuts[idx])
            self.index.written(key, cuts[idx])

    # ---- durability ---------------------------------------------------------------
    async def fsync(self, ino: int | None) -> None:
        """Make the dirty hot data of an inode (all inodes if None) and all
        committed metadata survive a crash. Clean extents are in the bucket."""
        dirty = self.index.dirty
        # What direct writers wrote so far is the file's, as a write() is: its size
        # must be in the metadata that the sync below makes durable.
        for held_ino in {k[0] for k in self.index.held} if ino is None else (ino,):
            self.settle_held(held_ino)
        if ino is None:
            keys = list(dirty)
        else:
            keys = [(ino, i) for i in self.index.extents_of(ino) if (ino, i) in dirty]
        # Parallel fsyncs (an NVMe flushes many files at once far faster), in
        # batches so that a big backlog never holds thousands of fds open.
        failed: list[OSError] = []

        async def fsync_one(fd: int) -> None:
            started = False

            def run() -> None:
                nonlocal started
                started = True
                self.hot.fsync_fd(fd)  # closes it
            try:
                await trio.to_thread.run_sync(run, limiter=self.io_limiter)
            except OSError as e:  # EIO, or ENOSPC from delayed allocation
                failed.append(e)
            except BaseException:
                if not started:  # cancelled waiting for a thread: the fd is still open
                    os.close(fd)
                raise

        for start in range(0, len(keys), 256):
            fds = [fd for fd in (self.hot.dup_fd(*k) for k in keys[start:start + 256])
                   if fd is not None]
            async with trio.open_nursery() as nursery:
                for fd in fds:
                    nursery.start_soon(fsync_one, fd)
            if failed:  # the caller's errno (ENOSPC stays ENOSPC), as fsync(2) gives it
                raise FsError(failed[0].errno or errno.EIO,
                              f"hot tier fsync failed: {failed[0]}")
        await self.meta_sync.commits_so_far()

    def settle_held(self, ino: int, sizes: dict[int, int] | None = None) -> int:
        """Grow a file's recorded size to the end of the data in its extent files
        that direct writers hold (or of `sizes`: extent -> bytes in its file, already
        looked at), with new mtime and ctime if they wrote anything. Returns the
        file's size."""
        if sizes is None:
            sizes = {i: self.hot.file_size(ino, i) or 0 for i in self.index.held_indices(ino)}
        end = max((idx * self.E + min(n, self.E) for idx, n in sizes.items() if n),
                  default=0)
        try:
            node = self.meta.get_inode(ino)
        except FsError:
            return 0  # purged meanwhile
        if end:
            node.size = max(node.size, end)
            node.mtime_ns = node.ctime_ns = time.time_ns()
            if node.mode & (stat.S_ISUID | stat.S_ISGID):
                node.mode = kill_suid(node.mode)
            self.meta.put_inode(node)
        return node.size

    async def sync_all(self) -> None:
        await self.fsync(None)

    def drop_inode(self, ino: int) -> None:
        """The inode was purged from metadata: remove its hot files."""
        for idx in self.index.indices(ino):
            self.forget_hot(ino, idx, gone=True)
        self._streams.pop(ino, None)

