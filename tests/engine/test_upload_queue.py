"""The uploader's queue of dirty extents (tier/cache.py, tier/uploader.py), over the
memory bucket: a backlog of any size is handed out a few uploads at a time, a round
looks only at what is due, and `sync` of some files puts them first."""
from __future__ import annotations

import time

from tierfs.tier.uploader import SINGLES_AHEAD

from .harness import run, settle, until
from .test_engine_model import A, B, E, _stack

EXTENTS = 200


def _uploaded(s, ino, n):
    return all(s.record(ino, i).obj_id for i in range(n))


def test_a_backlog_is_handed_out_a_few_uploads_at_a_time(tmp_path):
    """200 extents due at once, the bucket holding every PUT: only a few of them
    wait for an upload slot (not a task each); the others wait in the queue, and
    all of them are uploaded once the bucket answers."""
    async def scenario():
        async with _stack(tmp_path, cache_size=4 * EXTENTS * E, upload_parallel=2) as s:
            ino = s.create()
            put = s.gate.hold("put")
            await s.engine.write(ino, 0, A * EXTENTS)
            await until(lambda: put.entered == 2, what="two PUTs held in the bucket")
            handed_out = len(s.uploader.in_flight)
            assert 2 <= handed_out <= SINGLES_AHEAD * 2, handed_out
            assert len(s.engine.index.queued) == EXTENTS - handed_out
            assert set(s.engine.index.queued).isdisjoint(s.uploader.in_flight)
            put.release()
            await settle(s, timeout=15)
            assert _uploaded(s, ino, EXTENTS) and not s.engine.index.queued

    run(scenario, timeout=30)


def test_a_round_looks_only_at_the_extents_that_are_due(tmp_path):
    """With a long upload delay nothing is due: a round of the uploader reads the
    queue's first extent and stops, however long the backlog."""
    async def scenario():
        async with _stack(tmp_path, cache_size=4 * EXTENTS * E, upload_delay=3600) as s:
            ino = s.create()
            await s.engine.write(ino, 0, A * EXTENTS)
            index = s.engine.index
            looked = []

            class CountingDirty(dict):
                def __getitem__(self, key):
                    looked.append(key)
                    return super().__getitem__(key)

            index.dirty = CountingDirty(index.dirty)
            single, packs, left = s.uploader._select(time.monotonic())
            assert (single, packs, left) == ([], [], False)
            assert looked == [(ino, 0)], looked

    run(scenario)


def test_sync_of_a_file_puts_it_before_an_older_backlog(tmp_path):
    """An older file's extents are queued first; `flush` of a newer file uploads
    that one at once, ahead of them, and the older one keeps its delay. Once all
    of the synced file is up, its later writes wait for the delay again."""
    async def scenario():
        async with _stack(tmp_path, cache_size=4 * EXTENTS * E, upload_delay=3600) as s:
            old, new = s.create(), s.create()
            await s.engine.write(old, 0, A * 20)
            await s.engine.write(new, 0, B * 3)
            index = s.engine.index
            await s.uploader.flush({new})
            assert _uploaded(s, new, 3)
            assert not any(s.record(old, i).obj_id for i in range(20))
            assert new not in index.rush and old not in index.rush
            await s.engine.write(new, 0, A)
            assert list(index.queued)[-1] == (new, 0)  # behind the older backlog
            assert s.engine.stats.counters["uploads"] == 3

    run(scenario)


def test_extents_rewritten_during_their_upload_are_queued_again(tmp_path):
    """An extent written while its upload is in flight stays dirty and goes back
    into the queue when that upload ends; the next upload takes the new data."""
    async def scenario():
        async with _stack(tmp_path) as s:
            ino = s.create()
            put = s.gate.hold("put")
            await s.engine.write(ino, 0, A)
            await until(lambda: put.entered, what="the upload's PUT")
            assert (ino, 0) not in s.engine.index.queued
            await s.engine.write(ino, 0, B)
            assert (ino, 0) not in s.engine.index.queued  # its upload has not ended
            put.release()
            await settle(s)
            assert s.engine.stats.counters["uploads_superseded"] == 1
            s.evict_all()
            assert bytes(await s.engine.read(ino, 0, E)) == B

    run(scenario)
