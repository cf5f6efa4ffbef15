"""Compaction: rewrite packs that are mostly dead, so the bucket stays near live size.

A pack loses bytes as its files are deleted or rewritten, and is deleted only with
its last reference. A pack whose dead share passes --compact-dead is rewritten: its
live extents are read back with ranged GETs (each checked against its checksum),
packed into a new object under an upload intent, and, in one transaction, every
extent whose record still points into the old pack moves to the new one (extents
changed meanwhile are dead bytes in the new pack from the start). That drops the
old pack's references, so gc deletes it under the usual checkpoint rule. A pack
with a damaged piece, missing from the bucket or refused by it, is left as it is. A crash
before the transaction leaves an intent (its object is deleted at the next mount)
and the old pack as it was. --compact-rate bounds the bytes rewritten per second.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace

import trio

from ..checksum import object_matches
from ..errors import ColdStoreError, FsError, ObjectNotFound
from ..meta import scan
from ..meta.schema import Ref, object_name
from .failure_log import FailureLog

log = logging.getLogger(__name__)

SPAN_GAP = 256 << 10  # live pieces closer than this are read with one GET (gap included)


class Compactor:
    def __init__(self, engine, *, dead_share: float, rate: int, pack_size: int,
                 interval: float = 5.0):
        self.engine = engine
        self.dead_share = dead_share
        self.rate = rate
        self.pack_size = pack_size
        self.interval = interval
        self.paused = lambda: False  # e.g. while this node is fenced off
        self.stuck: set[int] = set()  # packs with a damaged piece: not retried until remount
        self.failures = FailureLog(log, "compaction")

    async def run(self) -> None:
        if not self.rate or self.dead_share >= 1:
            return  # compaction is off
        while True:
            await trio.sleep(self.interval)
            while not self.paused() and await self.compact_once():
                pass  # more to do: the rate bound paces it

    def candidates(self) -> list[int]:
        """Packs past the dead share, the deadest first."""
        dead = [(p.live / p.total if p.total else 0.0, obj_id)
                for obj_id, p in scan.packs(self.engine.meta)
                if p.total and 1 - p.live / p.total > self.dead_share]
        return [obj_id for _share, obj_id in sorted(dead)]

    def _live(self, obj_id: int) -> list[tuple[Ref, object]]:
        """(reference, extent record) of the extents still held in a pack, clean ones."""
        out = []
        for ref in self.engine.meta.pack_refs(obj_id):
            try:
                ext = self.engine.meta.get_extents(ref.ino, ref.index, ref.index)[1].get(ref.index)
            except FsError:
                continue
            if ext is not None and not ext.dirty and ext.ref == (obj_id, ref.offset, ref.length):
                out.append((ref, ext))
        return out

    def _pick(self) -> tuple[list, int]:
        """(worker thread: a pack of small files has thousands of records to read) The
        deadest packs with their live pieces, as many as fit in one new pack."""
        picked, nbytes = [], 0
        for obj_id in self.candidates():
            live = self._live(obj_id) if obj_id not in self.stuck else []
            if not live:
                continue  # its live extents are being rewritten: their uploads drop it
            size = sum(ref.length for ref, _ext in live)
            if picked and nbytes + size > self.pack_size:
                break
            picked.append((obj_id, live))
            nbytes += size
        return picked, nbytes

    async def compact_once(self) -> int:
        """Rewrite the deadest packs (as many as fit in one new pack); bytes moved.
        What the records said when picked is checked again when committing."""
        engine = self.engine
        with engine.meta.reading_in_thread():
            picked, nbytes = await trio.to_thread.run_sync(self._pick)
        if not picked:
            return 0
        new_id = engine.meta.next_object_id()
        engine.stats.inc("compaction_runs")
        t0 = time.monotonic()
        try:
            pieces, missing, unreadable = await trio.to_thread.run_sync(
                self._read_and_put, picked, new_id, limiter=engine.s3_limiter,
                abandon_on_cancel=True)
        except trio.Cancelled:
            raise
        except BaseException as e:
            engine.meta.update(None, {}, failed=[new_id])  # its PUT may land yet
            if isinstance(e, ColdStoreError):
                self.failures.failed(e)
                return 0
            raise
        self.failures.worked()
        read = {(obj_id, ref.offset) for (obj_id, ref), _e, _at in pieces}
        self.stuck |= {obj_id for obj_id, live in picked
                       if any((obj_id, ref.offset) not in read for ref, _e in live)}
        moved = self._commit(new_id, pieces)
        for obj_id, count in missing.items():
            if engine.meta.pack(obj_id) is not None:  # else its files all went meanwhile
                log.error("compaction: pack %s is missing from the bucket: its %d extents "
                          "read EIO (fsck --repair drops them); it is left as it is",
                          object_name(obj_id), count)
        for obj_id, e in unreadable.items():
            log.error("compaction: the bucket refuses to read pack %s (%s): its files read "
                      "EIO until it is readable again (an archived object must be restored); "
                      "it is left as it is", object_name(obj_id), e)
        # The rate bound: a pass of n bytes takes at least n / rate seconds.
        await trio.sleep(max(0.0, nbytes / self.rate - (time.monotonic() - t0)))
        return moved

    def _read_and_put(self, picked, new_id: int):
        """(worker thread) Read every live piece (verified), put them as one new pack;
        ([(old ref, record read, new offset)] of the pieces it holds, {pack id: live
        pieces} of the packs missing from the bucket, {pack id: error} of the packs the
        bucket refuses to read)."""
        cold = self.engine.cold
        blob, pieces, missing, unreadable = bytearray(), [], {}, {}
        for obj_id, live in picked:
            for span in _spans(live):
                lo = span[0][0].offset
                hi = span[-1][0].offset + span[-1][0].length
                try:
                    data = cold.get(object_name(obj_id), lo, hi - lo)
                except ObjectNotFound:
                    # Lost (or deleted with its last file meanwhile): the other packs
                    # are compacted all the same, this one is not retried.
                    missing[obj_id] = len(live)
                    break
                except ColdStoreError as e:
                    if e.transient:
                        raise  # an outage: the whole pass is tried again later
                    # Refused for this object only (archived, or its key denied): as
                    # for a lost pack, the others are compacted all the same.
                    unreadable[obj_id] = e
                    break
                for ref, ext in span:
                    piece = data[ref.offset - lo:ref.offset - lo + ref.length]
                    if not object_matches(piece, ref.length, ext.checksum):
                        log.error("compaction: inode %d extent %d fails its checksum in "
                                  "object %s; left where it is", ref.ino, ref.index,
                                  object_name(obj_id))
                        continue
                    pieces.append(((obj_id, ref), ext, len(blob)))
                    blob += piece
        if pieces:
            cold.put(object_name(new_id), blob)
        return pieces, missing, unreadable

    def _commit(self, new_id: int, pieces) -> int:
        """Move the extents that still hold what was read into the new pack, in one
        transaction; the rest of it is dead from the start. Returns the bytes moved."""
        meta, stats = self.engine.meta, self.engine.stats
        changed, drops, refs = {}, [], []
        total = sum(ref.length for (_o, ref), _e, _at in pieces)
        for (obj_id, ref), ext, at in pieces:
            key = (ref.ino, ref.index)
            try:
                cur = meta.get_extents(ref.ino, ref.index, ref.index)[1].get(ref.index)
            except FsError:
                continue
            if (cur is None or cur.dirty or cur.ref != (obj_id, ref.offset, ref.length)
                    or cur.checksum != ext.checksum):
                continue  # written, truncated or removed since it was read
            changed[key] = replace(cur, obj_id=new_id, obj_off=at, obj_len=ref.length)
            drops.append(cur.ref)
            refs.append(Ref(at, ref.length, ref.ino, ref.index))
        if not changed:
            meta.update(None, {}, unreferenced=[new_id])
            return 0
        meta.update(None, changed, drops, [new_id], packs={new_id: (total, refs)})
        moved = sum(r.length for r in refs)
        stats.inc("compactions")
        stats.inc("compacted_bytes", moved)
        return moved


def _spans(live):
    """The live pieces of one pack in offset order, grouped into runs read by one GET."""
    spans: list[list] = []
    for ref, ext in sorted(live, key=lambda p: p[0].offset):
        if spans:
            last = spans[-1][-1][0]
            if ref.offset - (last.offset + last.length) <= SPAN_GAP:
                spans[-1].append((ref, ext))
                continue
        spans.append([(ref, ext)])
    return spans
