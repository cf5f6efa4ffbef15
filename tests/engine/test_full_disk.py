"""Writes into the hot tier when its disk fills part way: the bytes a failed write
left behind never become the file's later."""
from __future__ import annotations

import errno
import os

import pytest

from tierfs.errors import FsError

from tests.harness import fill_disk, small_disk as harness_small_disk

from .harness import engine_stack, run

KiB = 1024
E = 64 * KiB
PAGE = 4 * KiB


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs for the whole stack (hot tier and metadata)."""
    with harness_small_disk(tmp_path / "small", "4m") as disk:
        yield disk


def _stack(disk):
    return engine_stack(disk, extent_size=E, cache_size=64 * E, upload_delay=3600,
                        checkpoint_every=0)


def test_bytes_of_a_short_write_never_show_after_the_file_grows(small_disk):
    """A write that extends an extent file on a nearly full disk gets some of its bytes
    in (a short write) and fails with ENOSPC. Those bytes lie past the file's size;
    growing the file later (truncate up, a write further on) must show zeros there."""
    async def body():
        async with _stack(small_disk) as s:
            ino = s.create()
            await s.engine.write(ino, 0, b"a" * 1000)
            filler = str(small_disk / "filler")
            fill_disk(filler, leave=2 * PAGE)
            with pytest.raises(FsError) as err:
                await s.engine.write(ino, 1000, b"b" * (E - 1000))
            assert err.value.errno == errno.ENOSPC
            assert s.size(ino) == 1000
            os.unlink(filler)
            await s.engine.truncate(ino, E // 2)
            await s.engine.write(ino, E - 1, b"c")
            data = bytes(await s.engine.read(ino, 0, E))
            assert data == b"a" * 1000 + bytes(E - 1001) + b"c"
    run(body)


def test_a_short_write_over_a_clean_copy_leaves_the_file_as_it_was(small_disk):
    """A write over an uploaded extent that fails part way on a full disk has already
    changed the first bytes of its clean hot copy in place. The write returned ENOSPC:
    the file must read as before, and a later check of the copy against its record (a
    remount's) must not find it damaged."""
    async def body():
        async with _stack(small_disk) as s:
            ino = s.create()
            await s.engine.write(ino, 0, b"a" * 1000)
            await s.uploader.flush({ino})
            assert not s.engine.index.dirty
            filler = str(small_disk / "filler")
            fill_disk(filler, leave=2 * PAGE)
            with pytest.raises(FsError) as err:
                await s.engine.write(ino, 0, b"b" * E)
            assert err.value.errno == errno.ENOSPC
            os.unlink(filler)
            assert bytes(await s.engine.read(ino, 0, E)) == b"a" * 1000
            s.forget_checks()  # what a remount does
            assert bytes(await s.engine.read(ino, 0, E)) == b"a" * 1000
    run(body)


def _fail_next_write_commit(s) -> list[int]:
    """Make the next commit of a file's inode (the last step of a write, after its bytes
    are on the hot tier, or of a truncate) fail as a full disk under the metadata
    database makes it fail. Returns a list that counts the failures."""
    update = s.meta.update
    failed = []

    def failing_update(inode, *args, **kwargs):
        if inode is not None and not failed:
            failed.append(inode.ino)
            raise FsError(errno.ENOSPC, "metadata database: no space left on the disk")
        return update(inode, *args, **kwargs)

    s.meta.update = failing_update
    return failed


async def _reads_one_content(s, ino: int) -> None:
    """After a failed write of b's over a's: the file reads either, and the same one
    once its copy is uploaded, evicted and checked again (what a remount does)."""
    first = bytes(await s.engine.read(ino, 0, E))
    assert first in (b"a" * 1000, b"b" * 1000)
    await s.uploader.flush({ino})
    assert not s.record(ino, 0).dirty, s.describe(ino, 0)  # in the bucket
    s.evict_all()
    assert bytes(await s.engine.read(ino, 0, E)) == first, s.describe(ino, 0)
    s.forget_checks()  # what a remount does
    assert bytes(await s.engine.read(ino, 0, E)) == first


def test_a_write_whose_commit_fails_over_a_clean_copy_never_flips(small_disk):
    """The bytes of a write over an uploaded extent are on the hot tier when the commit
    of the write fails (ENOSPC). Whichever bytes the file then reads must stay what it
    reads: not the new ones until the copy is evicted and the old ones after."""
    async def body():
        async with _stack(small_disk) as s:
            ino = s.create()
            await s.engine.write(ino, 0, b"a" * 1000)
            await s.uploader.flush({ino})
            failed = _fail_next_write_commit(s)
            with pytest.raises(FsError) as err:
                await s.engine.write(ino, 0, b"b" * 1000)
            assert err.value.errno == errno.ENOSPC and failed
            await _reads_one_content(s, ino)
    run(body)


def test_bytes_of_a_write_whose_commit_failed_never_show_after_the_file_grows(small_disk):
    """A write past a file's end whose commit fails leaves the file its old size; when a
    later write grows the file over that range, it reads zeros there, in the extent the
    file had (dirty) and in the one the failed write began."""
    async def body():
        async with _stack(small_disk) as s:
            ino = s.create()
            await s.engine.write(ino, 0, b"a" * 1000)
            failed = _fail_next_write_commit(s)
            with pytest.raises(FsError) as err:
                await s.engine.write(ino, 1000, b"b" * E)
            assert err.value.errno == errno.ENOSPC and failed
            assert s.size(ino) == 1000
            await s.engine.write(ino, 2 * E - 1, b"c")
            data = bytes(await s.engine.read(ino, 0, 2 * E))
            assert data == b"a" * 1000 + bytes(2 * E - 1001) + b"c"
    run(body)


def test_a_short_write_over_a_clean_copy_whose_commit_fails_too_never_flips(small_disk):
    """On a full disk the short write over an uploaded extent and the commit that
    follows it may both fail: the file still reads one content, before and after its
    copy is uploaded (a flush leaves nothing dirty), evicted and checked, never EIO."""
    async def body():
        async with _stack(small_disk) as s:
            ino = s.create()
            await s.engine.write(ino, 0, b"a" * 1000)
            await s.uploader.flush({ino})
            filler = str(small_disk / "filler")
            fill_disk(filler, leave=2 * PAGE)
            failed = _fail_next_write_commit(s)
            with pytest.raises(FsError) as err:
                await s.engine.write(ino, 0, b"b" * E)
            assert err.value.errno == errno.ENOSPC and failed
            os.unlink(filler)
            await _reads_one_content(s, ino)
    run(body)


def test_a_truncate_whose_commit_fails_leaves_the_file_as_it_was(small_disk):
    """A shrinking truncate whose commit fails (ENOSPC) leaves the file its size and
    bytes: the extents past the cut (dirty, only on the hot tier) stay readable, and
    the uploaded one it would cut reads the same before and after it is evicted."""
    async def body():
        async with _stack(small_disk) as s:
            ino = s.create()
            await s.engine.write(ino, 0, b"a" * E)
            await s.uploader.flush({ino})
            await s.engine.write(ino, E, b"b" * E)
            failed = _fail_next_write_commit(s)
            with pytest.raises(FsError) as err:
                await s.engine.truncate(ino, E // 2)
            assert err.value.errno == errno.ENOSPC and failed
            assert s.size(ino) == 2 * E
            assert bytes(await s.engine.read(ino, 0, 2 * E)) == b"a" * E + b"b" * E
            await s.uploader.flush({ino})
            s.evict_all()
            s.forget_checks()  # what a remount does
            assert bytes(await s.engine.read(ino, 0, 2 * E)) == b"a" * E + b"b" * E
    run(body)
