"""The engine when the bucket fails under it: over the in-memory bucket, with calls
held in place by the store gate (a bucket that accepts and never answers)."""
from __future__ import annotations

import errno
import logging
import os
import time

import pytest
import trio

from tierfs.errors import FsError
from tierfs.meta.schema import object_name
from tierfs.tier import actions

from .harness import KiB, engine_stack, run, settle, until

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


@pytest.mark.parametrize("packed", [False, True], ids=["alone", "packed"])
def test_a_dirty_extent_whose_hot_file_is_gone_is_not_handed_out_for_ever(tmp_path, packed):
    """Someone deleted the hot file of an extent not uploaded yet (a cleaner in the
    cache dir): its data is lost. The uploader says so once and stops handing it out;
    before, it found the file gone, counted nothing and took the extent again at once,
    a busy loop on the trio thread (thousands of rounds a second) for ever. The extent
    stays dirty: `sync --wait` and `umount` say it is not in the bucket."""
    async def scenario():
        async with engine_stack(tmp_path, extent_size=E, cache_size=8 * E,
                                upload_delay=3600, checkpoint_every=0,
                                pack_below=E if packed else 0,
                                allowed_errors=("hot file missing",)) as s:
            ino, other = s.create(), s.create()
            await s.engine.write(ino, 0, b"x" * 100)
            await s.engine.write(other, 0, b"y" * 100)  # packed along with it
            s.hot._forget_fd(ino, 0)
            os.unlink(s.hot.path(ino, 0))
            s.uploader.hurry(ino)
            s.uploader.hurry(other)
            await until(lambda: s.engine.stats.counters.get("hot_file_lost"),
                        what="the uploader to report the lost hot file")
            await until(lambda: not s.uploader.in_flight, what="the uploads to end")
            assert (ino, 0) in s.engine.index.dirty and s.record(ino, 0).dirty
            assert not s.engine.index.has_dirty(other)  # the rest uploads as usual
            single, packs, _left = s.uploader._select(time.monotonic())
            assert not single and not packs, "the lost extent is handed out again"

    run(scenario)


def test_scrub_during_an_outage_calls_no_object_damaged(tmp_path):
    """`tierfs scrub` while the bucket fails every request: the objects could not be
    checked, which is not damage. Before, each was counted a damaged object (the CLI
    then says the ones without a good hot copy "are lost") and its good hot copy was
    made dirty to be uploaded again."""
    async def scenario():
        async with engine_stack(tmp_path, extent_size=E, cache_size=8 * E, upload_delay=0,
                                checkpoint_every=0, retry_timeout=0.2,
                                allowed_errors=("cold read of",)) as s:
            ino = s.create()
            await s.engine.write(ino, 0, b"x" * E)
            await s.uploader.flush({ino})
            s.faulty.outage = True
            try:
                out = await actions.scrub(s.engine, ino)
            except FsError as e:  # the scrub of this file failed: fine, it says why
                assert e.errno == errno.EIO and "outage" in str(e), e
            else:
                assert out["cold_bad"] == 0, out
            assert not s.record(ino, 0).dirty, "a good object is to be uploaded again"
            s.faulty.outage = False

    run(scenario)


def test_scrub_of_a_damaged_hot_copy_whose_object_is_damaged_too_replaces_nothing(tmp_path):
    """Scrub finds the hot copy damaged, then the object too: nothing good was left to
    replace the copy with. Before, it was counted "replaced from the bucket" anyway,
    so the report said a file was repaired that has no good copy anywhere."""
    async def scenario():
        async with engine_stack(tmp_path, extent_size=E, cache_size=8 * E, upload_delay=0,
                                checkpoint_every=0,
                                allowed_errors=("hot copy is damaged", "checksum mismatch")) as s:
            ino = s.create()
            await s.engine.write(ino, 0, b"x" * E)
            await s.uploader.flush({ino})
            assert s.record(ino, 0).hot and not s.record(ino, 0).dirty
            with open(s.engine.hot.path(ino, 0), "r+b") as f:
                f.write(b"rot")
            s.faulty.corrupt_keys.add(object_name(s.record(ino, 0).obj_id))
            out = await actions.scrub(s.engine, ino)
            assert out["cold_bad"] == 1, out
            assert out["hot_repaired"] == 0 and out["hot_lost"] == 1, out

    run(scenario)


