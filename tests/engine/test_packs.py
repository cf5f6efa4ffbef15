"""Packs after upload, over the in-memory bucket: compaction and scrub meeting a
lost pack, a rewrite or a compaction while they read."""
from __future__ import annotations

import errno
import os

import pytest
import trio
import trio.testing

from tierfs.errors import FsError
from tierfs.meta import scan
from tierfs.meta.schema import object_name

from .harness import KiB, engine_stack, run, settle, until

E = 64 * KiB
SMALL = 8 * KiB  # a small file: one short extent, packed


def _stack(tmp_path, **kw):
    kw.setdefault("cache_size", 64 * E)
    kw.setdefault("upload_delay", 0)
    return engine_stack(tmp_path, extent_size=E, checkpoint_every=0, pack_below=E,
                        pack_size=16 * E, **kw)


async def _packed(s, n: int, fill: int) -> tuple[list[int], int]:
    """n small files written together and uploaded as one pack: (inodes, pack id)."""
    inos = [s.create() for _ in range(n)]
    for i, ino in enumerate(inos):
        await s.engine.write(ino, 0, bytes([fill + i]) * SMALL)
    await settle(s)
    packs = {s.record(ino, 0).obj_id for ino in inos}
    assert len(packs) == 1 and s.meta.pack(packs.pop()) is not None
    return inos, s.record(inos[0], 0).obj_id


def test_a_lost_pack_does_not_stop_compaction_of_the_others(tmp_path):
    """A pack gone from the bucket (deleted by hand, a lifecycle rule) cannot be
    compacted: its files read EIO. It must not keep every other dead pack from
    being compacted, pass after pass, with a warning each time."""
    async def body():
        async with _stack(tmp_path, compact_dead=0.5,
                          allowed_errors=("is missing from the bucket",)) as s:
            lost_inos, lost = await _packed(s, 4, 1)
            inos, kept = await _packed(s, 4, 11)
            s.memory.delete(object_name(lost))
            for ino in lost_inos[1:] + inos[1:]:  # both packs 3/4 dead
                await s.engine.truncate(ino, 0)
            await until(lambda: s.record(inos[0], 0).obj_id != kept, timeout=5,
                        what="the live pack to be compacted")
            s.evict_all()
            assert bytes(await s.engine.read(inos[0], 0, SMALL)) == bytes([11]) * SMALL
            assert s.record(lost_inos[0], 0).obj_id == lost  # left where it is
            errors = [r.getMessage() for r in s.logs.records if "missing" in r.getMessage()]
            assert any(object_name(lost) in m for m in errors), errors
    run(body)


def test_a_pack_the_bucket_will_not_read_does_not_stop_compaction_of_the_others(tmp_path):
    """A pack the bucket refuses to read (a lifecycle rule archived it: S3 answers
    403 InvalidObjectState) cannot be compacted, and its files read EIO. Before,
    that refusal failed every compaction pass, and as the deadest pack it came
    first each time: no other pack was ever compacted again."""
    async def body():
        async with _stack(tmp_path, compact_dead=0.5,
                          allowed_errors=("InvalidObjectState",)) as s:
            archived_inos, archived = await _packed(s, 4, 1)
            inos, kept = await _packed(s, 4, 11)
            s.faulty.refuse_gets = (object_name(archived),)
            for ino in archived_inos[1:] + inos[1:]:  # both packs 3/4 dead
                await s.engine.truncate(ino, 0)
            await until(lambda: s.record(inos[0], 0).obj_id != kept, timeout=5,
                        what="the readable pack to be compacted")
            s.evict_all()
            assert bytes(await s.engine.read(inos[0], 0, SMALL)) == bytes([11]) * SMALL
            assert s.record(archived_inos[0], 0).obj_id == archived  # left where it is
            named = [r.getMessage() for r in s.logs.records
                     if object_name(archived) in r.getMessage()]
            assert len(named) == 1 and "compaction" in named[0], named
            with pytest.raises(FsError) as e:  # its own files only
                await s.engine.read(archived_inos[0], 0, SMALL)
            assert e.value.errno == errno.EIO
    run(body)


