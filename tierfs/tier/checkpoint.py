"""Metadata checkpoints: consistent copies of the LMDB environment in the bucket.

A checkpoint is taken from one LMDB read transaction (env.copy), so writers never
pause. Before the copy, the metadata "epoch" is set to the checkpoint's sequence
number; every object dropped afterwards is recorded in the gc table with that
epoch, and gc deletes it only when every kept checkpoint is newer than it.
Bucket layout: meta/ckpt-<seq:016x> holds a header line (JSON: seq, size, xxh3)
followed by the LMDB file.
"""
from __future__ import annotations

import io
import json
import logging
import os
import shutil
import tempfile
import time

import trio
import xxhash

from ..checksum import xxh3
from ..cold.base import FILE_PIECE
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


HEADER_MAX = 4096  # a header line is under 100 bytes: more is a damaged checkpoint


def header(seq: int, size: int, digest: int) -> bytes:
    return json.dumps({"seq": seq, "size": size, "xxh3": digest}).encode() + b"\n"


def pack(seq: int, db: bytes) -> bytes:
    return header(seq, len(db), xxh3(db)) + db


def parse_header(head: bytes) -> tuple[dict, int]:
    """The header of a checkpoint that starts with `head`, and where its LMDB file
    starts; raises UserError if damaged."""
    line, newline, _ = head.partition(b"\n")
    try:
        meta = json.loads(line) if newline else None
    except ValueError:
        meta = None
    # A damaged header may still parse (a flipped byte in a key): damaged all the same.
    if not isinstance(meta, dict) or not {"seq", "size", "xxh3"} <= meta.keys():
        raise UserError("checkpoint header is damaged")
    return meta, len(line) + 1


def file_digest(path: str) -> tuple[int, int]:
    """(size, xxh3) of a file, read in pieces (blocking)."""
    h, size = xxhash.xxh3_64(), 0
    with open(path, "rb") as f:
        while piece := f.read(FILE_PIECE):
            h.update(piece)
            size += len(piece)
    return size, h.intdigest()


class _HeaderThen(io.RawIOBase):
    """A checkpoint as a seekable file to upload: its header, then the LMDB copy
    (read from the file as sent, never held in memory whole)."""

    def __init__(self, head: bytes, f):
        self.head, self.f = head, f
        self.size = len(head) + os.fstat(f.fileno()).st_size
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        self.pos = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.size}[whence] + pos
        return self.pos

    def read(self, n: int = -1) -> bytes:
        n = self.size - self.pos if n is None or n < 0 else min(n, self.size - self.pos)
        if n <= 0:
            return b""
        out = self.head[self.pos:self.pos + n]
        if len(out) < n:
            self.f.seek(self.pos + len(out) - len(self.head))
            out += self.f.read(n - len(out))
        self.pos += len(out)
        return out

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)


def put_checkpoint(cold, seq: int, path: str) -> int:
    """Put the LMDB copy at `path` in the bucket as checkpoint `seq`, streamed from
    the file (blocking); its size."""
    size, digest = file_digest(path)
    with open(path, "rb") as f:
        cold.put_file(checkpoint_name(seq), _HeaderThen(header(seq, size, digest), f))
    return size


def get_checkpoint(cold, seq: int, path: str) -> None:
    """Write checkpoint `seq`'s LMDB file to `path`, streamed, synced and verified
    (blocking); raises UserError if damaged, ObjectNotFound if it is gone."""
    name = checkpoint_name(seq)
    meta, start = parse_header(cold.get(name, 0, HEADER_MAX))
    with open(path, "wb") as f:
        cold.get_file(name, f, start)
        f.flush()
        os.fsync(f.fileno())
    if file_digest(path) != (meta["size"], meta["xxh3"]):
        raise UserError(f"checkpoint {meta.get('seq')} failed its checksum")


def remove_left_copies(workdir: str) -> None:
    """Remove the copies a daemon killed during a checkpoint left in `workdir` (each
    as large as the metadata; blocking: at startup, with the cache dir locked)."""
    for entry in os.scandir(workdir):
        if entry.name.startswith(COPY_PREFIX) and entry.is_dir(follow_symlinks=False):
            log.info("removing %s, left by a daemon stopped during a checkpoint", entry.path)
            shutil.rmtree(entry.path, ignore_errors=True)


def snapshot(meta_store, workdir: str) -> str:
    """A consistent, compacted copy of the LMDB file, in a directory of its own in
    `workdir` (blocking: run in a thread); its path. Remove it with remove_copy."""
    tmp = tempfile.mkdtemp(prefix=COPY_PREFIX, dir=workdir)
    try:
        return meta_store.kv.copy_to(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_copy(path: str) -> None:
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


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
                copy = await trio.to_thread.run_sync(snapshot, engine.meta, self.workdir,
                                                     limiter=engine.io_limiter)
        except OSError as e:
            raise CopyFailed(f"metadata checkpoint {seq} failed: copying the metadata into "
                             f"{self.workdir} failed ({e.strerror or e}): a checkpoint needs "
                             f"room there for a copy of the metadata") from None
        finally:
            engine.meta.copy_taken()
        try:
            size = await self._put(seq, copy)
        finally:
            # Also when cancelled: the copy is as large as the metadata.
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(remove_copy, copy, limiter=engine.io_limiter)
        self.kept.append(seq)
        old, self.kept = self.kept[:-self.keep], self.kept[-self.keep:]
        old += await self._landed_after_all()
        self._pruning = old
        self._tell_gc()
        await self._prune(old)
        engine.stats.inc("checkpoints")
        log.info("metadata checkpoint %d: %d bytes in %.2fs", seq, size,
                 time.monotonic() - t0)
        return seq

    async def _put(self, seq: int, copy: str) -> int:
        """Put the copy in the bucket, streamed from the file; its size."""
        engine = self.engine
        if not await trio.to_thread.run_sync(self.still_ours, abandon_on_cancel=True):
            raise Fenced("taken over: no more checkpoints from this node")
        # The local metadata goes to disk first (LMDB commits without fsync): after
        # a power cut it must not be older than a checkpoint in the bucket, whose
        # objects its counters would then hand out again.
        await engine.meta_sync.commits_so_far()
        try:
            return await trio.to_thread.run_sync(put_checkpoint, engine.cold, seq, copy,
                                                 limiter=engine.s3_limiter,
                                                 abandon_on_cancel=True)
        except OSError as e:  # reading the copy back
            self._unsure.append(seq)
            raise CopyFailed(f"metadata checkpoint {seq} failed: reading its copy in "
                             f"{self.workdir} failed ({e.strerror or e})") from None
        except BaseException:
            self._unsure.append(seq)
            raise
