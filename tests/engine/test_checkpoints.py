"""Checkpoints and gc over the in-memory bucket: what gc may delete while a
checkpoint's fate is unknown."""
from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import tracemalloc

import pytest
import trio

import tierfs
from tierfs.checksum import object_matches
from tierfs.cold.file import FileStore
from tierfs.errors import ColdStoreError
from tierfs.meta import scan
from tierfs.meta.schema import ROOT_INO, object_name
from tierfs.tier.checkpoint import PREFIX, checkpoint_name
from tierfs.tier.recover import recover

from .harness import KiB, engine_stack, run, settle, until

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


def _one_checkpoint_kept(tmp_path):
    """An engine that uploads at once, checkpoints only when told, keeps one
    checkpoint and gives up on the bucket after 0.2 s."""
    return engine_stack(tmp_path, extent_size=E, cache_size=8 * E, upload_delay=0,
                        checkpoint_every=0, checkpoint_keep=1, retry_timeout=0.2)


def test_gc_keeps_what_a_checkpoint_whose_put_failed_may_name(tmp_path):
    """A checkpoint's PUT can land in the bucket and still fail (the answer lost, the
    retries run out). The first of a new filesystem is then the only one there:
    until a later one replaces it, gc must keep the objects it names, or a
    recovery from it finds them gone."""
    async def body():
        async with _one_checkpoint_kept(tmp_path) as s:
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
        async with _one_checkpoint_kept(tmp_path) as s:
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


def test_gc_keeps_what_a_checkpoint_names_until_its_pruning_is_done(tmp_path):
    """Pruning an old checkpoint can fail (a bucket whose policy refuses deletes of
    meta/): it then stays in the bucket and is kept, and recovery falls back on it if
    the newer one is damaged. gc must not delete what it names while its delete is
    still in flight, or that fallback finds its objects gone."""
    async def body():
        async with _one_checkpoint_kept(tmp_path) as s:
            ino = s.create()
            await s.engine.write(ino, 0, b"A" * E)
            await settle(s)
            first = await s.checkpointer.checkpoint()
            await s.engine.write(ino, 0, b"B" * E)  # drops the object `first` names
            await settle(s)
            pruning = s.gate.hold("delete", PREFIX)
            s.faulty.refuse_deletes = (PREFIX,)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(s.checkpointer.checkpoint)
                await until(lambda: pruning.entered, what="the pruning delete")
                for _ in range(3):
                    await s.gc.collect()
                pruning.release()
            assert checkpoint_name(first) in s.memory.list(PREFIX)
            assert first in s.checkpointer.kept
            for seq in s.checkpointer.kept:  # the newer one damaged: recovery takes `first`
                if seq != first:
                    s.memory.delete(checkpoint_name(seq))
            assert unreadable_after_recovery(s.memory, str(tmp_path / "recovered")) == []
    run(body)


def test_a_checkpoint_and_a_recovery_hold_no_whole_copy_of_the_metadata_in_memory(tmp_path):
    """A namespace of millions of small files has an LMDB file of hundreds of MiB
    (about 500 bytes a file: scripts/bench_checkpoint_memory.py). A checkpoint and a
    recovery move it between the cache dir and the bucket in pieces: neither may
    hold a copy of it in memory (the daemon's whole budget is about 300 MiB)."""
    FILES = 50_000  # about 19 MB of LMDB, far above the pieces moved (1 MiB)
    bucket = FileStore(str(tmp_path / "bucket"))
    bucket.check()

    async def checkpoint_peak():
        async with engine_stack(tmp_path, extent_size=E, cache_size=8 * E, upload_delay=0,
                                checkpoint_every=0, bucket=bucket) as s:
            for i in range(FILES):
                s.meta.create_node(ROOT_INO, b"file-%06d" % i, stat.S_IFREG | 0o644, 0, 0)
            tracemalloc.start()
            try:
                return await s.checkpointer.checkpoint(), tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
    seq, peak = run(checkpoint_peak)
    size = bucket.size(checkpoint_name(seq))
    assert peak < size / 4, f"a checkpoint of {size} bytes took {peak} bytes of memory"

    tracemalloc.start()
    try:
        meta, report = recover(bucket, str(tmp_path / "recovered"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    try:
        assert report.checkpoint == seq and report.files == FILES + 1
    finally:
        meta.close()
    assert peak < size / 4, f"a recovery from {size} bytes took {peak} bytes of memory"


TREE = os.path.dirname(os.path.dirname(tierfs.__file__))  # for the child process
KILLED_DURING_A_CHECKPOINT = """
import os, signal, sys
from tierfs.meta import MetaStore
from tierfs.tier import checkpoint
meta = MetaStore(sys.argv[1])
copy_to = meta.kv.copy_to
def copied_then_killed(directory):
    copy_to(directory)
    os.kill(os.getpid(), signal.SIGKILL)  # kill -9 before the copy is read and removed
meta.kv.copy_to = copied_then_killed
checkpoint.snapshot(meta, sys.argv[2])
"""


def test_the_copy_of_a_daemon_killed_during_a_checkpoint_is_removed(tmp_path):
    """A checkpoint copies the whole metadata database into the cache dir first: a
    daemon killed before it removed that copy leaves it there, as large as the
    metadata, and one more with every such kill. The next start removes it."""
    work = tmp_path / "cache"
    work.mkdir()
    child = subprocess.run([sys.executable, "-c", KILLED_DURING_A_CHECKPOINT,
                            str(tmp_path / "meta-of-the-killed"), str(work)],
                           env=dict(os.environ, PYTHONPATH=TREE))
    assert child.returncode == -signal.SIGKILL
    left = [p for p in work.iterdir() if (p / "data.mdb").exists()]
    assert left, "the killed daemon left no copy behind"

    async def body():
        async with engine_stack(work, extent_size=E, cache_size=8 * E, upload_delay=0,
                                checkpoint_every=0):
            assert not any(p.exists() for p in left)
    run(body)
