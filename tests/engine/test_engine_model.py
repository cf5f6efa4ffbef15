"""The data engine without FUSE, over the in-memory bucket: random concurrent
ops checked against a model (model.py), and one small deterministic test per
suspect interleaving, held in place with store gates instead of sleeps."""
from __future__ import annotations

import errno
import os
import threading
from functools import partial

import pytest
import trio
import trio.testing

from tierfs.errors import FsError
from tierfs.meta import scan
from tierfs.meta.schema import ROOT_INO, object_name

from tierfs.tier import engine as engine_module
from tierfs.tier.direct_write import DirectWrites

from . import model
from .harness import KiB, engine_stack, run, settle, until
from .model import Config, Driver, ModelMismatch

E = 64 * KiB
A, B = b"A" * E, b"B" * E
# The engine logs these on purpose when the store fails under raw faults.
RAW_FAULT_LOGS = ("cold read of",)


# ---- random ops against the model ---------------------------------------------------
async def _random(tmp_path, cfg: Config, *, cache_extents: int, upload_delay: float,
                  faults: dict | None, retry_timeout: float = 5.0, pack_below: int = 0,
                  compact_dead: float = 1.0):
    async with engine_stack(tmp_path, extent_size=E, cache_size=cache_extents * E,
                            upload_delay=upload_delay, faults=faults, seed=cfg.seed,
                            retry_timeout=retry_timeout, pack_below=pack_below,
                            pack_size=PACK_SIZE, compact_dead=compact_dead,
                            allowed_errors=RAW_FAULT_LOGS if cfg.eio_ok else ()) as s:
        driver = Driver(s, cfg)
        await driver.run()
        stats = s.engine.stats.counters
        # The run did what it is for: data went cold and came back, under pressure.
        assert stats["uploads"] and stats["evictions"] and stats["cold_reads"], dict(stats)
        assert driver.counts["lane_write"] and driver.counts["truncate"], driver.counts
        if pack_below:  # and packs were made, and went to gc as their files changed
            live = len(list(scan.packs(s.meta)))
            died = stats["pack_uploads"] - stats.get("packs_superseded", 0) - live
            assert stats["packed_extents"] and died > 0, (dict(stats), live)
            assert_pack_references_match(s.meta)
        if compact_dead < 1:
            assert stats["compactions"] and stats["compacted_bytes"], dict(stats)
        return driver


PACK_SIZE = 4 * E  # small packs: many of them, each shared by a few files


def assert_pack_references_match(meta) -> None:
    """The invariant that keeps gc from deleting a pack in use: the references the
    store records are exactly those the extents hold, and every pack has some."""
    packs = {obj_id for obj_id, _pack in scan.packs(meta)}
    held = {(ext.obj_id, ext.obj_off, ext.obj_len, ino, idx)
            for ino, idx, ext in scan.extents(meta) if ext.obj_id in packs}
    recorded = {(obj_id, r.offset, r.length, r.ino, r.index) for obj_id, r in scan.refs(meta)}
    assert held == recorded, (held - recorded, recorded - held)
    assert packs == {ref[0] for ref in recorded}


RANDOM = [  # seed, hot tier in extents, concurrent tasks, upload delay, store latency
    pytest.param(1, 4, 4, 0.0, 0.0, id="seed1-hot4-tasks4"),
    pytest.param(2, 6, 3, 0.0, 0.002, id="seed2-hot6-tasks3-latency"),
    pytest.param(3, 5, 4, 0.02, 0.001, id="seed3-hot5-delay20ms"),
    pytest.param(4, 6, 4, 0.0, 0.003, id="seed4-hot6-latency3ms"),
]


@pytest.mark.parametrize("seed,hot,tasks,delay,latency", RANDOM)
def test_random_ops_match_model(tmp_path, seed, hot, tasks, delay, latency):
    cfg = Config(seed=seed, tasks=tasks)
    run(partial(_random, tmp_path, cfg, cache_extents=hot, upload_delay=delay,
                faults={"latency_s": latency}), timeout=30)


