"""Rebuild a node's metadata from the newest checkpoint in the bucket.

Everything uploaded before that checkpoint reads back (checksums verified as
usual). Extents that were dirty on the dead node are reported: with an older
uploaded version the file comes back with that version, without one the bytes
read as zeros. Objects uploaded after the checkpoint are unreferenced and go to
the gc table.
"""
from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, field, replace

from ..cold.file import fsync_dir
from ..errors import ObjectNotFound, UserError
from ..meta import MetaStore, scan
from ..meta.schema import DIRTY, HOT, object_name
from .checkpoint import get_checkpoint, list_checkpoints

log = logging.getLogger(__name__)

# Object ids a node taken over might still allocate before it notices (it stops
# within a lease renewal); the recovered node's ids start this far above.
OBJECT_ID_GAP = 1 << 32
CHECKPOINT_GAP = 1 << 16
# Listings of the checkpoints recovery tries, when the one it listed is pruned meanwhile.
LISTINGS = 5


@dataclass
class RecoveryReport:
    checkpoint: int
    files: int = 0
    lost: list[str] = field(default_factory=list)       # bytes read as zeros
    reverted: list[str] = field(default_factory=list)   # back to an older upload
    stray_objects: int = 0
    skipped_checkpoints: list[int] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [f"recovered from metadata checkpoint {self.checkpoint}: "
               f"{self.files} files and directories"]
        if self.skipped_checkpoints:
            out.append(f"skipped damaged checkpoints {self.skipped_checkpoints}")
        for p in self.lost:
            out.append(f"lost: {p} (data written after its last upload is gone; holes read as zeros)")
        for p in self.reverted:
            out.append(f"reverted: {p} (changes after its last upload are gone)")
        if self.stray_objects:
            out.append(f"{self.stray_objects} objects uploaded after the checkpoint will be deleted")
        if not (self.lost or self.reverted):
            out.append("no data was lost")
        return out


def fetch_newest_checkpoint(cold, path: str) -> tuple[int, list[int]]:
    """Write the newest valid checkpoint's LMDB file to `path` (streamed: never
    whole in memory); its sequence number and the damaged ones skipped."""
    skipped = []
    for _listing in range(LISTINGS):
        seqs = list_checkpoints(cold)
        if not seqs:
            raise UserError(f"{cold.describe()} holds no metadata checkpoint: there is "
                            f"nothing to recover from (was the filesystem ever synced or "
                            f"unmounted?)")
        for seq in reversed(seqs):
            if seq in skipped:
                continue
            try:
                get_checkpoint(cold, seq, path)
                return seq, skipped
            except ObjectNotFound:
                # Pruned since the listing by a live holder (read by `tierfs dump`),
                # which prunes only once a newer one landed: list again.
                log.info("checkpoint %d was pruned meanwhile; listing again", seq)
                break
            except UserError as e:
                log.error("checkpoint %d is damaged (%s); trying an older one", seq, e)
                skipped.append(seq)
        else:
            raise UserError(f"every metadata checkpoint in {cold.describe()} is damaged")
    raise UserError(f"the metadata checkpoints in {cold.describe()} were pruned as fast as "
                    f"they were read: is a node writing them every moment? Try again")


def recover(cold, meta_dir: str) -> tuple[MetaStore, RecoveryReport]:
    """Install the newest checkpoint as the LMDB environment in `meta_dir` (which
    must hold none) and make it consistent for this node (no hot data). It is built
    in a directory of its own and renamed into place once whole: a recovery killed
    halfway leaves no metadata that a next mount would take as recovered."""
    building = meta_dir + ".recovering"
    shutil.rmtree(building, ignore_errors=True)  # what a killed recovery left
    os.makedirs(building)
    try:
        seq, skipped = fetch_newest_checkpoint(cold, os.path.join(building, "data.mdb"))
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    meta = MetaStore(building)
    try:
        report = _make_consistent(cold, meta, seq, skipped)
    finally:
        meta.close()
    shutil.rmtree(meta_dir, ignore_errors=True)  # no data.mdb in it (the caller checked)
    os.rename(building, meta_dir)
    fsync_dir(os.path.dirname(meta_dir) or ".")
    return MetaStore(meta_dir), report


def _make_consistent(cold, meta: MetaStore, seq: int, skipped: list) -> RecoveryReport:
    """Clear what only the dead node had (hot, dirty), purge its orphans, send the
    objects it uploaded after the checkpoint to gc, and move the counters past
    anything it may have used."""
    report = RecoveryReport(checkpoint=seq, skipped_checkpoints=skipped)
    lost, reverted, gc_ids = set(), set(), []
    # In batches: a dead node's hot extents may be millions.
    for batch in scan.extent_batches(meta):
        fixes = {}
        for ino, idx, ext in batch:
            if ext.dirty and ext.obj_id:
                reverted.add(ino)
                fixes[(ino, idx)] = replace(ext, flags=ext.flags & ~(HOT | DIRTY))
            elif ext.dirty:
                lost.add(ino)
                fixes[(ino, idx)] = None
            elif ext.hot:
                fixes[(ino, idx)] = replace(ext, flags=ext.flags & ~HOT)
        meta.update(None, fixes)
    for ino in meta.orphans():  # were open on the dead node; nobody holds them now
        meta.purge_orphan(ino)
    # Objects the dead node uploaded after this checkpoint: nothing references them.
    next_id = meta.peek_counter(b"obj")
    highest = next_id - 1
    for key in cold.list("data/"):
        try:
            obj_id = int(key[len("data/"):], 16)
        except ValueError:
            continue
        if obj_id >= next_id and key == object_name(obj_id):
            gc_ids.append(obj_id)
            highest = max(highest, obj_id)
    meta.update(None, {}, gc_ids)
    # New objects must never reuse those ids (gc would delete the new data), nor
    # ones the old node may still allocate if it is alive after all: start far above.
    meta.raise_counter(b"obj", highest + 1 + OBJECT_ID_GAP)
    # Checkpoints of this node must sort after any the old node wrote (also one it
    # put while being taken over), or recovery and pruning would pick its stale ones.
    meta.raise_epoch(max(list_checkpoints(cold), default=seq) + CHECKPOINT_GAP)
    meta.sync()
    names = scan.paths_of(meta, lost | reverted)  # not every file's: millions
    report.files = sum(1 for _ in scan.inodes(meta))
    report.lost = sorted(names.get(i, f"<inode {i}>") for i in lost)
    report.reverted = sorted(names.get(i, f"<inode {i}>") for i in reverted - lost)
    report.stray_objects = len(gc_ids)
    return report
