"""The shared gc queue of a namespace in PostgreSQL, collected by a node's
GarbageCollector over the in-memory bucket: an object waits the grace after it
was queued (another node that opened the file before may still read it), each
time it is queued."""
from __future__ import annotations

import stat
import types

import pytest

from tests.engine.harness import engine_stack, run
from tierfs.meta import MetaStore
from tierfs.meta.schema import ROOT_INO, Extent, Superblock, object_name
from tierfs.meta.store import Published
from tierfs.tier import gc as gc_module
from tierfs.tier.gc import GarbageCollector

GRACE = 60.0
E = 64 << 10


@pytest.fixture
def shared(postgres):
    store = MetaStore(postgres.new_schema())
    store.format(Superblock(fs_id="shared-gc", extent_size=E), uid=0, gid=0)
    yield store
    store.close()


@pytest.fixture
def clock(monkeypatch):
    """The gc's clock, moved by the test: grace is counted without sleeping."""
    now = [1000.0]
    monkeypatch.setattr(gc_module, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    return now


def _publish(shared, ino: int, obj_ids: list[int]) -> None:
    """The file as a node closing it has it: one extent per object named."""
    exts = {i: Extent(length=1, checksum=0, obj_id=obj, obj_len=1)
            for i, obj in enumerate(obj_ids)}
    assert shared.publish([Published(ino, len(exts), 1, 1, exts, 0)], 0, "node") == [True]


def test_an_object_queued_again_waits_the_grace_again(tmp_path, shared, clock):
    """A rewrite drops object O, a later close names it again (it leaves the queue),
    a second rewrite drops it again. A node that opened the file just before the
    second rewrite reads O for up to the grace: O must wait the grace from the
    second drop, not from when the gc first saw it."""
    async def body():
        async with engine_stack(tmp_path, extent_size=E, cache_size=1 << 20,
                                upload_delay=0, checkpoint_every=0) as stack:
            stack.engine.gc_guard = lambda epoch: True  # no checkpoints when shared
            gc = GarbageCollector(stack.engine, meta=shared, grace=GRACE)
            o_id, other_id = 1 << 40, (1 << 40) + 1
            for obj in (o_id, other_id):
                stack.memory.put(object_name(obj), b"x")
            f = shared.create_node(ROOT_INO, b"f", stat.S_IFREG | 0o644, 0, 0)
            _publish(shared, f.ino, [o_id, other_id])
            _publish(shared, f.ino, [])  # a rewrite: both objects queued
            assert await gc.collect() == 0  # first seen now
            _publish(shared, f.ino, [o_id])  # a later close names O again
            clock[0] += GRACE
            assert await gc.collect() == 1  # the other object waited its grace
            assert stack.memory.size(object_name(other_id)) is None
            _publish(shared, f.ino, [])  # O is dropped again: its grace starts now
            assert await gc.collect() == 0
            assert stack.memory.size(object_name(o_id)) is not None, \
                "deleted at once when queued again: a reader that opened the file before loses it"
            clock[0] += GRACE
            assert await gc.collect() == 1
            assert stack.memory.size(object_name(o_id)) is None
    run(body)


def test_an_object_named_and_dropped_again_between_two_passes_waits_again(
        tmp_path, shared, clock):
    """The same, with the later close and the second rewrite both between two passes
    of the gc: the queue must tell the second drop from the first."""
    async def body():
        async with engine_stack(tmp_path, extent_size=E, cache_size=1 << 20,
                                upload_delay=0, checkpoint_every=0) as stack:
            stack.engine.gc_guard = lambda epoch: True  # no checkpoints when shared
            gc = GarbageCollector(stack.engine, meta=shared, grace=GRACE)
            o_id = 1 << 41
            stack.memory.put(object_name(o_id), b"x")
            f = shared.create_node(ROOT_INO, b"f", stat.S_IFREG | 0o644, 0, 0)
            _publish(shared, f.ino, [o_id])
            _publish(shared, f.ino, [])  # a rewrite: O queued
            assert await gc.collect() == 0  # first seen now
            clock[0] += GRACE - 1
            _publish(shared, f.ino, [o_id])  # a later close names O again
            _publish(shared, f.ino, [])  # and a second rewrite drops it again
            clock[0] += 1
            assert await gc.collect() == 0
            assert stack.memory.size(object_name(o_id)) is not None, \
                "deleted 1 s after it was queued again"
            clock[0] += GRACE
            assert await gc.collect() == 1
    run(body)
