"""Write-back: upload dirty extents to the bucket after a delay since their last
write, with bounded parallelism. While any extent was written within the delay
(a checkpoint is being written), uploads wait up to MAX_WAIT_FACTOR delays, so
the writer has the CPU and the disk; `sync`, unmount and a full hot tier do not
wait.

An upload reads the extent in a worker thread, checksums it, puts it under a
fresh object id and then, back on the trio thread, marks the extent clean only
if nobody wrote to it meanwhile (write generation unchanged). Superseded and
unneeded objects go to the gc table in the same transaction.

Extents of small files (up to --pack-below) that are due together are packed into
one object of up to --pack-size, in inode (creation) order, so a directory written
together lands together: one PUT for many files. Each extent records its offset in
the pack and its own checksum; the pack's live references are kept in the metadata
store, which hands the pack to gc with its last one.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import replace

import trio

from ..checksum import xxh3
from ..errors import ColdStoreError, FsError, TierfsError
from ..hot.store import open_copy
from ..meta.schema import DIRTY, Ref, object_name
from .cache import Key
from .checkpoint import Fenced

log = logging.getLogger(__name__)

MAX_WAIT_FACTOR = 4
MAX_BACKOFF_S = 5.0  # between upload rounds while the bucket fails
PAUSE_CHECK_S = 1.0  # how often a flush looks whether this node was taken over
PACKS_IN_FLIGHT = 2
# Uploads handed out ahead of a free slot: per --upload-parallel slot for single
# extents, in all for packs. The rest of a backlog waits in the index's queue.
SINGLES_AHEAD = 4
PACKS_AHEAD = PACKS_IN_FLIGHT + 1
# While a pack fills, extents quiet for one delay (not yet due) read past at most per round.
FILL_SCAN = 4096


async def _nothing() -> None:
    pass


class HotFilesLost(TierfsError):
    """Dirty extents whose hot file was deleted behind the daemon's back: they can
    never upload, so waiting for them would never end (EIO)."""


class Uploader:
    def __init__(self, engine, space, *, delay: float, parallel: int, pack_below: int = 0,
                 pack_size: int = 64 << 20):
        self.engine = engine
        self.space = space
        self.delay = delay
        self.limit = trio.CapacityLimiter(parallel)
        self.pack_below, self.pack_size = pack_below, pack_size
        # A pack is held in memory while it is read and put: two at a time bound that.
        self.pack_limit = trio.CapacityLimiter(PACKS_IN_FLIGHT)
        self.in_flight: set[Key] = set()  # handed to an upload (running or waiting for a slot)
        self.singles_out = self.packs_out = 0  # such uploads of one extent, of a pack
        self.on_finished = lambda inos: None   # uploads of these inodes ended
        self.ids_ready = _nothing                # awaited before an object id is taken
        self._wake = trio.Event()
        self.changed = trio.Event()           # fires after every finished upload
        self.failures = 0
        self.last_error: str | None = None   # of the latest failed upload, for sync/status
        self.backoff_until = 0.0
        self.paused = lambda: False  # e.g. while this node is fenced off
        self.lost: dict[Key, int] = {}  # dirty extents whose hot file is gone: their gen
        space.kick_uploader = self.kick

    def kick(self) -> None:
        self._wake.set()

    def hurry(self, ino: int) -> None:
        """Upload a file's dirty extents without the usual delay (`sync` of it; or a
        shared namespace: it was closed, and other nodes read it only once it is in
        the bucket)."""
        self.engine.index.rush_inode(ino)
        self.kick()

    def _filling(self, now: float) -> bool:
        """Whether packs wait to be filled: the mount is being written (a data set
        copied in file by file), and nothing asks for everything to go at once."""
        return (bool(self.pack_below) and now - self.engine.index.last_write < self.delay
                and not self.space.need_upload.is_set())

    def _due(self, now: float):
        """(key, due) of the extents no upload has taken, in queue order: least recently
        written first, those to go at once before them. Reads the queue only up to the
        first extent not due yet, so a round costs what it hands out, not the backlog.
        While packs are filling, extents quiet for one delay follow, not due (up to
        FILL_SCAN of them): the small ones among them may fill a pack."""
        index = self.engine.index
        urgent_all = self.space.need_upload.is_set()
        # While the mount is being written, uploads wait (they would take CPU and disk
        # from the writer), but never longer than MAX_WAIT_FACTOR delays. Extents found
        # dirty at mount do not wait at all: whoever wrote them is gone.
        writing = now - index.last_write < self.delay
        quiet_for = self.delay * (MAX_WAIT_FACTOR if writing else 1)
        filling = self._filling(now)
        fillers = 0
        held, rush = index.held, index.rush  # held: a direct writer is writing them
        for key in index.queued:
            if key in self.in_flight or key in held:
                continue
            info = index.dirty[key]
            if self.lost.get(key) == info.gen:
                continue  # nothing to upload it from, until it is written or removed
            if (urgent_all or info.found or key[0] in rush
                    or now - info.last_write >= quiet_for):
                yield key, True
            elif filling and now - info.last_write >= self.delay and fillers < FILL_SCAN:
                fillers += 1
                yield key, False
            else:
                return  # the rest were written later still

    def _select(self, now: float) -> tuple[list[Key], list[list[Key]], bool]:
        """Hand out due extents, as many as the uploads under way leave room for:
        (extents uploaded alone, batches to pack, whether due ones are left). Extents
        of files up to pack_below bytes are packed, in inode order, up to pack_size
        bytes a batch. Only a few uploads wait for a slot at any time, so a backlog of
        any size costs neither a task nor a round's walk per extent."""
        if self.paused():
            return [], [], False
        E = self.engine.E
        single_room = SINGLES_AHEAD * int(self.limit.total_tokens) - self.singles_out
        pack_room = (PACKS_AHEAD - self.packs_out) * self.pack_size
        single, small, sizes = [], [], {}
        small_bytes, left = 0, False

        def length(key: Key) -> int:  # of an extent of a small file
            return max(0, min(E, sizes[key[0]] - key[1] * E))

        for key, due in self._due(now):
            ino = key[0]
            is_small = False
            if self.pack_below:
                if ino not in sizes:
                    sizes[ino] = self._size(ino)
                is_small = 0 < sizes[ino] <= self.pack_below
            if not (due or is_small):
                continue  # quiet, but it is no filler of a pack
            if is_small:
                if small_bytes >= pack_room:
                    left = True
                    break
                small.append(key)
                small_bytes += length(key)
            else:
                if len(single) >= single_room:
                    left = True
                    break
                single.append(key)
        batches: list[list[Key]] = []
        batch, nbytes = [], 0
        for key in sorted(small):
            if batch and nbytes + length(key) > self.pack_size:
                batches.append(batch)
                batch, nbytes = [], 0
            batch.append(key)
            nbytes += length(key)
        if batch:
            batches.append(batch)
        if self._filling(now):
            batches = [b for b in batches if self._pack_ready(b, length, now)]
        single += [b[0] for b in batches if len(b) == 1]
        return single, [b for b in batches if len(b) > 1], left

    def _pack_ready(self, batch: list[Key], length, now: float) -> bool:
        """While packs are filling, whether one goes now: once it holds half of
        --pack-size, or once its oldest file has waited one delay longer than a due
        one (each round alone would find only the files that came due since the last,
        packs of a fraction of a second's writes, and a cold read one GET per pack),
        or when a file of it is to go at once (sync)."""
        index = self.engine.index
        if sum(length(key) for key in batch) >= self.pack_size // 2:
            return True
        infos = [index.dirty[key] for key in batch]
        if any(info.found or key[0] in index.rush for key, info in zip(batch, infos)):
            return True
        oldest = min(info.last_write for info in infos)
        return now - oldest >= self.delay * (MAX_WAIT_FACTOR + 1)

    def _size(self, ino: int) -> int:
        try:
            return self.engine.meta.get_inode(ino).size
        except FsError:
            return -1  # purged: upload() sorts it out

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            while True:
                now = time.monotonic()
                if now >= self.backoff_until:
                    single, packs, left = self._select(now)
                    for key in single:
                        self._take([key])
                        self.singles_out += 1
                        nursery.start_soon(self._upload_one, key)
                    for batch in packs:
                        self._take(batch)
                        self.packs_out += 1
                        nursery.start_soon(self._upload_pack, batch)
                    if not left:  # a full hot tier's call is answered once all is out
                        self.space.need_upload = trio.Event()
                with trio.move_on_after(min(0.5, max(self.delay / 2, 0.05))):
                    await self._wake.wait()
                self._wake = trio.Event()

    def _take(self, keys: list[Key]) -> None:
        self.in_flight.update(keys)
        for key in keys:
            self.engine.index.take(key)

    async def _upload_one(self, key: Key) -> None:
        try:
            async with self.limit:
                done = await self.upload(key)
            await self._now_clean(done)
        except (ColdStoreError, FsError) as e:  # the bucket, or a shared namespace's database
            self._failed(e, f"inode {key[0]} extent {key[1]}")
        except Exception as e:
            self._failed(e, f"inode {key[0]} extent {key[1]}", unexpected=True)
        finally:
            self.singles_out -= 1
            self._finished([key])

    async def _upload_pack(self, batch: list[Key]) -> None:
        try:
            async with self.limit, self.pack_limit:
                done = await self.upload_pack(batch)
            await self._now_clean(done)
        except (ColdStoreError, FsError) as e:
            self._failed(e, f"a pack of {len(batch)} extents")
        except Exception as e:
            self._failed(e, f"a pack of {len(batch)} extents", unexpected=True)
        finally:
            self.packs_out -= 1
            self._finished(batch)

    async def _now_clean(self, done: list[tuple[Key, int]]) -> None:
        """Uploaded extents (key, generation uploaded), their records committed clean,
        become clean on the hot tier, and so evictable, once those commits are durable.
        A hot copy dropped before that could be the only copy after a power cut, which
        takes the records back to dirty and leaves the object named by none of them."""
        if not done:
            return
        await self.engine.meta_sync.commits_so_far()
        for key, gen in done:
            self.engine.index.cleaned(key, gen)
        self.space.uploaded()

    def _failed(self, e: Exception, what: str, unexpected: bool = False) -> None:
        """Count a failed upload and back off. `unexpected`: not the bucket's or the
        database's error (a bug, or the daemon out of descriptors or memory): logged
        with its traceback, once per distinct error, and backed off all the same, or
        every retry would fail at once and log again, in a hot loop."""
        self.failures += 1
        self.engine.stats.inc("upload_errors")
        # Back off so an outage does not become a hot loop, but try again every few
        # seconds: uploads resume soon after the bucket (or database) is back.
        self.backoff_until = time.monotonic() + min(MAX_BACKOFF_S, 0.5 * 2 ** min(self.failures, 4))
        if unexpected and self.last_error != str(e):
            log.exception("upload of %s failed; will retry", what)
        elif self.last_error is None:  # once per outage, not once per extent
            log.warning("upload of %s failed (%s); will retry", what, e)
        self.last_error = str(e)

    def _finished(self, keys: list[Key]) -> None:
        self.in_flight.difference_update(keys)
        for key in keys:
            self.engine.index.give_back(key)
        self.on_finished({k[0] for k in keys})
        self.changed.set()
        self.changed = trio.Event()
        self.kick()  # a slot is free: hand out what waits for one

    async def upload(self, key: Key) -> list[tuple[Key, int]]:
        """Upload one dirty extent as an object of its own; [(key, generation)] if its
        record is now clean (for _now_clean), [] if not."""
        engine = self.engine
        ino, idx = key
        await self.ids_ready()
        got = self._dirty_state(key)
        fd = None if got is None else engine.hot.dup_fd(ino, idx)
        if fd is None:
            if got is not None:
                self._lost(key, got[0])
            return []
        gen, length = got
        obj_id = engine.meta.next_object_id()
        name = object_name(obj_id)

        def read_and_put() -> tuple[int, int]:
            try:
                data = os.pread(fd, length, 0)
            finally:
                os.close(fd)
            if len(data) < length:  # a hole at the end of the extent
                data += bytes(length - len(data))
            checksum = xxh3(data)
            engine.cold.put(name, data)
            return len(data), checksum

        size, checksum = await self._put(obj_id, length, read_and_put)
        # Back on the trio thread: is what we uploaded still the extent's content?
        try:
            _node, exts = engine.meta.get_extents(ino, idx, idx)
        except FsError:
            exts = {}
        cur = exts.get(idx)
        info = engine.index.dirty.get(key)
        if cur is None or not cur.dirty or info is None or info.gen != gen:
            # Written, truncated or removed meanwhile: a stale copy nobody references.
            engine.meta.update(None, {}, unreferenced=[obj_id])
            engine.stats.inc("uploads_superseded")
            return []
        new = replace(cur, flags=cur.flags & ~DIRTY, length=size, checksum=checksum,
                      obj_id=obj_id, obj_off=0, obj_len=size)
        engine.meta.update(None, {key: new},
                           [cur.ref] if cur.obj_id else [], [obj_id])
        return [(key, gen)]

    async def _put(self, obj_id: int, nbytes: int, read_and_put):
        """Run read_and_put() (which reads, checksums and PUTs the `nbytes` of object
        `obj_id`) in a worker thread, return its result, count the upload. Abandoned if
        cancelled (unmount): a bucket that never answers must not hold the daemon; the
        intent stays, and the next mount cleans it up."""
        engine = self.engine
        t0 = time.monotonic()
        try:
            out = await trio.to_thread.run_sync(read_and_put, limiter=engine.s3_limiter,
                                                abandon_on_cancel=True)
        except trio.Cancelled:
            raise
        except BaseException:
            # It may exist in the bucket, or land there later (a PUT the client gave
            # up on): nothing references it, gc deletes it now and the next mount again.
            engine.meta.update(None, {}, failed=[obj_id])
            raise
        engine.stats.inc("uploads")
        engine.stats.inc("upload_bytes", nbytes)
        engine.stats.observe("upload_seconds", "", time.monotonic() - t0)
        if self.failures:
            log.info("uploads work again")
        self.failures = 0
        self.last_error = None
        return out

    def _lost(self, key: Key, gen: int) -> None:
        """The hot file of a dirty extent is gone (deleted behind the daemon's back):
        its data is lost. Said once and not handed out again (it would be at once, a
        busy loop); it stays dirty, so `sync --wait` and unmount say it is not in the
        bucket, and reads of it fail with EIO."""
        if self.lost.get(key) != gen:
            log.error("inode %d extent %d: hot file missing and not in the bucket: its "
                      "data is lost (reads give EIO; fsck --repair drops it)", *key)
            self.engine.stats.inc("hot_file_lost")
        self.lost = {k: g for k, g in self.lost.items() if k in self.engine.index.dirty}
        self.lost[key] = gen

    def lost_now(self) -> dict[Key, int]:
        """The dirty extents whose hot file is gone, as they still are (not written or
        removed since): no upload can ever take them. Key -> bytes."""
        index = self.engine.index
        return {k: index.sizes.get(k, 0) for k, gen in self.lost.items()
                if (info := index.dirty.get(k)) is not None and info.gen == gen}

    def _only_lost_left(self, waiting: set[int] | None) -> bool:
        """Whether every dirty extent a flush waits for is lost (it would wait forever)."""
        lost = self.lost_now()
        if not lost:
            return False
        index = self.engine.index
        if waiting is None:
            return len(index.dirty) == len(lost)
        return all((ino, i) in lost for ino in waiting for i in index.extents_of(ino)
                   if (ino, i) in index.dirty)

    def _dirty_state(self, key: Key) -> tuple[int, int] | None:
        """(write generation, length) of a dirty extent to upload now, or None
        (clean, held by a direct writer, removed: bookkeeping done here)."""
        engine = self.engine
        ino, idx = key
        info = engine.index.dirty.get(key)
        if info is None or key in engine.index.held:
            # Taken by a direct writer since it was found due (this task may have waited
            # for a free upload slot): its generation no longer moves with its content.
            return None
        try:
            node, exts = engine.meta.get_extents(ino, idx, idx)
        except FsError:  # the inode was purged
            engine.index.remove(key)
            return None
        ext = exts.get(idx)
        length = min(engine.E, node.size - idx * engine.E)
        if ext is None or not ext.dirty or length <= 0:
            engine.index.cleaned(key, info.gen)
            return None
        return info.gen, length

    async def upload_pack(self, batch: list[Key]) -> list[tuple[Key, int]]:
        """Upload the dirty extents of `batch` as one object; commit, in one
        transaction, those nobody wrote to meanwhile, and return them with the
        generation uploaded (for _now_clean).

        The worker thread opens each extent file when it reads it, one at a time: a
        pack may hold hundreds of thousands of tiny files, and a descriptor held per
        extent ran out of them (EMFILE) and failed the pack on every try. What it
        reads may be newer than the generation noted here (written meanwhile), or the
        file gone (truncated, removed): such a piece's generation no longer matches
        at the commit, or it has no checksum, and it stays dirty, dead bytes in the
        pack."""
        engine = self.engine
        await self.ids_ready()
        pieces = []  # (key, generation, length)
        for key in batch:
            got = self._dirty_state(key)
            if got is not None:
                pieces.append((key, *got))
        if not pieces:
            return []
        obj_id = engine.meta.next_object_id()
        name = object_name(obj_id)
        total = sum(length for _k, _g, length in pieces)
        hot = engine.hot

        def read_and_put() -> list[tuple[int, int, int | None]]:
            blob = bytearray(total)
            view = memoryview(blob)
            layout, at = [], 0
            for (ino, idx), _gen, length in pieces:
                out = view[at:at + length]
                checksum = None
                try:
                    fd = open_copy(hot.path(ino, idx), os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    pass  # gone meanwhile: zeros here, not committed
                else:
                    hot.read_into(fd, 0, out)  # closes fd; a hole at its end stays zeros
                    checksum = xxh3(out)
                layout.append((at, length, checksum))
                at += length
            if any(checksum is not None for _at, _n, checksum in layout):
                engine.cold.put(name, blob)  # else all gone: nothing worth a PUT
            return layout

        layout = await self._put(obj_id, total, read_and_put)
        engine.stats.inc("pack_uploads")
        # Back on the trio thread: which extents still hold what was uploaded?
        changed, drops, refs, done = {}, [], [], []
        for (key, gen, _length), (off, length, checksum) in zip(pieces, layout):
            ino, idx = key
            try:
                _node, exts = engine.meta.get_extents(ino, idx, idx)
            except FsError:
                continue
            cur = exts.get(idx)
            info = engine.index.dirty.get(key)
            if cur is None or not cur.dirty or info is None or info.gen != gen:
                continue  # written, truncated or removed meanwhile: dead bytes in the pack
            if checksum is None:  # its file was gone, yet nothing changed the extent
                self._lost(key, gen)
                continue
            changed[key] = replace(cur, flags=cur.flags & ~DIRTY, length=length,
                                   checksum=checksum, obj_id=obj_id, obj_off=off, obj_len=length)
            if cur.obj_id:
                drops.append(cur.ref)
            refs.append(Ref(off, length, ino, idx))
            done.append((key, gen))
        if not changed:
            engine.meta.update(None, {}, unreferenced=[obj_id])
            engine.stats.inc("uploads_superseded")
            engine.stats.inc("packs_superseded")
            return []
        engine.meta.update(None, changed, drops, [obj_id], packs={obj_id: (total, refs)})
        engine.stats.inc("packed_extents", len(done))
        return done

    async def flush(self, inos: set[int] | None) -> None:
        """Upload every dirty extent of `inos` (all if None) now and wait for it.
        Raises Fenced once this node may upload nothing more (taken over), and
        HotFilesLost once only extents whose hot file was deleted are left."""
        index = self.engine.index
        waiting = None if inos is None else {ino for ino in inos if index.has_dirty(ino)}
        # Try at once, once: cleared after every failed try, the backoff would never
        # hold, and a bucket that refuses would be asked again and again at full speed.
        if self.failures:
            self.backoff_until = 0.0
        while index.dirty if waiting is None else waiting:
            if self._only_lost_left(waiting):
                lost = self.lost_now()
                raise HotFilesLost(f"{len(lost)} extents ({sum(lost.values())} bytes) are "
                                   f"lost: their hot files were deleted from the cache dir "
                                   f"before they were uploaded (reads of them give EIO; "
                                   f"tierfs fsck --repair drops them)")
            if waiting is None:
                self.space.need_upload.set()
            else:  # again for those dirty anew since their last extent went up
                for ino in waiting - index.rush:
                    index.rush_inode(ino)
            if self.paused():
                raise Fenced("taken over: nothing more uploads from this node")
            self.kick()
            with trio.move_on_after(PAUSE_CHECK_S):  # a takeover wakes nothing here
                await self.changed.wait()
            if waiting is not None:
                waiting = {ino for ino in waiting if index.has_dirty(ino)}
