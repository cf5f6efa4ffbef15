"""MetaSync: callers that wait for their commits to be durable share syncs, and none
returns before a sync that started after its call has finished."""
from __future__ import annotations

import threading

import trio
import trio.testing

from tierfs.meta import MetaStore
from tierfs.tier.meta_sync import MetaSync


def test_waiters_share_syncs_and_each_is_covered_by_one_started_after_it(tmp_path):
    meta = MetaStore(str(tmp_path / "meta"), map_size=1 << 24)
    started: list[int] = []   # the commit count each sync saw when it started
    release = threading.Event()
    inner = meta.sync
    commits = 0

    def sync() -> None:
        started.append(commits)
        release.wait(10)
        inner()
    meta.sync = sync

    async def main():
        nonlocal commits
        syncer = MetaSync(meta, trio.CapacityLimiter(4))
        covered: dict[int, int] = {}

        async def waiter(n: int) -> None:
            await syncer.commits_so_far()
            covered[n] = len(started)

        async with trio.open_nursery() as nursery:
            commits = 1
            nursery.start_soon(waiter, 1)
            while not started:                 # the first sync runs, held
                await trio.sleep(0.001)
            for n in range(2, 12):             # ten commits while it runs
                commits = n
                nursery.start_soon(waiter, n)
            await trio.testing.wait_all_tasks_blocked()  # all of them wait for it
            release.set()
        assert started == [1, 11]             # then they share one more
        assert covered[1] >= 1 and all(covered[n] == 2 for n in range(2, 12))

    try:
        trio.run(main)
    finally:
        meta.close()
