"""A power cut: metadata commits since the last sync are lost (LMDB is written without
fsync between syncs), while the hot tier's own changes (a copy evicted, renamed, reused)
may all have reached the disk. Whatever `fsync` made durable must still read back."""
from __future__ import annotations

import os
import shutil
import threading

import trio

from tierfs.cold.memory import MemoryStore
from tierfs.hot import HotStore
from tierfs.meta import MetaStore
from tierfs.tier.engine import Engine
from tierfs.tier.space import Space

from tierfs.tier import actions

from .harness import Hold, KiB, engine_stack, run, settle, until

E = 64 * KiB


class SyncedCopies:
    """Keeps a copy of the metadata as each sync finds it: what a power cut would
    leave on the disk is the copy of the last sync that started."""

    def __init__(self, meta: MetaStore, where: str):
        self.where = where
        self.frozen = False  # the power is cut: later syncs never happened
        self._lock = threading.Lock()
        inner = meta.kv.sync

        def sync() -> None:
            with self._lock:
                if self.frozen:
                    return inner()
                fresh = where + ".new"
                shutil.rmtree(fresh, ignore_errors=True)
                os.mkdir(fresh)
                meta.kv.env.copy(fresh)  # the last committed state, as of this moment
                shutil.rmtree(where, ignore_errors=True)
                os.rename(fresh, where)
            inner()
        meta.kv.sync = sync

    def freeze(self) -> None:
        """The power is cut now: what syncs do from here on is never on the disk."""
        with self._lock:
            self.frozen = True

    def power_cut(self, meta_dir: str) -> None:
        """Put the metadata back to the last synced copy (the store is closed)."""
        shutil.copyfile(os.path.join(self.where, "data.mdb"),
                        os.path.join(meta_dir, "data.mdb"))
        try:
            os.unlink(os.path.join(meta_dir, "lock.mdb"))
        except FileNotFoundError:
            pass


async def read_after_restart(tmp_path, memory: MemoryStore, ino: int, size: int):
    """Start again on the cache dir and bucket as the next mount does: (problems
    the start found, the file's bytes or the error reading them)."""
    meta = MetaStore(os.path.join(str(tmp_path), "meta"), map_size=1 << 30)
    hot = HotStore(os.path.join(str(tmp_path), "hot"))
    try:
        engine = Engine(meta, hot, memory, E)
        problems = engine.load_index()
        engine.space = Space(engine, cache_size=16 * E, min_free=0)
        async with trio.open_nursery() as nursery:
            engine.nursery = nursery
            try:
                got = bytes(await engine.read(ino, 0, size))
            except Exception as e:  # noqa: BLE001 - the test reports what it was
                got = e
            nursery.cancel_scope.cancel()
        return problems, got
    finally:
        hot.close()
        meta.close()


async def reads_back_after_power_cut(tmp_path, copies: SyncedCopies, memory: MemoryStore,
                                     ino: int, data: bytes) -> None:
    """Cut the power (the stack is stopped), start again: the file reads `data`."""
    copies.power_cut(str(tmp_path / "meta"))
    problems, got = await read_after_restart(tmp_path, memory, ino, len(data))
    assert problems == []
    assert got == data, got


def test_data_fsynced_then_uploaded_and_evicted_survives_a_power_cut(tmp_path):
    """fsync makes a write durable with its extents dirty. Its upload then marks them
    clean and eviction drops their hot copies: if a power cut took those commits back
    while the copies were gone from the disk, the file's only bytes would be an object
    that no record names."""
    data = os.urandom(3 * E + 100)

    async def body():
        async with engine_stack(tmp_path, extent_size=E, cache_size=16 * E, upload_delay=0,
                                checkpoint_every=0) as s:
            copies = SyncedCopies(s.meta, str(tmp_path / "synced"))
            ino = s.create()
            puts = s.gate.hold("put")       # uploads wait until the data is durable
            await s.engine.write(ino, 0, data)
            await s.engine.fsync(ino)       # durable from here on, its extents dirty
            assert s.record(ino, 0).dirty
            puts.release()
            await settle(s)                 # uploaded
            assert s.evict_all() > 0        # hot copies dropped
        await reads_back_after_power_cut(tmp_path, copies, s.memory, ino, data)

    run(body)


def test_release_keeps_copies_whose_clean_records_are_not_durable_yet(tmp_path):
    """`tierfs release` right after an upload committed an extent clean, while the
    sync that makes that commit durable is still running: the hot copy stays (as
    dirty), or a power cut then leaves the file with neither copy nor record."""
    data = os.urandom(2 * E)

    async def body():
        async with engine_stack(tmp_path, extent_size=E, cache_size=16 * E, upload_delay=0,
                                checkpoint_every=0) as s:
            copies = SyncedCopies(s.meta, str(tmp_path / "synced"))
            ino = s.create()
            puts = s.gate.hold("put")
            await s.engine.write(ino, 0, data)
            await s.engine.fsync(ino)
            syncs = Hold("sync", "")
            inner = s.meta.kv.sync

            def held_sync() -> None:
                syncs.wait()
                inner()
            s.meta.kv.sync = held_sync
            with s.gate._lock:
                s.gate._holds.append(syncs)  # released at exit, whatever happens
            puts.release()
            await until(lambda: not s.record(ino, 0).dirty and not s.record(ino, 1).dirty,
                        what="the upload to commit the extents clean")
            out = actions.release(s.engine, ino)
            assert out["released"] == 0 and out["dirty_kept"] == 2, out
            copies.freeze()  # the power goes while that sync runs
        await reads_back_after_power_cut(tmp_path, copies, s.memory, ino, data)

    run(body)