@pytest.mark.parametrize("seed,compact", [(5, 1.0), (6, 1.0), (7, 0.2), (8, 0.4)])
def test_random_ops_match_model_with_packed_small_files(tmp_path, seed, compact):
    """Files up to 12 extents (most of the model's) are uploaded packed, 4 extents a
    pack: rewrites, truncates and unlinks drop references into packs shared with
    other files, and gc deletes a pack with its last one; with compact < 1, packs
    that dead are rewritten while all of that goes on."""
    cfg = Config(seed=seed, tasks=4)
    run(partial(_random, tmp_path, cfg, cache_extents=6, upload_delay=0.01,
                faults={"latency_s": 0.001}, pack_below=12 * E, compact_dead=compact),
        timeout=30)


@pytest.mark.parametrize("seed", [13, 14])
def test_random_ops_with_hot_copies_checked_in_threads(tmp_path, monkeypatch, seed):
    """Copies forgotten as checked often (as by a new mount), and every check made in a
    worker thread, not inline: evictions, fetches and writes then meet checks in
    flight. A check must never call a good copy damaged (an ERROR fails the run)."""
    monkeypatch.setattr(engine_module, "INLINE_VERIFY_MAX", 0)
    monkeypatch.setattr(model, "MIX", {**model.MIX, "forget_checks": 20})
    cfg = Config(seed=seed, tasks=4, ops=600)
    driver = run(partial(_random, tmp_path, cfg, cache_extents=8, upload_delay=0.0,
                         faults={"latency_s": 0.001}), timeout=30)
    stats = driver.s.engine.stats.counters
    assert stats["hot_verified_in_thread"], dict(stats)  # the run did check in threads


def test_random_ops_with_retried_faults_and_outages(tmp_path):
    """Transient errors and short outages behind the daemon's retries: no op may fail."""
    cfg = Config(seed=11, outages=True, ops=300)
    run(partial(_random, tmp_path, cfg, cache_extents=6, upload_delay=0.0,
                faults={"fail_rate": 0.05, "latency_s": 0.001}, pack_below=8 * E), timeout=30)


def test_random_ops_with_raw_faults(tmp_path):
    """No retries: ops may fail with EIO, and then must have changed nothing. (No
    outages here: without retries a blip fails every upload in flight, and the
    uploader backs off for up to 30 s per the failures counted.)"""
    cfg = Config(seed=12, ops=300, eio_ok=True)
    driver = run(partial(_random, tmp_path, cfg, cache_extents=6, upload_delay=0.0,
                         faults={"fail_rate": 0.03, "latency_s": 0.001}, retry_timeout=0),
                 timeout=30)
    assert driver.counts["EIO"], "no op met a store fault: the test checked nothing"