@pytest.mark.parametrize("change", ["rewrite", "truncate"])
def test_scrub_does_not_call_an_object_changed_under_it_damaged(tmp_path, change):
    """Scrub reads a packed file's object while the file is rewritten (or cut) and
    uploaded: the old pack is deleted at once (no checkpoint names it). That is
    no damage: scrub must not report a damaged object nor log one missing."""
    from tierfs.tier import actions

    async def body():
        async with _stack(tmp_path) as s:
            inos, pack = await _packed(s, 2, 1)
            ino = inos[0]
            get = s.gate.hold("get")
            result = {}

            async def scrub():
                result.update(await actions.scrub(s.engine, ino))
            s.nursery.start_soon(scrub)
            await until(lambda: get.entered, what="scrub's GET")
            if change == "rewrite":
                await s.engine.write(ino, 0, b"x" * SMALL)
            else:
                await s.engine.truncate(ino, 0)
            await s.engine.truncate(inos[1], 0)  # the pack's last reference goes
            await settle(s)
            await until(lambda: object_name(pack) not in s.memory.list("data/"),
                        what="gc to delete the old pack")
            get.release()
            await until(lambda: result, what="scrub to finish")
            assert result["cold_bad"] == 0, result
    run(body)


def test_a_pack_cut_short_fails_only_the_files_it_lacks(tmp_path):
    """A pack whose end is lost (a truncated object in a file:// bucket): a cold
    read of an intact file reads its neighbours along in one GET, which comes back
    short. Only the file whose bytes are gone may fail, and the log names it."""
    import errno

    from tierfs.errors import FsError

    async def body():
        async with _stack(tmp_path, allowed_errors=("checksum mismatch",)) as s:
            inos, pack = await _packed(s, 4, 1)
            name = object_name(pack)
            s.memory.put(name, s.memory.get(name)[:3 * SMALL + 10])  # the last file cut
            s.evict_all()
            for i, ino in enumerate(inos[:3]):
                got = bytes(await s.engine.read(ino, 0, SMALL))
                assert got == bytes([1 + i]) * SMALL, f"file {i} read wrong"
            s.evict_all()
            with pytest.raises(FsError) as e:
                await s.engine.read(inos[3], 0, SMALL)
            assert e.value.errno == errno.EIO
            blamed = [r.getMessage() for r in s.logs.records if "mismatch" in r.getMessage()]
            assert blamed and all(f"inode {inos[3]} extent 0" in m for m in blamed), blamed
    run(body)


def test_fsck_names_the_files_of_a_pack_it_cannot_read_and_checks_the_rest(tmp_path):
    """fsck --verify-data over a bucket that refuses to read one pack (archived by a
    lifecycle rule: 403 InvalidObjectState). It stopped at that pack with one error
    line (the CLI's "access denied to bucket: check AWS credentials"), so nothing
    else was checked or repaired. Each file of the pack is now a finding naming
    it, and the rest of the check goes on."""
    from tierfs.meta import schema
    from tierfs.tier.fsck import Fsck

    async def body():
        async with _stack(tmp_path) as s:
            archived_inos, archived = await _packed(s, 2, 1)
            _inos, other = await _packed(s, 2, 11)
            s.meta.delete_raw([schema.pack_key(other)])  # a problem fsck must still find
            s.evict_all()
            s.faulty.refuse_gets = (object_name(archived),)
            problems = [f.problem for f in Fsck(s.meta, s.hot, s.cold, E, repair=False,
                                                verify_data=True).run()]
            unreadable = [p for p in problems if "cannot be read" in p]
            assert sorted(unreadable) == sorted(
                f"inode {ino} extent 0: object {object_name(archived)} cannot be read "
                f"(get {object_name(archived)} failed: InvalidObjectState (HTTP 403)): "
                f"its data was not checked" for ino in archived_inos), problems
            assert any(f"pack {other} has lost its record" in p for p in problems), problems
    run(body)


