"""Metadata checkpoints: consistent copies of the LMDB environment in the bucket.

A checkpoint is taken from one LMDB read transaction (env.copy), so writers never
pause. Before the copy, the metadata "epoch" is set to the checkpoint's sequence
number; every object dropped afterwards is recorded in the gc table with that
epoch, and gc deletes it only when every kept checkpoint is newer than it.
Bucket layout: meta/ckpt-<seq:016x> holds a header line (JSON: seq, size, xxh3)
followed by the LMDB file.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time

import trio

from ..checksum import xxh3
from ..errors import ColdStoreError, TierfsError, UserError

log = logging.getLogger(__name__)

PREFIX = "meta/ckpt-"
COPY_PREFIX = "ckpt-"  # a checkpoint's copy of the database, in the cache dir


class Fenced(TierfsError):
    """This node lost the filesystem to another: it writes no checkpoint."""


class CopyFailed(TierfsError):
    """The metadata could not be copied for a checkpoint (the cache disk is full)."""


def checkpoint_name(seq: int) -> str:
    return f"{PREFIX}{seq:016x}"


def list_checkpoints(cold) -> list[int]:
    """Sequence numbers of the checkpoints in the bucket, oldest first."""
    out = []
    for key in cold.list(PREFIX):
        try:
            out.append(int(key[len(PREFIX):], 16))
        except ValueError:
            continue
    return sorted(out)


def pack(seq: int, db: bytes) -> bytes:
    header = json.dumps({"seq": seq, "size": len(db), "xxh3": xxh3(db)}).encode()
    return header + b"\n" + db


def unpack(blob: bytes) -> tuple[int, bytes]:
    """(seq, LMDB file bytes) of a checkpoint; raises UserError if damaged."""
    head, _, db = blob.partition(b"\n")
    try:
        meta = json.loads(head)
    except ValueError:
        meta = None
    # A damaged header may still parse (a flipped byte in a key): damaged all the same.
    if not isinstance(meta, dict) or not {"seq", "size", "xxh3"} <= meta.keys():
        raise UserError("checkpoint header is damaged")
    if len(db) != meta["size"] or xxh3(db) != meta["xxh3"]:
        raise UserError(f"checkpoint {meta.get('seq')} failed its checksum")
    return meta["seq"], db


def remove_left_copies(workdir: str) -> None:
    """Remove the copies a daemon killed during a checkpoint left in `workdir` (each
    as large as the metadata; blocking: at startup, with the cache dir locked)."""
    for entry in os.scandir(workdir):
        if entry.name.startswith(COPY_PREFIX) and entry.is_dir(follow_symlinks=False):
            log.info("removing %s, left by a daemon stopped during a checkpoint", entry.path)
            shutil.rmtree(entry.path, ignore_errors=True)


def snapshot(meta_store, workdir: str) -> bytes:
    """A consistent, compacted copy of the LMDB file (blocking: run in a thread)."""
    tmp = tempfile.mkdtemp(prefix=COPY_PREFIX, dir=workdir)
    try:
        with open(meta_store.kv.copy_to(tmp), "rb") as f:
            return f.read()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class Checkpointer:
    def __init__(self, engine, workdir: str, *, interval: float, keep: int):
        self.engine = engine
        self.workdir = workdir
        self.interval = interval
        self.keep = max(1, keep)
        self.kept: list[int] = []
        self._in_flight: int | None = None  # the checkpoint being taken and put
        # Checkpoints whose PUT failed: they may have landed all the same (the answer
        # lost, or the PUT abandoned), so gc keeps what they name until the next one
        # lands and prunes them.
        self._unsure: list[int] = []
        # Checkpoints being deleted: kept for gc until the delete is done, as one that
        # fails stays in the bucket (and kept), naming what it names.
        self._pruning: list[int] = []
        self._lock = trio.Lock()
        # Blocking check that the filesystem is still this node's (the lease): a
        # node taken over must not put or prune checkpoints the new holder relies on.
        self.still_ours = lambda: True

    def load(self) -> None:
        """Learn which checkpoints exist (blocking; at startup)."""
        remove_left_copies(self.workdir)
        self.kept = list_checkpoints(self.engine.cold)
        self._tell_gc()

    def _tell_gc(self) -> None:
        # The checkpoint on its way counts as kept from the moment its epoch begins:
        # the first of a new filesystem, with nothing kept yet, must not find the
        # objects it names deleted once it lands.
        taken = self.kept[:1] + self._unsure[:1] + self._pruning + (
            [self._in_flight] if self._in_flight is not None else [])
        oldest = min(taken) if taken else None
        # An object dropped in epoch e may be in checkpoints <= e: keep it until
        # every kept checkpoint is newer.
        self.engine.gc_guard = (lambda epoch: oldest is None or epoch < oldest)

    async def run(self) -> None:
        if self.interval <= 0:
            return
        while True:
            await trio.sleep(self.interval)
            try:
                await self.checkpoint()
            except (ColdStoreError, CopyFailed) as e:
                log.warning("metadata checkpoint failed (%s); will retry", e)
            except Fenced:
                return

    async def checkpoint(self) -> int:
        async with self._lock:
            engine = self.engine
            seq = engine.meta.begin_epoch()
            self._in_flight = seq
            self._tell_gc()
            try:
                return await self._take(seq)
            finally:
                self._in_flight = None
                self._tell_gc()

    async def _landed_after_all(self) -> list[int]:
        """Those of the unsure checkpoints that are in the bucket (one LIST, not a
        DELETE for each of the many a long outage may leave), now that a newer one
        landed; forgotten then. Kept unsure if the bucket cannot say."""
        if not self._unsure:
            return []
        try:
            there = set(await trio.to_thread.run_sync(
                list_checkpoints, self.engine.cold, limiter=self.engine.s3_limiter,
                abandon_on_cancel=True))
        except ColdStoreError:
            return []
        landed, self._unsure = [s for s in self._unsure if s in there], []
        return landed

    async def _prune(self, seqs: list[int]) -> None:
        """Delete these checkpoints from the bucket. One that cannot be deleted is
        kept (gc keeps what it names) and pruned next time: this checkpoint landed,
        and that is what its caller (`sync --wait`, unmount) needs to know."""
        failed, error = [], None
        for seq in seqs:
            try:
                await trio.to_thread.run_sync(self.engine.cold.delete, checkpoint_name(seq),
                                              limiter=self.engine.s3_limiter,
                                              abandon_on_cancel=True)
            except ColdStoreError as e:
                failed.append(seq)
                error = e
        self._pruning = []
        if failed:
            log.warning("pruning %d old metadata checkpoints failed (%s); will retry",
                        len(failed), error)
            self.kept = sorted(failed + self.kept)
        self._tell_gc()

    async def _take(self, seq: int) -> int:
        """Copy the metadata, put it in the bucket, prune the oldest."""
        engine = self.engine
        t0 = time.monotonic()
        try:
            with engine.meta.reading_in_thread():
                db = await trio.to_thread.run_sync(snapshot, engine.meta, self.workdir,
                                                   limiter=engine.io_limiter)
        except OSError as e:
            raise CopyFailed(f"metadata checkpoint {seq} failed: copying the metadata into "
                             f"{self.workdir} failed ({e.strerror or e}): a checkpoint needs "
                             f"room there for a copy of the metadata") from None
        finally:
            engine.meta.copy_taken()
        blob = await trio.to_thread.run_sync(pack, seq, db)
        if not await trio.to_thread.run_sync(self.still_ours, abandon_on_cancel=True):
            raise Fenced("taken over: no more checkpoints from this node")
        # The local metadata goes to disk first (LMDB commits without fsync): after
        # a power cut it must not be older than a checkpoint in the bucket, whose
        # objects its counters would then hand out again.
        await engine.meta_sync.commits_so_far()
        try:
            await trio.to_thread.run_sync(engine.cold.put, checkpoint_name(seq), blob,
                                          limiter=engine.s3_limiter, abandon_on_cancel=True)
        except BaseException:
            self._unsure.append(seq)
            raise
        self.kept.append(seq)
        old, self.kept = self.kept[:-self.keep], self.kept[-self.keep:]
        old += await self._landed_after_all()
        self._pruning = old
        self._tell_gc()
        await self._prune(old)
        engine.stats.inc("checkpoints")
        log.info("metadata checkpoint %d: %d bytes in %.2fs", seq, len(db),
                 time.monotonic() - t0)
        return seq
