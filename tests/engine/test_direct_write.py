"""Extents held by direct writers (tier/direct_write.py), over the memory bucket:
what the daemon does between handing a writer descriptors and taking them back,
with uploads, truncates, fsync and a full hot tier interleaved on purpose."""
from __future__ import annotations

import errno
import os

import pytest
import trio

from tierfs.errors import FsError
from tierfs.tier.direct_write import DirectWrites

from .harness import run, settle, until
from .test_engine_model import A, B, E, _cold, _read, _stack, _upload_in_flight


def _write(fd: int, data: bytes, off: int = 0) -> None:
    assert os.pwrite(fd, data, off) == len(data)


def test_upload_in_flight_when_a_writer_takes_the_extent(tmp_path):
    """The upload read the old bytes; a direct writer takes the extent and writes new
    ones. The upload must not mark the extent clean, nor become its content."""
    async def scenario():
        async with _stack(tmp_path) as s:
            writes = DirectWrites(s.engine)
            ino, put = await _upload_in_flight(s)
            (idx, fd), = await writes.hold(ino, 0, 0, os.O_RDWR)
            _write(fd, B)
            put.release()
            await until(lambda: s.engine.stats.counters["uploads_superseded"],
                        what="the stale upload to be set aside")
            assert (ino, 0) in s.engine.index.dirty
            os.close(fd)
            writes.release(ino, [idx])
            await _cold(s, ino)
            assert await _read(s, ino, 0, E, "from the bucket") == B

    run(scenario)


