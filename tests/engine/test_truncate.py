"""Truncate of files with many extents, over the memory bucket: a shrink goes in
parts with the event loop free between them, and no committed state between the
parts (what a crash leaves) holds data past the file's end."""
from __future__ import annotations

import trio

from tierfs.hot import HotStore
from tierfs.meta import MetaStore, schema
from tierfs.tier.engine import Engine
from tierfs.tier.space import Space

from .harness import engine_stack, run

KiB = 1024
E = 4 * KiB
COUNT = 40  # extents in the file
BATCH = 6  # extent records one part drops


def _stack(tmp_path):
    return engine_stack(tmp_path, extent_size=E, cache_size=4 * COUNT * E, upload_delay=0,
                        checkpoint_every=0)


def _content(idx: int) -> bytes:
    return bytes([idx % 251 + 1]) * E


async def _big_file(s) -> int:
    """A file of COUNT extents: the first half uploaded and evicted, the rest hot."""
    ino = s.create()
    for idx in range(COUNT):
        await s.engine.write(ino, idx * E, _content(idx))
        if idx == COUNT // 2 - 1:
            await s.uploader.flush({ino})
            s.evict_all()
    return ino


def _original(start: int, end: int) -> bytes:
    data = b"".join(_content(i) for i in range(COUNT))
    return data[start:end]


class Watch:
    """A task that looks at the committed records whenever the truncate lets it run."""

    def __init__(self, s, ino: int):
        self.s, self.ino = s, ino
        self.sizes: list[int] = []
        self.done = False

    def look(self) -> None:
        size = self.s.size(self.ino)
        past_end = [i for i in self.s.meta.extent_indices(self.ino) if i * E >= size]
        assert not past_end, f"size {size}: records past the end {past_end}"
        self.sizes.append(size)

    async def run(self) -> None:
        while not self.done:
            self.look()
            await trio.sleep(0)


def test_a_shrinking_truncate_lets_other_tasks_run_between_parts(tmp_path):
    """A truncate that drops more records than a part holds: other tasks run
    between the parts, each part leaves a file that ends where its data ends, and
    after an extend nothing cut comes back."""
    async def scenario():
        async with _stack(tmp_path) as s:
            s.meta.purge_batch = BATCH
            ino = await _big_file(s)
            new_size = 5 * E + 100
            watch = Watch(s, ino)

            async def truncate() -> None:
                await s.engine.truncate(ino, new_size)
                watch.done = True

            async with trio.open_nursery() as nursery:
                nursery.start_soon(truncate)
                nursery.start_soon(watch.run)
            between = [n for n in watch.sizes if new_size < n < COUNT * E]
            assert between, f"nothing ran between the parts: sizes seen {watch.sizes}"
            assert s.size(ino) == new_size
            assert s.meta.extent_indices(ino) == list(range(6))
            await s.engine.truncate(ino, COUNT * E)
            data = bytes(await s.engine.read(ino, 0, COUNT * E))
            assert data[:new_size] == _original(0, new_size)
            assert data[new_size:] == bytes(COUNT * E - new_size)

    run(scenario)


def test_a_truncate_stopped_between_parts_leaves_a_whole_shorter_file(tmp_path):
    """The truncate dies after a part (as the daemon would): the next mount finds
    a file that ends where that part left it, its data intact up to there; extended,
    it reads zeros past that point."""
    async def scenario():
        async with _stack(tmp_path) as s:
            s.meta.purge_batch = BATCH
            ino = await _big_file(s)
            watch = Watch(s, ino)
            async with trio.open_nursery() as nursery:
                async def truncate() -> None:
                    await s.engine.truncate(ino, 0)
                    watch.done = True

                nursery.start_soon(truncate)
                while not watch.done and not [n for n in watch.sizes if 0 < n < COUNT * E]:
                    watch.look()
                    await trio.sleep(0)
                nursery.cancel_scope.cancel()
            assert not watch.done, f"the truncate ran in one part: sizes seen {watch.sizes}"
            left = s.size(ino)
            assert 0 < left < COUNT * E
            watch.look()
            memory = s.memory
        # The next mount, on the same cache dir and bucket: extended, the file reads
        # its data up to where the truncate stopped, then zeros.
        meta = MetaStore(str(tmp_path / "meta"), map_size=1 << 30)
        hot = HotStore(str(tmp_path / "hot"))
        try:
            engine = Engine(meta, hot, memory, E)
            assert engine.load_index() == []
            engine.space = Space(engine, cache_size=4 * COUNT * E, min_free=0)
            async with trio.open_nursery() as nursery:
                engine.nursery = nursery
                assert meta.get_inode(ino).size == left
                await engine.truncate(ino, COUNT * E)
                data = bytes(await engine.read(ino, 0, COUNT * E))
                nursery.cancel_scope.cancel()
        finally:
            hot.close()
            meta.close()
        assert data[:left] == _original(0, left)
        assert data[left:] == bytes(COUNT * E - left)

    run(scenario)


def test_an_extending_truncate_reads_no_extent_record(tmp_path, monkeypatch):
    """Growing a file changes no extent: none is read (a huge file's would take
    the event loop for as long as they take to decode)."""
    async def scenario():
        async with _stack(tmp_path) as s:
            ino = await _big_file(s)
            decoded = []
            original, decode = schema.Extent.__dict__["decode"], schema.Extent.decode
            counting = staticmethod(lambda raw: decoded.append(1) or decode(raw))
            monkeypatch.setattr(schema.Extent, "decode", counting)
            await s.engine.truncate(ino, 2 * COUNT * E)
            monkeypatch.setattr(schema.Extent, "decode", original)
            assert not decoded, f"{len(decoded)} extent records read"
            assert s.size(ino) == 2 * COUNT * E

    run(scenario)