def test_model_reports_a_wrong_read(tmp_path):
    """The driver is not hollow: one flipped byte in one read fails the run, and the
    message names seed, op, file, offset and the history."""
    async def scenario():
        async with engine_stack(tmp_path, extent_size=E, cache_size=6 * E,
                                upload_delay=0) as s:
            real_read, calls = s.engine.read, [0]

            async def bad_read(ino, off, size):
                data = bytearray(await real_read(ino, off, size))
                calls[0] += 1
                if calls[0] == 60 and data:
                    data[len(data) // 2] ^= 1
                return data

            s.engine.read = bad_read
            with pytest.raises(ModelMismatch) as err:
                await Driver(s, Config(seed=5, ops=200)).run()
            return str(err.value)

    msg = run(scenario)
    for part in ("seed 5 op #", " file m", "offset ", "first difference", "recent ops"):
        assert part in msg, msg


# ---- targeted interleavings ----------------------------------------------------------
def _stack(tmp_path, **kw):
    kw.setdefault("cache_size", 8 * E)
    kw.setdefault("upload_delay", 0)
    return engine_stack(tmp_path, extent_size=E, checkpoint_every=0, **kw)


async def _read(s, ino, off, size, why):
    try:
        return bytes(await s.engine.read(ino, off, size))
    except FsError as e:
        raise AssertionError(f"{why}: read {off}+{size} failed with "
                             f"{errno.errorcode.get(e.errno)} ({e})\n"
                             f"{s.describe(ino, off // E)}") from None


async def _cold(s, ino):
    """Every extent of the file uploaded and dropped from the hot tier."""
    await s.uploader.flush({ino})
    s.evict_all()
    assert not [i for i, x in s.meta.all_extents(ino).items() if x.hot]


async def _upload_in_flight(s):
    """A new file whose first extent (A) is uploading, its PUT held by the gate."""
    ino = s.create()
    put = s.gate.hold("put")
    await s.engine.write(ino, 0, A)
    await until(lambda: put.entered, what="the upload's PUT")
    return ino, put


def _which(got: bytes) -> str:
    return {A: "the OLD data", B: "the new data"}.get(got, f"other bytes ({got[:8]!r}...)")


def test_upload_of_dropped_then_rewritten_extent_keeps_new_data(tmp_path):
    """(a) Extent written once, upload in flight; truncated away and written once
    again before the upload returns. Its write generation must not repeat."""
    async def scenario():
        async with _stack(tmp_path) as s:
            ino, put = await _upload_in_flight(s)
            await s.engine.truncate(ino, 0)  # record and hot file gone, PUT still held
            await s.engine.write(ino, 0, B)  # as many writes as the old content had
            put.release()
            await settle(s)
            s.evict_all()
            assert not s.record(ino, 0).hot
            got = await _read(s, ino, 0, E, "after eviction")
            assert got == B, (f"read back {_which(got)}: the upload of the truncated "
                              f"content marked the rewritten extent clean")

    run(scenario)


@pytest.mark.parametrize("via", ["read", "readahead"])
def test_whole_overwrite_during_fetch_wins(tmp_path, via):
    """(b) A write covering a whole cold extent while a fetch of it (a read's, or
    readahead's) is in flight: the fetched old copy must not replace it."""
    async def scenario():
        async with _stack(tmp_path) as s:
            ino = s.create()
            for i in range(3):
                await s.engine.write(ino, i * E, A)
            await _cold(s, ino)
            get = s.gate.hold("get", object_name(s.record(ino, 1).obj_id))
            concurrent = []

            async def reader():  # waits for the fetch of extent 1
                concurrent.append(await _read(s, ino, E, E, "concurrent read"))

            async with trio.open_nursery() as nursery:
                if via == "read":
                    nursery.start_soon(reader)
                else:  # a sequential reader of extent 0: readahead fetches extent 1
                    assert await _read(s, ino, 0, E, "extent 0") == A
                await until(lambda: get.entered, what="the GET of extent 1")
                await s.engine.write(ino, E, B)  # no fetch needed: covers it all
                get.release()
            # Concurrent with the write, the read may return either; nothing else.
            assert all(got in (A, B) for got in concurrent), _which(concurrent[0])
            await until(lambda: not s.fetches_in_flight(), what="the fetch to finish")
            got = await _read(s, ino, E, E, "after the fetch finished")
            assert got == B, f"read back {_which(got)}: the fetched copy won"
            await _cold(s, ino)
            got = await _read(s, ino, E, E, "from the bucket")
            assert got == B, f"read back {_which(got)} from the bucket"

    run(scenario)


@pytest.mark.parametrize("via", ["its own fetch", "a packed neighbour's fetch"])
def test_a_fetch_in_flight_never_serves_a_newer_version_old_bytes(tmp_path, via):
    """A file's old version is on its way from the bucket (a read of it, or, packed,
    a read of its neighbour that fetches it along). While that GET is held, the file
    is rewritten, uploaded and evicted: a read then must fetch the new version, not
    take the old bytes of the GET in flight."""
    async def scenario():
        async with _stack(tmp_path, pack_below=E if "packed" in via else 0) as s:
            first, neighbour = s.create(), s.create()
            await s.engine.write(first, 0, A)
            await s.engine.write(neighbour, 0, A)
            await _cold(s, first)
            await _cold(s, neighbour)
            old = s.record(neighbour, 0).obj_id
            if "packed" in via:
                assert s.record(first, 0).obj_id == old  # packed together
            get = s.gate.hold("get", object_name(old))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_read, s, first if "packed" in via else neighbour, 0, E,
                                   "the read that fetches the old version")
                await until(lambda: get.entered, what="the GET of the old version")
                assert s.fetches_in_flight()  # the neighbour rides along
                await s.engine.write(neighbour, 0, B)  # a new version, whole
                await _cold(s, neighbour)  # uploaded (alone: a pack of one) and evicted
                assert s.record(neighbour, 0).obj_id != old
                got = await _read(s, neighbour, 0, E, "the new version")
                assert got == B, f"read {_which(got)}"
                get.release()

    run(scenario)