def test_gc_failing_pass_after_pass_warns_once_until_it_works_again(tmp_path):
    """A bucket that refuses deletes fails every gc pass (every 50 ms here): one
    warning for all of them, not one per pass, and the objects go once it allows
    deletes again."""
    async def body():
        async with engine_stack(tmp_path, extent_size=E, cache_size=16 * E, upload_delay=0,
                                checkpoint_every=0) as s:
            s.faulty.refuse_deletes = ("data/",)
            ino = s.create()
            await s.engine.write(ino, 0, b"A" * E)
            await settle(s)
            await s.engine.write(ino, 0, b"B" * E)  # drops the first object
            await settle(s)
            await until(lambda: s.faulty.calls.get("delete", 0) >= 5,
                        what="gc to fail five passes")
            warned = [r for r in s.logs.records if "gc: deleting objects failed" in r.getMessage()]
            assert len(warned) == 1, [r.getMessage() for r in warned]
            s.faulty.refuse_deletes = ()
            await until(lambda: s.memory.list("data/") == [object_name(s.record(ino, 0).obj_id)],
                        what="gc to delete the dropped object")

    run(body)


async def _dropped_objects(s, n: int) -> list[int]:
    """n files of one extent each, uploaded, then cut to nothing: their objects (in
    id order, the gc queue's order) wait in the gc table."""
    inos = [s.create() for _ in range(n)]
    for ino in inos:
        await s.engine.write(ino, 0, b"x" * E)
    await settle(s)
    ids = sorted(s.record(ino, 0).obj_id for ino in inos)
    for ino in inos:
        await s.engine.truncate(ino, 0)
    return ids


def test_an_object_the_bucket_will_not_delete_does_not_stop_gc_of_the_others(tmp_path):
    """A bucket that refuses to delete one object (a retention or legal hold on it):
    that object stays, every other dropped object still goes. Before, the first
    refusal failed the whole batch, pass after pass, and the bucket only grew."""
    async def body():
        async with engine_stack(tmp_path, extent_size=E, cache_size=16 * E, upload_delay=0,
                                checkpoint_every=0) as s:
            s.gc.interval = 3600  # passes run when the test says
            ids = await _dropped_objects(s, 3)
            s.faulty.refuse_deletes = (object_name(ids[0]),)
            await s.gc.collect()
            assert s.memory.list("data/") == [object_name(ids[0])]
            assert [i for i, _epoch in s.meta.gc_pending()] == [ids[0]]

    run(body)


