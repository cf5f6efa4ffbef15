"""Extents held by direct writers (tierfs.open(path, "wb") and friends).

A direct writer writes into hot extent files through descriptors the daemon gave
it, so the engine does not see its writes one by one. While it holds an extent:
- the extent is HOT and DIRTY in the metadata (a daemon killed meanwhile finds it
  dirty and uploads it), and counts as a whole extent on the hot tier (the writer
  may fill it), so holds are granted only while there is room;
- it is never uploaded (the upload would read a half-written extent) and never
  evicted (it is dirty);
- a truncate through the mount empties its file instead of removing it, so later
  writes land where the writer's descriptor points, as they would on a local disk.
Releasing an extent gives it a new write generation (an upload that read it before
cannot mark it clean) and grows the file's size to the end of what its extent file
holds, so the uploader sees the data. Everything here runs on the trio thread;
holding may wait for fetches and for room, never inside a metadata transaction.
"""
from __future__ import annotations

import logging
import os
from dataclasses import replace

from ..errors import FsError
from ..meta.schema import DIRTY, HOT, Extent

log = logging.getLogger(__name__)


class DirectWrites:
    def __init__(self, engine):
        self.engine = engine
        self.index = engine.index

    async def hold(self, ino: int, first: int, last: int, flags: int) -> list[tuple[int, int]]:
        """Hold extents first..last of a file for a direct writer: (index, descriptor
        of the hot extent file opened with `flags`) for each one granted. The first is
        always granted (waiting for a fetch or for room as a write through the mount
        would, then ENOSPC); the others only as far as room is there without waiting
        (clean extents may be evicted for them).
        Cold extents are fetched first, and copies found at mount checked: the
        writer may change part of them."""
        granted: list[tuple[int, int]] = []
        records: dict = {}  # HOT|DIRTY for the extents granted, in one transaction
        try:
            await self._take(ino, first, last, flags, granted, records)
            self._commit(records)
        except BaseException:
            # Nothing granted may stay held (a held extent never uploads), also when
            # the commit of their records is what failed (a full metadata database).
            for _i, fd in granted:
                os.close(fd)
            if granted:
                try:
                    self._commit(records)
                finally:
                    self.release(ino, [i for i, _fd in granted])
            raise
        return granted

    async def _take(self, ino: int, first: int, last: int, flags: int, granted: list,
                    records: dict) -> None:
        """hold()'s part: append (index, descriptor) to `granted` and the records to
        commit to `records`, for as many extents as hold() grants."""
        engine = self.engine
        E = engine.E
        for idx in range(first, last + 1):
            key = (ino, idx)
            engine.busy.add(key)
            try:
                while True:
                    engine.state.check_writable()
                    _node, exts = engine.meta.get_extents(ino, idx, idx)
                    ext = exts.get(idx)
                    # Only the first extent ever waits: nothing is granted (and
                    # nothing uncommitted in `records`) across an await.
                    # A copy whose file vanished (a cleaner in the cache dir) is
                    # fetched too: a new empty file would upload zeros over it.
                    if ext is not None and engine.needs_ensure_hot(ino, idx, ext):
                        if granted:
                            return  # the next request gets it
                        await engine.ensure_hot(ino, idx)
                        continue
                    growth = 0 if key in self.index.held else \
                        max(0, E - self.index.sizes.get(key, 0))
                    space = engine.space
                    if growth and space is not None and space.needs_room(growth):
                        if not granted:
                            await space.reserve(growth)  # waits as a write would
                            continue
                        if not space.room_now(growth):
                            return
                    break
                fd = engine.hot.open_private(ino, idx, flags | os.O_CREAT)
                try:
                    size = os.fstat(fd).st_size
                except BaseException:
                    os.close(fd)
                    raise
                if ext is None or not ext.dirty:
                    records[key] = Extent(flags=HOT | DIRTY) if ext is None else \
                        replace(ext, flags=ext.flags | HOT | DIRTY)
                self.index.written(key, size)  # dirty, a new generation
                self.index.grow(key, E)        # the writer may fill it
                self.index.held[key] = self.index.held.get(key, 0) + 1
                granted.append((idx, fd))
            finally:
                engine.busy.discard(key)

    def _commit(self, records: dict) -> None:
        if records:
            self.engine.meta.update(None, dict(records))
            records.clear()

    def release(self, ino: int, idxs) -> int:
        """The writer closed its descriptors of these extents: account them at their
        real size, dirty with a new generation, and grow the file to the end of its
        data. Returns the file's size."""
        engine = self.engine
        done: dict[int, int] = {}  # extent -> bytes in its file
        for idx in idxs:
            key = (ino, idx)
            left = self.index.held.get(key, 0) - 1
            if left < 0:
                continue  # not held (a writer asking twice): nothing to undo
            size = engine.hot.file_size(ino, idx)
            if size is not None and size > engine.E:
                # A writer that wrote past its extent's end (tierfs's own library never
                # does): that is another extent's place, and room the hot tier's limit
                # did not count. Cut, and say so.
                log.warning("inode %d extent %d: a direct writer wrote %d bytes past the "
                            "extent's end; they are dropped", ino, idx, size - engine.E)
                engine.hot.truncate(ino, idx, engine.E)
                size = engine.E
            if left:
                self.index.held[key] = left
            else:
                del self.index.held[key]
                if size is not None:
                    self.index.set_size(key, size)
            if size is not None:
                self.index.written(key, size)  # uploads after the delay, as a write would
                done[idx] = size
        size = engine.settle_held(ino, done)
        self._drop_unwritten(ino, [i for i, n in done.items() if not n], size)
        return size

    def _drop_unwritten(self, ino: int, empty: list[int], size: int) -> None:
        """Extents held ahead of a writer that never got there (their files are
        empty): nothing to keep."""
        engine = self.engine
        gone = {}
        for idx in empty:
            key = (ino, idx)
            if key in self.index.held or idx * engine.E < size:
                continue
            try:
                ext = engine.meta.get_extents(ino, idx, idx)[1].get(idx)
            except FsError:  # the file is gone
                engine.forget_hot(ino, idx)
                continue
            if ext is not None and not ext.obj_id:
                gone[key] = None
                engine.forget_hot(ino, idx)
        if gone:
            engine.meta.update(None, gone)