@pytest.mark.parametrize("meanwhile", ["evicted and fetched again", "rewritten"])
def test_a_hot_copy_replaced_while_it_is_checked_is_not_called_damaged(tmp_path, meanwhile,
                                                                       monkeypatch):
    """The first read of a clean hot extent after a mount checks the copy against its
    record in a worker thread. While that thread runs, the copy is evicted (the
    thread finds no file) and fetched again, or rewritten: the verdict is about a
    copy that is not there any more, and must not drop the good one now in place
    (as "hot copy is damaged") nor fail the read."""
    # The check in a worker thread, always: a copy the page cache still holds (the drop
    # below is advice) would otherwise be checked inline, and the held check never come.
    monkeypatch.setattr(engine_module, "INLINE_VERIFY_MAX", 0)

    async def scenario():
        async with _stack(tmp_path) as s:
            ino = s.create()
            await s.engine.write(ino, 0, A)
            await s.uploader.flush({ino})
            s.forget_checks()  # what a new mount starts with
            s.drop_page_cache(ino, 0)
            before, after = s.hold_hot_checks()
            got = []

            async def reader():
                got.append(await _read(s, ino, 0, E, "the read that checks the copy"))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(reader)
                await until(lambda: before.entered, what="the check of the hot copy")
                assert s.evict_all() and not s.record(ino, 0).hot
                before.release()
                await until(lambda: after.entered, what="the check to read")
                if meanwhile == "rewritten":
                    await s.engine.write(ino, 0, B)
                else:
                    await s.engine.fetch(ino, 0)
                    assert s.record(ino, 0).hot
                after.release()
            assert got[0] in ((A, B) if meanwhile == "rewritten" else (A,)), _which(got[0])
            assert not s.engine.stats.counters.get("hot_checksum_errors"), s.describe(ino, 0)
            assert s.record(ino, 0).hot, f"the good copy was dropped: {s.describe(ino, 0)}"
            await _cold(s, ino)
            want = B if meanwhile == "rewritten" else A
            assert await _read(s, ino, 0, E, "from the bucket") == want

    run(scenario)


