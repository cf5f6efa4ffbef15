"""SharedView's push (a namespace in PostgreSQL) against a change of the file that ends
while the database answers it, and against a getattr whose database read it overtakes."""
from __future__ import annotations

import stat
import threading
from types import SimpleNamespace

import pyfuse3
import pytest
import trio

from tests.engine.harness import engine_stack, run, settle, until
from tierfs.fs.shared_ops import SharedOperations
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


async def written_past_its_published_end(shared, stack):
    """A file published with 8 bytes, then written to 12 here and uploaded, not yet
    published; with the node's view and FUSE adapter."""
    view = SharedView(shared, stack.engine, wait=1.0)
    ops = SharedOperations(shared, view, stack.engine)
    node = shared.create_node(ROOT_INO, b"f", stat.S_IFREG | 0o644, 0, 0)
    view.created(node)
    with view.changing(node.ino):
        await stack.engine.write(node.ino, 0, b"12345678")
    await settle(stack)
    await view.push(node.ino)  # published: 8 bytes, in the bucket
    with view.changing(node.ino):
        await stack.engine.write(node.ino, 8, b"abcd")  # not yet: 12 bytes
    await settle(stack)  # uploaded: the next push counts it as published
    return view, ops, node


def test_a_getattr_that_read_the_database_before_a_push_committed_answers_this_nodes_size(
        tmp_path, shared):
    """A getattr read the file's shared record, then a push of this node's newer size
    committed and counted the file as published before the getattr looked whether
    this node's copy is newer: it answered the size from before this node's write,
    and the kernel (no writeback cache on a shared namespace) took it. Seen with
    fsx as `fstat` giving the size from before a write past the end."""
    async def body():
        async with engine_stack(tmp_path, extent_size=E, cache_size=1 << 20,
                                upload_delay=0, checkpoint_every=0) as stack:
            view, ops, node = await written_past_its_published_end(shared, stack)
            read, answer = threading.Event(), threading.Event()
            attrs = shared.attrs

            def slow_attrs(*args):  # the record is read, the answer is slow to come
                found = attrs(*args)
                read.set()
                answer.wait(10)
                return found
            shared.attrs = slow_attrs
            got = []

            async def getattr():
                got.append(await ops.getattr(node.ino, None))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(getattr)
                await until(read.is_set, what="the getattr to read the database")
                await view.push(node.ino)  # the uploader's push, say
                assert node.ino not in view.unpublished
                answer.set()
            assert shared.attrs(node.ino, E)[0].size == 12
            assert got[0].st_size == 12
    run(body)


def test_touching_a_file_whose_write_is_not_yet_published_keeps_its_size(tmp_path, shared):
    """utime (`touch`) on a file this node wrote past its published end, uploaded but
    not yet published: setattr pushes the file, then answered the shared record it
    changed, read before that push, with the old size. The kernel takes a setattr's
    size as it is: the file read as cut short."""
    async def body():
        async with engine_stack(tmp_path, extent_size=E, cache_size=1 << 20,
                                upload_delay=0, checkpoint_every=0) as stack:
            view, ops, node = await written_past_its_published_end(shared, stack)
            attr = pyfuse3.EntryAttributes()
            attr.st_atime_ns, attr.st_mtime_ns = 1_000, 2_000
            fields = SimpleNamespace(update_size=False, update_mode=False, update_uid=False,
                                     update_gid=False, update_atime=True, update_mtime=True,
                                     update_ctime=False)
            entry = await ops.setattr(node.ino, attr, fields, None, SimpleNamespace(uid=0))
            assert node.ino not in view.unpublished  # the setattr pushed it
            assert shared.attrs(node.ino, E)[0].size == 12
            assert (entry.st_size, entry.st_mtime_ns) == (12, 2_000)
    run(body)