def test_held_extents_wait_for_their_release_to_upload(tmp_path):
    """Uploads go on around a held extent (another file uploads), never of it: the
    writer may be half-way through it. Released, it uploads what it holds."""
    async def scenario():
        async with _stack(tmp_path) as s:
            writes = DirectWrites(s.engine)
            ino, other = s.create(), s.create()
            (idx, fd), = await writes.hold(ino, 0, 0, os.O_WRONLY)
            _write(fd, A[:E // 2])
            await s.engine.write(other, 0, B)
            await until(lambda: s.record(other, 0).obj_id, what="the other file's upload")
            assert not s.record(ino, 0).obj_id and (ino, 0) in s.engine.index.dirty
            _write(fd, A[E // 2:], E // 2)
            os.close(fd)
            assert writes.release(ino, [idx]) == E  # the file grew to what it holds
            await settle(s)
            s.evict_all()
            assert await _read(s, ino, 0, E, "from the bucket") == A

    run(scenario)


def test_truncate_of_a_held_extent_keeps_later_writes(tmp_path):
    """A truncate through the mount to 0 while a writer holds extents 0-1: the
    writer's later write into extent 1 lands there, as on a local disk (a hole
    before it), and nothing of what the truncate cut comes back."""
    async def scenario():
        async with _stack(tmp_path) as s:
            writes = DirectWrites(s.engine)
            ino = s.create()
            granted = await writes.hold(ino, 0, 1, os.O_RDWR)
            assert [i for i, _fd in granted] == [0, 1]
            for i, fd in granted:
                _write(fd, A)
            writes.release(ino, [])  # nothing released: the size is still 0
            await s.engine.fsync(ino)  # ... until fsync settles what the writer wrote
            assert s.size(ino) == 2 * E
            await s.engine.truncate(ino, 0)
            _write(granted[1][1], B[:100], 10)
            for _i, fd in granted:
                os.close(fd)
            assert writes.release(ino, [0, 1]) == E + 110
            want = bytes(E + 10) + B[:100]
            assert await _read(s, ino, 0, E + 110, "after the release") == want
            await _cold(s, ino)
            assert await _read(s, ino, 0, E + 110, "from the bucket") == want

    run(scenario)


def test_holds_take_only_what_fits_and_wait_for_room(tmp_path):
    """A hot tier of 4 extents, 3 of them dirty with a long upload delay: a writer
    asking for 8 extents gets the first at once... and only as many as fit; the next
    request waits for uploads (made due at once), never ENOSPC."""
    async def scenario():
        async with _stack(tmp_path, cache_size=4 * E, upload_delay=30) as s:
            writes = DirectWrites(s.engine)
            other, ino = s.create(), s.create()
            for i in range(3):
                await s.engine.write(other, i * E, A)
            granted = await writes.hold(ino, 0, 7, os.O_WRONLY)
            assert [i for i, _fd in granted] == [0]
            _write(granted[0][1], B)
            os.close(granted[0][1])
            writes.release(ino, [0])
            with trio.fail_after(10):  # a third of the upload delay
                more = await writes.hold(ino, 1, 7, os.O_WRONLY)
            assert more and more[0][0] == 1
            for i, fd in more:
                _write(fd, B)
                os.close(fd)
            writes.release(ino, [i for i, _fd in more])
            n = 1 + len(more)
            assert s.size(ino) == n * E
            assert await _read(s, ino, 0, n * E, "the file") == B * n
            assert await _read(s, other, 0, 3 * E, "the other file") == A * 3

    run(scenario)


def test_unwritten_extents_held_ahead_leave_nothing_behind(tmp_path):
    """Extents held ahead of a writer that stopped short are dropped at release: no
    dirty records or hot files past the end of the file."""
    async def scenario():
        async with _stack(tmp_path) as s:
            writes = DirectWrites(s.engine)
            ino = s.create()
            granted = await writes.hold(ino, 0, 3, os.O_WRONLY)
            _write(granted[0][1], A[:10])
            for _i, fd in granted:
                os.close(fd)
            assert writes.release(ino, [i for i, _fd in granted]) == 10
            assert sorted(s.meta.all_extents(ino)) == [0]
            assert s.engine.index.indices(ino) == [0]
            await settle(s)

    run(scenario)


def test_a_fenced_engine_refuses_holds(tmp_path):
    async def scenario():
        async with _stack(tmp_path) as s:
            ino = s.create()
            s.engine.state.fenced_by = "another node"
            with pytest.raises(FsError) as err:
                await DirectWrites(s.engine).hold(ino, 0, 0, os.O_WRONLY)
            assert err.value.errno == errno.EROFS
            assert not s.meta.all_extents(ino) and not s.engine.index.held

    run(scenario)


def test_a_hot_tier_full_of_clean_data_makes_room_for_a_whole_range(tmp_path):
    """A warm cache (all clean) is the usual hot tier: a range of extents is granted
    at once, evicting clean ones, not one extent per request."""
    async def scenario():
        async with _stack(tmp_path, cache_size=4 * E) as s:
            writes = DirectWrites(s.engine)
            other, ino = s.create(), s.create()
            for i in range(4):
                await s.engine.write(other, i * E, A)
            await settle(s)
            assert s.engine.index.total == 4 * E  # full, and all of it clean
            granted = await writes.hold(ino, 0, 3, os.O_WRONLY)
            assert [i for i, _fd in granted] == [0, 1, 2, 3]
            for _i, fd in granted:
                os.close(fd)
            writes.release(ino, [0, 1, 2, 3])
            assert await _read(s, other, 0, 4 * E, "the evicted file") == A * 4

    run(scenario)


def test_an_upload_waiting_for_a_slot_skips_an_extent_taken_meanwhile(tmp_path):
    """Found by the model: an upload task picks its write generation when it starts,
    maybe after waiting for a free upload slot, so a hold taken while it waited must
    stop it; else the half-written extent is marked clean and later writes are lost."""
    async def scenario():
        async with _stack(tmp_path, upload_parallel=1) as s:
            writes = DirectWrites(s.engine)
            busy, ino = s.create(), s.create()
            put = s.gate.hold("put")
            await s.engine.write(busy, 0, A)  # takes the only upload slot, held
            await until(lambda: put.entered, what="the first upload's PUT")
            await s.engine.write(ino, 0, A)
            await until(lambda: (ino, 0) in s.uploader.in_flight,
                        what="the second upload waiting for the slot")
            (idx, fd), = await writes.hold(ino, 0, 0, os.O_RDWR)
            put.release()
            await until(lambda: not s.uploader.in_flight, what="both uploads to end")
            assert (ino, 0) in s.engine.index.dirty and s.record(ino, 0).dirty
            _write(fd, B)
            os.close(fd)
            writes.release(ino, [idx])
            await _cold(s, ino)
            assert await _read(s, ino, 0, E, "from the bucket") == B

    run(scenario)


def test_a_hot_file_deleted_behind_the_engine_is_fetched_before_a_hold(tmp_path):
    """Someone deleted a clean hot extent file in the cache dir. A direct writer that
    changes part of the extent must write into the extent's bytes, fetched from the
    bucket first, not into a new empty file (zeros uploaded over the good object)."""
    async def scenario():
        async with _stack(tmp_path) as s:
            writes = DirectWrites(s.engine)
            ino = s.create()
            await s.engine.write(ino, 0, A)
            await settle(s)
            s.hot._forget_fd(ino, 0)
            os.unlink(s.hot.path(ino, 0))
            (idx, fd), = await writes.hold(ino, 0, 0, os.O_WRONLY)
            _write(fd, b"new", 10)
            os.close(fd)
            writes.release(ino, [idx])
            await _cold(s, ino)
            assert await _read(s, ino, 0, E, "from the bucket") == A[:10] + b"new" + A[13:]

    run(scenario)


def test_a_hold_whose_records_cannot_be_committed_leaves_nothing_held(tmp_path, monkeypatch):
    """The metadata database refuses the hold's records (full: ENOSPC). The writer gets
    the error; no extent stays held (held ones never upload, and `sync --wait` would
    wait for them) and no descriptor is left open."""
    async def scenario():
        async with _stack(tmp_path) as s:
            writes = DirectWrites(s.engine)
            ino = s.create()
            update = s.meta.update

            def full(inode, extents={}, *args, **kwargs):
                if any(key[0] == ino for key in extents):
                    raise FsError(errno.ENOSPC, "metadata database is full")
                return update(inode, extents, *args, **kwargs)

            monkeypatch.setattr(s.meta, "update", full)
            fds_before = len(os.listdir("/proc/self/fd"))
            with pytest.raises(FsError) as err:
                await writes.hold(ino, 0, 3, os.O_WRONLY)
            assert err.value.errno == errno.ENOSPC
            assert not s.engine.index.held
            assert len(os.listdir("/proc/self/fd")) == fds_before
            monkeypatch.setattr(s.meta, "update", update)
            await s.engine.write(ino, 0, A)  # the file works as before
            await settle(s)
            assert await _read(s, ino, 0, E, "after the refused hold") == A

    run(scenario)
