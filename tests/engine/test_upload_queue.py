"""The uploader's queue of dirty extents (tier/cache.py, tier/uploader.py), over the
memory bucket: a backlog of any size is handed out a few uploads at a time, a round
looks only at what is due, and `sync` of some files puts them first."""
from __future__ import annotations

import time

import trio

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


SMALL = 4 * 1024  # a small file's bytes; packed below E


def _pack_sizes(s) -> list[int]:
    """Files per pack in the bucket's metadata."""
    return sorted(len(s.meta.pack_refs(obj_id))
                  for obj_id in {s.record(ino, 0).obj_id for ino in s.small_files})


async def _write_small_files(s, count: int, every: float) -> None:
    s.small_files = getattr(s, "small_files", [])
    for _ in range(count):
        ino = s.create()
        await s.engine.write(ino, 0, b"s" * SMALL)
        s.small_files.append(ino)
        await trio.sleep(every)


def test_small_files_written_one_after_another_go_up_in_full_packs(tmp_path):
    """A data set copied in file by file: each round of the uploader finds only the
    files that came due since the last one (a tenth of a second's writes here), but
    a pack waits for more while the writer goes on, so the packs hold at least half
    of --pack-size each, not a round's worth (one GET each for a cold read)."""
    per_pack = 64

    async def scenario():
        async with _stack(tmp_path, cache_size=64 * E, upload_delay=0.2, pack_below=E,
                          pack_size=per_pack * SMALL) as s:
            await _write_small_files(s, 4 * per_pack, every=0.01)
            await settle(s, timeout=20)
            sizes = _pack_sizes(s)
            assert sum(sizes) == 4 * per_pack
            assert all(n >= per_pack // 2 for n in sizes[1:]), sizes  # the last may be short
            assert len(sizes) <= 8, sizes

    run(scenario, timeout=60)


def test_a_pack_that_does_not_fill_still_goes_up_while_the_writer_writes_on(tmp_path):
    """A slow writer never fills half a pack: its files wait one upload delay more than
    their due time at most, and go up while it is still writing; `sync` of a file
    uploads it at once."""
    delay = 0.1

    async def scenario():
        async with _stack(tmp_path, cache_size=256 * E, upload_delay=delay, pack_below=E,
                          pack_size=10_000 * SMALL) as s:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_write_small_files, s, 100, 0.03)
                await until(lambda: getattr(s, "small_files", None), what="a first file")
                first = s.small_files[0]
                await until(lambda: s.record(first, 0).obj_id, timeout=10,
                            what="the first file in the bucket")
                written = len(s.small_files)
                assert written < 100, "uploaded only once the writer stopped"
                latest = s.small_files[-1]
                await s.uploader.flush({latest})
                assert s.record(latest, 0).obj_id
            await settle(s, timeout=20)
            assert all(s.record(ino, 0).obj_id for ino in s.small_files)

    run(scenario, timeout=60)
