"""st_blocks through the fs adapter's getattr, over the memory bucket: a stat of a
file with many extents does not read every extent record each time, and stays
exact for sparse files as their records change."""
from __future__ import annotations

from tierfs.fs.ops import Operations
from tierfs.meta import schema
from tierfs.meta.store import count_blocks

from .harness import engine_stack, run

KiB = 1024
E = 4 * KiB
COUNT = 300  # extents in the file


def test_a_stat_of_a_big_file_does_not_read_every_extent_record(tmp_path):
    async def scenario():
        async with engine_stack(tmp_path, extent_size=E, cache_size=2 * COUNT * E,
                                upload_delay=60, checkpoint_every=0) as s:
            ops = Operations(s.meta, s.engine)
            ino = s.create()
            for idx in range(COUNT):
                if idx != 7:  # a hole
                    await s.engine.write(ino, idx * E, b"x" * E)
            read = []
            scan = s.meta.kv.scan

            def counting(txn, start, end, values=True):
                for key, val in scan(txn, start, end, values):
                    if key.startswith(schema.extent_prefix(ino)):
                        read.append(key)
                    yield key, val

            s.meta.kv.scan = counting

            def exact() -> int:
                node = s.meta.get_inode(ino)
                return count_blocks(node, s.meta.extent_indices(ino), E)

            async def stat() -> tuple[int, int]:
                """st_blocks, and how many extent records the stat read."""
                read.clear()
                blocks = (await ops.getattr(ino, None)).st_blocks
                return blocks, len(read)

            assert (await stat())[0] == exact() == (COUNT - 1) * E // 512
            assert await stat() == ((COUNT - 1) * E // 512, 1)  # the last record only
            await s.engine.write(ino, 7 * E, b"y" * 100)  # the hole partly filled
            assert (await stat())[0] == exact() == COUNT * E // 512
            await s.engine.truncate(ino, 100 * E + 1)
            assert (await stat())[0] == exact() == (100 * E + 512) // 512
            assert await stat() == ((100 * E + 512) // 512, 1)

    run(scenario)