class InfoLines(logging.Handler):
    """The gc logger's lines, INFO and up, while the test runs."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.logger = logging.getLogger("tierfs.tier.gc")

    def emit(self, record):
        self.lines.append(record.getMessage())

    def __enter__(self):
        self.level = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level)


def test_an_object_the_bucket_will_not_delete_does_not_hide_an_outage(tmp_path):
    """While the bucket refuses to delete one object (a hold on it), gc still says
    when an outage begins and when it works again: the refusal is its own story."""
    async def body():
        async with engine_stack(tmp_path, extent_size=E, cache_size=16 * E, upload_delay=0,
                                checkpoint_every=0) as s:
            s.gc.interval = 3600  # passes run when the test says
            (held,) = await _dropped_objects(s, 1)
            s.faulty.refuse_deletes = (object_name(held),)
            with InfoLines() as log_lines:
                await s.gc.collect()
                assert len(log_lines.lines) == 1 and object_name(held) in log_lines.lines[0]
                await _dropped_objects(s, 2)
                s.faulty.outage = True
                await s.gc.collect()
                assert len(log_lines.lines) == 2 and "outage" in log_lines.lines[1], \
                    log_lines.lines
                s.faulty.outage = False
                await s.gc.collect()
                assert s.memory.list("data/") == [object_name(held)]
                assert len(log_lines.lines) == 3 and "works again" in log_lines.lines[2], \
                    log_lines.lines

    run(body)


def test_objects_gc_cannot_delete_yet_do_not_hide_the_ones_behind_them(tmp_path):
    """gc reads a window of the queue per pass (16 batches). Objects at its head
    that cannot go (refused by the bucket here; also those a kept checkpoint or
    the grace still holds) filled it for ever, and nothing behind them was ever
    looked at. Passes now walk on through the queue."""
    async def body():
        async with engine_stack(tmp_path, extent_size=E, cache_size=64 * E, upload_delay=0,
                                checkpoint_every=0) as s:
            s.gc.interval = 3600
            s.gc.batch = 1  # a window of 16 objects: a small queue shows it
            ids = await _dropped_objects(s, 40)
            held, free = ids[:32], ids[32:]
            s.faulty.refuse_deletes = tuple(object_name(i) for i in held)
            for _ in range(2 * len(ids)):  # a pass tries one object: twice round the queue
                await s.gc.collect()
            assert s.memory.list("data/") == [object_name(i) for i in held]
            assert [i for i, _epoch in s.meta.gc_pending()] == held

    run(body, timeout=60)


def test_an_upload_that_lands_after_it_failed_is_deleted_at_the_next_mount(tmp_path):
    """A PUT the client gave up on (a read timeout) that the server finishes later
    leaves an object nothing names. Its intent was closed when the upload failed
    and gc deleted the object before it landed, so nothing ever deleted it (only
    an offline fsck found it). The intent now stays until the next mount, which
    deletes the object again."""
    async def body():
        async with engine_stack(tmp_path, extent_size=E, cache_size=16 * E, upload_delay=0,
                                checkpoint_every=0, retry_timeout=0) as s:
            s.faulty.puts_land_late = ("data/",)
            ino = s.create()
            await s.engine.write(ino, 0, b"x" * E)
            await until(lambda: s.uploader.failures, what="the upload to fail")
            s.faulty.puts_land_late = ()
            await settle(s)  # uploaded again, as another object
            await until(lambda: not s.meta.gc_pending(), what="gc to delete the failed one")
            (late,) = s.faulty.land_late()
            assert late != object_name(s.record(ino, 0).obj_id)
            assert late in s.memory.list("data/")
            s.meta.abandon_intents()  # what the next mount does first (Daemon.prepare)
            await until(lambda: late not in s.memory.list("data/"),
                        what="gc to delete the object that landed late")
            assert s.memory.list("data/") == [object_name(s.record(ino, 0).obj_id)]

    run(body)


def test_a_sync_waiting_on_a_bucket_that_refuses_backs_off_between_tries(tmp_path):
    """A `sync --wait` (or an unmount's last upload) while the bucket refuses every
    PUT for good (expired credentials: not retried): the uploader still waits its
    backoff between tries. Before, the waiting flush cleared the backoff after every
    failed upload, and the uploader tried again at once: thousands of PUTs a second
    and a busy trio thread for as long as the sync waited (for ever without
    --timeout)."""
    async def scenario():
        async with engine_stack(tmp_path, extent_size=E, cache_size=8 * E, upload_delay=0,
                                checkpoint_every=0, allowed_errors=("access denied",)) as s:
            s.faulty.denied = True
            ino = s.create()
            await s.engine.write(ino, 0, b"x" * E)
            with trio.move_on_after(1.5):  # the backoff is 1 s after the first failure
                await s.uploader.flush({ino})
            puts = s.faulty.calls.get("put", 0)
            assert 1 <= puts <= 4, f"{puts} PUTs to a refusing bucket in 1.5 s"
            assert s.engine.index.has_dirty(ino)
            s.faulty.denied = False
            await s.uploader.flush({ino})  # and it uploads once the bucket allows it

    run(scenario)