@pytest.mark.parametrize("lost", ["pack record", "pack record and references"])
def test_fsck_records_a_pack_that_lost_its_record_again(tmp_path, lost):
    """Files share a pack whose record is gone from the metadata: dropping one of
    them would send the whole object to gc, as if it were that file's alone. fsck
    must say so and record the pack again, not leave the files sharing a bare
    object."""
    from tierfs.meta import schema
    from tierfs.tier.fsck import Fsck

    async def body():
        async with _stack(tmp_path) as s:
            inos, pack = await _packed(s, 3, 1)
            keys = [schema.pack_key(pack)]
            if lost != "pack record":
                keys += [schema.ref_key(pack, r.offset) for r in s.meta.pack_refs(pack)]
            s.meta.delete_raw(keys)

            def fsck(repair: bool):
                return [f.problem for f in Fsck(s.meta, s.hot, s.cold, E, repair=repair,
                                                verify_data=False).run()]
            assert fsck(False), "fsck found nothing wrong"
            fsck(True)
            assert fsck(False) == []
            await s.engine.truncate(inos[0], 0)  # drops one file's share of the pack
            for _ in range(3):
                await s.gc.collect()
            s.evict_all()
            for i, ino in enumerate(inos[1:], 2):
                assert bytes(await s.engine.read(ino, 0, SMALL)) == bytes([i]) * SMALL
    run(body)


def test_neighbours_read_along_are_installed_only_when_the_mount_gives_way(tmp_path):
    """The hot copies of files read along with a miss are installed on the trio thread
    in a step of their own, after engine.give_way() (the mount's wait while FUSE
    requests are queued); the reader that fetched them never waits for it."""
    async def body():
        async with _stack(tmp_path) as s:
            inos, _pack = await _packed(s, 4, 1)
            s.evict_all()
            requests_queued = trio.Event()  # set: the mount's queue is read
            waits = []

            async def give_way():
                waits.append(trio.current_time())
                await requests_queued.wait()
            s.engine.give_way = give_way
            got = bytes(await s.engine.read(inos[0], 0, SMALL))
            assert got == bytes([1]) * SMALL
            await until(lambda: waits, 5, "the install of the neighbours gave way")
            await trio.testing.wait_all_tasks_blocked()
            assert not any(s.record(ino, 0).hot for ino in inos[1:])
            requests_queued.set()
            await until(lambda: all(s.record(ino, 0).hot for ino in inos[1:]), 5,
                        "the neighbours installed once the mount gave way")
            for i, ino in enumerate(inos[1:], 1):
                assert bytes(await s.engine.read(ino, 0, SMALL)) == bytes([1 + i]) * SMALL
            assert s.engine.stats.snapshot().get("read_around_extents") == 3
    run(body)


def test_neighbours_waiting_to_be_installed_leave_no_temp_files_when_the_engine_stops(tmp_path):
    """The daemon stops (its background tasks cancelled) while the fetched neighbours'
    hot copies are written and wait for their install: no temp file is left behind
    (new ones beside their extents' places, or spares with bytes in them)."""
    holding = []

    async def body():
        async with _stack(tmp_path) as s:
            inos, _pack = await _packed(s, 4, 1)
            s.evict_all()

            async def give_way():
                holding.append((s.hot.root, s.hot.spare_dir))
                await trio.sleep_forever()
            s.engine.give_way = give_way
            assert bytes(await s.engine.read(inos[0], 0, SMALL)) == bytes([1]) * SMALL
            await until(lambda: holding, 5, "the neighbours' copies written, install waiting")
    run(body)
    root, spare = holding[0]
    temps = [os.path.join(d, n) for d, _subdirs, names in os.walk(root)
             for n in names if ".tmp" in n]
    temps += [os.path.join(spare, n) for n in os.listdir(spare)
              if os.path.getsize(os.path.join(spare, n))]
    assert temps == [], f"temp files left behind: {temps}"
