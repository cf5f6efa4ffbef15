"""The engine when the bucket fails under it: over the in-memory bucket, with calls
held in place by the store gate (a bucket that accepts and never answers)."""
from __future__ import annotations

import errno

import trio

from tierfs.errors import FsError
from tierfs.meta.schema import object_name

from .harness import KiB, engine_stack, run, until

E = 64 * KiB


def test_concurrent_cold_reads_of_a_silent_bucket_share_one_timeout(tmp_path):
    """Several reads of one cold extent (the kernel splits a read into many requests)
    while the bucket never answers: they join one GET, and when --cold-timeout ends it,
    every one of them gets EIO. None starts a GET of its own after it, which made the
    last of n readers wait n timeouts."""
    readers = 4

    async def scenario():
        async with engine_stack(tmp_path, extent_size=E, cache_size=8 * E, upload_delay=0,
                                checkpoint_every=0,
                                allowed_errors=("did not answer",)) as s:
            s.engine.cold_timeout = 0.5
            ino = s.create()
            await s.engine.write(ino, 0, b"x" * E)
            await s.uploader.flush({ino})
            s.evict_all()
            get = s.gate.hold("get", object_name(s.record(ino, 0).obj_id))
            errors = []

            async def read(off):
                try:
                    await s.engine.read(ino, off, 4 * KiB)
                except FsError as e:
                    errors.append(e.errno)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(read, 0)
                await until(lambda: get.entered, what="the first reader's GET")
                for i in range(1, readers):
                    nursery.start_soon(read, i * 4 * KiB)
            assert errors == [errno.EIO] * readers, errors
            assert get.entered == 1, (f"{get.entered} GETs, one after another, for "
                                      f"{readers} concurrent readers of one extent")

    run(scenario)
