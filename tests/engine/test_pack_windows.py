"""Fetches of packed files in a random order, over the in-memory bucket: a miss
reads along the cold files of its aligned window of the pack, a fetch of many files
the wanted ones of its aligned window, so the windows never overlap or leave slivers
that would each need a GET of their own."""
from __future__ import annotations

import random

from tierfs.tier import actions
from tierfs.tier.engine import READ_AROUND, WANTED_SPAN, aligned_window

from .harness import KiB, engine_stack, run, settle, until

MiB = 1 << 20
E = 64 * KiB
SMALL = 32 * KiB
FILES = 1024  # 32 MiB in one pack: 8 read-around windows, 4 wanted ones


def _stack(tmp_path):
    return engine_stack(tmp_path, extent_size=E, cache_size=2 * FILES * SMALL,
                        upload_delay=0, checkpoint_every=0, pack_below=E,
                        pack_size=64 * MiB)


async def _one_pack(s) -> list[int]:
    inos = [s.create() for _ in range(FILES)]
    for i, ino in enumerate(inos):
        await s.engine.write(ino, 0, bytes([i % 251]) * SMALL)
    await s.uploader.flush(None)
    await settle(s, timeout=30)
    assert len({s.record(ino, 0).obj_id for ino in inos}) == 1
    s.evict_all()
    assert not any(s.record(ino, 0).hot for ino in inos)
    return inos


def test_aligned_window_holds_its_offset():
    for size in (READ_AROUND, WANTED_SPAN, 3 * MiB):
        for offset in (0, 1, size - 1, size, 5 * size + 17):
            lo, hi = aligned_window(offset, size)
            assert lo % size == 0 and hi == lo + size and lo <= offset < hi


def test_misses_in_a_random_order_cost_one_get_per_window(tmp_path):
    """Reads one at a time in a random order: each miss brings its whole window of
    READ_AROUND bytes, so the pack costs one GET per window; windows centred on the
    file left slivers between them that each took a GET (13-15 here)."""
    async def scenario():
        async with _stack(tmp_path) as s:
            inos = await _one_pack(s)
            order = list(range(FILES))
            random.Random(5).shuffle(order)
            before = s.engine.stats.counters.get("cold_reads", 0)
            for i in order:
                assert bytes(await s.engine.read(inos[i], 0, SMALL)) == bytes([i % 251]) * SMALL
            gets = s.engine.stats.counters["cold_reads"] - before
            assert gets == FILES * SMALL // READ_AROUND, gets

    run(scenario, timeout=60)


def test_a_fetch_of_many_files_costs_one_get_per_wanted_window(tmp_path):
    """prefetch of all files, named in a random order, 8 at a time: the first fetch
    of a window brings all of its wanted files (the others find theirs on the way),
    so the pack costs one GET per window of WANTED_SPAN bytes; runs centred on the
    file took 5-6 here."""
    async def scenario():
        async with _stack(tmp_path) as s:
            inos = await _one_pack(s)
            random.Random(6).shuffle(inos)
            before = s.engine.stats.counters.get("cold_reads", 0)
            out = await actions.prefetch_many(s.engine, inos, parallel=8)
            assert all(isinstance(r, dict) and r["not_hot"] == 0 for r in out.values())
            await until(lambda: not s.fetches_in_flight(), what="installs")
            gets = s.engine.stats.counters["cold_reads"] - before
            windows = FILES * SMALL // WANTED_SPAN
            assert gets == windows, gets

    run(scenario, timeout=60)
