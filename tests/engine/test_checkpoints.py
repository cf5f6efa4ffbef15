"""Checkpoints and gc over the in-memory bucket: what gc may delete while a
checkpoint's fate is unknown."""
from __future__ import annotations

import pytest

from tierfs.checksum import object_matches
from tierfs.errors import ColdStoreError
from tierfs.meta import scan
from tierfs.meta.schema import object_name
from tierfs.tier.checkpoint import PREFIX, checkpoint_name
from tierfs.tier.recover import recover

from .harness import KiB, engine_stack, run, settle

E = 64 * KiB


def unreadable_after_recovery(memory, meta_dir: str) -> list[str]:
    """Recover from the bucket as a new node would; the extents whose bytes it
    cannot read back."""
    meta, _report = recover(memory, meta_dir)
    bad = []
    try:
        for ino, idx, ext in scan.extents(meta):
            try:
                data = memory.get(object_name(ext.obj_id), ext.obj_off, ext.obj_len)
            except ColdStoreError as e:
                bad.append(f"inode {ino} extent {idx}: {e}")
                continue
            if not object_matches(data, ext.obj_len, ext.checksum):
                bad.append(f"inode {ino} extent {idx}: checksum mismatch")
    finally:
        meta.close()
    return bad


def test_gc_keeps_what_a_checkpoint_whose_put_failed_may_name(tmp_path):
    """A checkpoint's PUT can land in the bucket and still fail (the answer lost, the
    retries run out). The first of a new filesystem is then the only one there:
    until a later one replaces it, gc must keep the objects it names, or a
    recovery from it finds them gone."""
    async def body():
        async with engine_stack(tmp_path, extent_size=E, cache_size=8 * E, upload_delay=0,
                                checkpoint_every=0, checkpoint_keep=1,
                                retry_timeout=0.2) as s:
            ino = s.create()
            await s.engine.write(ino, 0, b"A" * E)
            await settle(s)
            put = s.memory.put

            def landed_then_failed(key, data):
                put(key, data)
                if key.startswith(PREFIX):
                    raise ColdStoreError("connection reset after the upload", transient=True)
            s.memory.put = landed_then_failed
            with pytest.raises(ColdStoreError):
                await s.checkpointer.checkpoint()
            s.memory.put = put
            await s.engine.write(ino, 0, b"B" * E)  # drops the object that checkpoint names
            await settle(s)
            for _ in range(3):
                await s.gc.collect()
            assert unreadable_after_recovery(s.memory, str(tmp_path / "recovered")) == []
            newer = await s.checkpointer.checkpoint()  # lands, and prunes the unsure one
            assert s.memory.list(PREFIX) == [checkpoint_name(newer)]
    run(body)


def test_a_checkpoint_that_landed_is_not_failed_by_its_pruning(tmp_path):
    """Pruning the oldest checkpoint fails (a bucket that refuses deletes, an outage
    right after the PUT): the new checkpoint is in the bucket all the same, so
    checkpoint() succeeds (`sync --wait` and unmount rely on it); the old one is
    still kept, and pruned once deletes work again."""
    async def body():
        async with engine_stack(tmp_path, extent_size=E, cache_size=8 * E, upload_delay=0,
                                checkpoint_every=0, checkpoint_keep=1,
                                retry_timeout=0.2) as s:
            first = await s.checkpointer.checkpoint()
            delete = s.memory.delete

            def refused(key):
                if key.startswith(PREFIX):
                    raise ColdStoreError("AccessDenied: deletes are not allowed")
                delete(key)
            s.memory.delete = refused
            second = await s.checkpointer.checkpoint()
            assert s.memory.list(PREFIX) == [checkpoint_name(first), checkpoint_name(second)]
            s.memory.delete = delete
            third = await s.checkpointer.checkpoint()
            assert s.memory.list(PREFIX) == [checkpoint_name(third)]
    run(body)