@pytest.mark.parametrize("change", ["write", "truncate", "direct write"])
def test_a_damaged_copy_found_at_mount_is_not_changed_in_place(tmp_path, change):
    """A clean hot copy found at mount whose bytes rotted on the disk: a change to part
    of it (a write, a truncate that cuts it, a direct writer) must not make the rotten
    bytes the file's, to be uploaded over the good object. The copy is checked first,
    dropped, and fetched from the bucket."""
    async def scenario():
        async with _stack(tmp_path, allowed_errors=("hot copy is damaged",)) as s:
            ino = s.create()
            await s.engine.write(ino, 0, A)
            await s.uploader.flush({ino})
            s.forget_checks()  # as after a remount
            with open(s.hot.path(ino, 0), "r+b") as f:  # a bit flipped on the disk
                f.seek(E // 2)
                f.write(b"Z")
            want = bytearray(A)
            if change == "write":
                await s.engine.write(ino, 0, b"B" * 10)
                want[:10] = b"B" * 10
            elif change == "truncate":
                await s.engine.truncate(ino, E - 10)
                del want[E - 10:]
            else:
                writes = DirectWrites(s.engine)
                [(_idx, fd)] = await writes.hold(ino, 0, 0, os.O_RDWR)
                try:
                    os.pwrite(fd, b"B" * 10, 0)
                finally:
                    os.close(fd)
                writes.release(ino, [0])
                want[:10] = b"B" * 10
            await _cold(s, ino)  # uploaded, and read back from the bucket below
            got = await _read(s, ino, 0, E, "after the change was uploaded")
            assert got == bytes(want), "the rotten byte went to the bucket" if b"Z" in got \
                else "the file does not hold what was written"
            assert s.engine.stats.counters["hot_checksum_errors"] == 1

    run(scenario)


def test_truncate_down_during_upload(tmp_path):
    """(c) A dirty extent cut short while its upload is in flight: the upload of
    the longer content must not become the extent, nor its cut-off tail come back."""
    async def scenario():
        async with _stack(tmp_path) as s:
            ino, put = await _upload_in_flight(s)
            cut = E // 2 + 3
            await s.engine.truncate(ino, cut)
            put.release()
            await settle(s)
            s.evict_all()
            assert s.size(ino) == cut and not s.record(ino, 0).hot
            assert await _read(s, ino, 0, E, "after eviction") == A[:cut]
            await s.engine.truncate(ino, E)  # the cut-off tail must read as zeros
            want = A[:cut] + bytes(E - cut)
            assert await _read(s, ino, 0, E, "after truncating up") == want
            await _cold(s, ino)
            assert await _read(s, ino, 0, E, "from the bucket") == want

    run(scenario)


def test_full_dirty_hot_tier_writers_wait_for_uploads(tmp_path):
    """(d) Hot tier full of dirty extents, upload delay 30 s: writers that need room
    make them due at once, wait for the uploads and succeed (no ENOSPC)."""
    async def scenario():
        async with _stack(tmp_path, cache_size=4 * E, upload_delay=30) as s:
            files = [s.create() for _ in range(3)]
            for i in range(4):
                await s.engine.write(files[0], i * E, A)
            assert len(s.engine.index.dirty) == 4 and not s.uploader.in_flight

            async def writer(ino, first):
                for i in range(first, first + 4):
                    await s.engine.write(ino, i * E, B)

            with trio.fail_after(10):  # a third of the upload delay
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(writer, files[0], 4)
                    nursery.start_soon(writer, files[1], 0)
                    nursery.start_soon(writer, files[2], 0)
            assert await _read(s, files[0], 0, 8 * E, "file 0") == A * 4 + B * 4
            for ino in files[1:]:
                assert await _read(s, ino, 0, 4 * E, "file") == B * 4

    run(scenario)


def test_fetch_reservations_do_not_refuse_writes(tmp_path):
    """Fetches in flight have reserved the whole hot tier and nothing is dirty: a
    writer must wait for them to land (then evict), not get ENOSPC."""
    async def scenario():
        async with _stack(tmp_path, cache_size=4 * E) as s:
            src, dst = s.create(), s.create()
            for i in range(6):
                await s.engine.write(src, i * E, A)
            await _cold(s, src)
            installs = s.hold_hot_installs()
            outcome = []

            async def write():
                try:
                    outcome.append(await s.engine.write(dst, 0, b"x" * 100))
                except FsError as e:
                    outcome.append(e)

            async with trio.open_nursery() as nursery:
                for i in range(1, 5):  # not from 0: no readahead
                    nursery.start_soon(s.engine.read, src, i * E, E)
                await until(lambda: installs.entered == 4, what="4 fetches to be installing")
                assert s.space.reserved == 4 * E and not s.engine.index.dirty, \
                    s.describe_space()
                nursery.start_soon(write)
                await trio.testing.wait_all_tasks_blocked()
                state = s.describe_space()
                installs.release()
            assert outcome == [100], (f"write with the room held by fetches in flight "
                                      f"got {outcome[0]!r}; {state}")

    run(scenario)


def test_an_unexpected_upload_error_backs_off_and_is_logged_once(tmp_path, monkeypatch):
    """An error that is neither the bucket's nor the database's (the daemon out of
    descriptors) used to be retried at once, with a traceback logged each time: a hot
    loop. It backs off as a bucket error does and is logged once per distinct error;
    the upload goes through once the error is gone."""
    async def scenario():
        async with _stack(tmp_path, allowed_errors=("upload of inode",)) as s:
            real, failing = s.uploader._dirty_state, [True]

            def dirty_state(key):  # as where the upload takes a descriptor
                if failing[0]:
                    raise OSError(errno.EMFILE, "Too many open files")
                return real(key)
            monkeypatch.setattr(s.uploader, "_dirty_state", dirty_state)
            ino = s.create()
            await s.engine.write(ino, 0, A)
            await until(lambda: s.engine.stats.counters["upload_errors"] >= 3, timeout=15,
                        what="three failed tries")
            assert s.uploader.backoff_until > 0
            logged = [r for r in s.logs.records if "upload of inode" in r.getMessage()]
            assert len(logged) == 1 and logged[0].exc_info, logged
            failing[0] = False
            await settle(s, timeout=15)
            assert not s.record(ino, 0).dirty and s.uploader.last_error is None
            assert await _read(s, ino, 0, E, "after the upload") == A

    run(scenario, timeout=60)


def test_a_write_on_a_full_disk_waits_for_the_trash_to_free_it(tmp_path, monkeypatch):
    """Dropped copies count as free while the trash empties them, but a write that
    needs their blocks on a disk short of min_free (a full disk: the disk's free space
    is injected) waits for the trash first, and then goes on."""
    async def scenario():
        async with _stack(tmp_path, cache_size=64 * E) as s:
            ino = s.create()
            for i in range(8):
                await s.engine.write(ino, i * E, A)
            await settle(s)
            go = threading.Event()
            empty = s.hot.trash._empty

            def held(path):
                assert go.wait(30), "the test never let the trash go on"
                empty(path)
                freed.append(path)
            s.hot.trash._empty, freed = held, []
            await s.engine.truncate(ino, 0)  # eight copies to the trash, held there
            assert s.hot.trash.waiting == 8 and s.hot.trash.pending_bytes >= 8 * E
            s.space.min_free = 10 * E
            monkeypatch.setattr(s.space, "disk_free", lambda: 10 * E + len(freed) * E)
            done = []

            async def writer():
                await s.engine.write(ino, 0, B)  # needs one extent the disk lacks
                done.append(True)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(writer)
                await trio.testing.wait_all_tasks_blocked()
                assert not done, "the write went on before the trash freed its room"
                go.set()
            assert done and s.hot.trash.waiting == 0
            assert await _read(s, ino, 0, E, "the write") == B

    run(scenario, timeout=60)


def test_gc_keeps_what_the_first_checkpoint_on_its_way_names(tmp_path):
    """A new filesystem keeps no checkpoint yet. While its first one is being put,
    an overwrite drops an object that checkpoint names: gc must not delete it, or
    recovering from that checkpoint would find the object gone."""
    from tierfs.tier.checkpoint import PREFIX

    async def body():
        async with _stack(tmp_path) as s:
            ino = s.create()
            await s.engine.write(ino, 0, A)
            await settle(s)
            first = s.record(ino, 0).obj_id
            put = s.gate.hold("put", PREFIX)
            done = trio.Event()

            async def checkpoint():
                await s.checkpointer.checkpoint()
                done.set()
            s.nursery.start_soon(checkpoint)
            await until(lambda: put.entered == 1, what="the checkpoint's put")
            await s.engine.write(ino, 0, B)  # drops `first` from the live metadata
            await settle(s)
            assert s.record(ino, 0).obj_id != first
            for _ in range(3):
                await s.gc.collect()
            s.memory.get(object_name(first))  # still there: the checkpoint names it
            put.release()
            await done.wait()
            await s.gc.collect()  # kept now: still named by the newest checkpoint
            s.memory.get(object_name(first))
    run(body)


@pytest.mark.parametrize("change", ["write", "truncate"])
def test_a_hot_file_deleted_behind_the_engine_is_fetched_before_a_change(tmp_path, change):
    """Someone deleted a clean hot extent file in the cache dir. A partial write or a
    truncate that cuts it must not make it again empty (zeros, dirty, then uploaded
    over the good object): it is fetched from the bucket first."""
    async def body():
        async with _stack(tmp_path) as s:
            ino = s.create()
            await s.engine.write(ino, 0, A)
            await settle(s)
            s.hot._forget_fd(ino, 0)
            os.unlink(s.hot.path(ino, 0))
            if change == "write":
                await s.engine.write(ino, 10, b"new")
                want = A[:10] + b"new" + A[13:]
            else:
                await s.engine.truncate(ino, E // 2)
                want = A[:E // 2]
            await settle(s)
            s.engine.drop_hot(ino, 0, s.record(ino, 0))
            assert await _read(s, ino, 0, E, "after the change") == want
    run(body)


def test_a_dirty_hot_file_deleted_behind_the_engine_fails_a_change_with_eio(tmp_path):
    async def body():
        async with _stack(tmp_path, upload_delay=3600,
                          allowed_errors=("hot file missing and not in the bucket",)) as s:
            ino = s.create()
            await s.engine.write(ino, 0, A)
            s.hot._forget_fd(ino, 0)
            os.unlink(s.hot.path(ino, 0))
            with pytest.raises(FsError) as e:
                await s.engine.write(ino, 10, b"new")
            assert e.value.errno == errno.EIO
    run(body)


def test_a_failed_fsync_gives_its_errno_and_leaks_no_descriptor(tmp_path, monkeypatch):
    """An extent file's fsync fails (ENOSPC from delayed allocation): fsync() gives
    ENOSPC, as fsync(2) would, not a logged traceback and EIO, and every descriptor
    it duplicated is closed."""
    def full(fd):
        os.close(fd)
        raise OSError(errno.ENOSPC, "No space left on device")

    async def body():
        async with _stack(tmp_path, upload_delay=3600, cache_size=64 * E) as s:
            ino = s.create()
            for i in range(20):
                await s.engine.write(ino, i * E, A)
            before = len(os.listdir("/proc/self/fd"))
            monkeypatch.setattr(s.hot, "fsync_fd", full)
            with pytest.raises(FsError) as e:
                await s.engine.fsync(ino)
            assert e.value.errno == errno.ENOSPC
            assert len(os.listdir("/proc/self/fd")) <= before  # none left open
            monkeypatch.undo()
    run(body)


def test_a_write_that_fails_on_its_second_extent_keeps_records_and_index_agreed(
        tmp_path, monkeypatch):
    """A write over a cold extent and into the next fails there (its file cannot be
    made: a full disk). The first extent's new bytes landed and are in the index; its
    record must say so too, or the next partial write of it would fetch the old copy
    and see the install declined, over and over."""
    async def body():
        async with _stack(tmp_path) as s:
            ino = s.create()
            await s.engine.write(ino, 0, A)
            await settle(s)
            s.engine.drop_hot(ino, 0, s.record(ino, 0))  # cold now
            real_fd = s.hot._fd

            def full_for_extent_1(i, idx, create):
                if idx == 1:
                    raise OSError(errno.ENOSPC, "No space left on device")
                return real_fd(i, idx, create)
            monkeypatch.setattr(s.hot, "_fd", full_for_extent_1)
            with pytest.raises(FsError) as e:
                await s.engine.write(ino, 0, B + b"xx")
            assert e.value.errno == errno.ENOSPC
            monkeypatch.undo()
            assert s.record(ino, 0).dirty
            await s.engine.write(ino, 5, b"zz")
            assert await _read(s, ino, 0, E, "after") == B[:5] + b"zz" + B[7:]
    run(body, timeout=20)


def test_unlink_of_a_huge_file_lets_other_requests_in(tmp_path):
    """The fs adapter's unlink of a file with more extents than one purge
    transaction takes goes in parts, and other tasks run between them (a 1 TiB
    file's purge held every request of the mount for seconds); in the end its
    records and hot copies are gone and its objects wait for gc."""
    from tierfs.fs.ops import Operations

    async def scenario():
        async with _stack(tmp_path, cache_size=32 * E) as s:
            ino = s.create("big")
            await s.engine.write(ino, 0, A * 20)
            await settle(s)  # uploaded: each extent has an object for gc
            objects = {s.record(ino, i).obj_id for i in range(20)}
            s.meta.purge_batch = 4
            ops = Operations(s.meta, s.engine)
            seen, done = [], False

            async def watch():
                while not done:
                    seen.append(len(s.meta.extent_indices(ino)))
                    await trio.sleep(0)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch)
                await ops.unlink(ROOT_INO, b"big", None)
                done = True
            assert any(0 < n < 20 for n in seen), seen  # ran between the parts
            assert s.meta.extent_indices(ino) == [] and not s.meta.orphans()
            assert not list(s.engine.index.indices(ino))
            await until(lambda: not set(s.memory.list("data/")) & {
                object_name(obj) for obj in objects}, what="gc to delete its objects")

    run(scenario)
