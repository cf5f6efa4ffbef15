"""SharedView's push (a namespace in PostgreSQL) against a change of the file that ends
while the database answers it."""
from __future__ import annotations

import stat
import threading

import pytest
import trio

from tests.engine.harness import engine_stack, run, until
from tierfs.meta import MetaStore
from tierfs.meta.schema import ROOT_INO, Superblock
from tierfs.tier.shared_view import SharedView

E = 64 << 10


@pytest.fixture
def shared(postgres):
    store = MetaStore(postgres.new_schema())
    store.format(Superblock(fs_id="shared-push", extent_size=E), uid=0, gid=0)
    store.open_session("node", 1, "/mnt")
    yield store
    store.close()


def test_a_push_that_read_the_file_during_a_change_leaves_it_unpublished(tmp_path, shared):
    """A push read the file while a write was landing, and the write ended before the
    database answered: the push counted the file as published, so the write's own
    push (at fsync or close) found nothing to do and the database kept the records
    from before the write. Seen with the namespace in PostgreSQL as an msync'd write
    lost after a remount, and as data truncated away coming back. The file now stays
    unpublished until a push that read it after the change."""
    async def body():
        async with engine_stack(tmp_path, extent_size=E, cache_size=1 << 20,
                                upload_delay=3600, checkpoint_every=0) as stack:
            view = SharedView(shared, stack.engine, wait=1.0)
            node = shared.create_node(ROOT_INO, b"f", stat.S_IFREG | 0o644, 0, 0)
            view.created(node)
            asked, answer = threading.Event(), threading.Event()
            publish = shared.publish

            def slow_publish(*args):  # the database takes its time to answer
                asked.set()
                answer.wait(10)
                return publish(*args)
            shared.publish = slow_publish
            async with trio.open_nursery() as nursery:
                with view.changing(node.ino):
                    nursery.start_soon(view.push, node.ino)
                    await until(asked.is_set, what="the push to ask the database")
                    await stack.engine.write(node.ino, 0, b"new data")
                answer.set()  # the change has ended; now the database answers
            assert node.ino in view.unpublished
            shared.publish = publish
            await view.push(node.ino)  # what fsync or close pushes
            published, exts = shared.file_view(node.ino)
            assert published.size == len(b"new data")
            assert exts[0].dirty and exts[0].holder == view.sid  # its data: on this node
    run(body)
