"""The hint queue (tierfs/tier/hinted.py) over the real engine: a replaced list is
dropped at once, and a long run of files already hot leaves the event loop free
between passes."""
from __future__ import annotations

import trio
import trio.testing

from tests.task_steps import TaskSteps
from tierfs.tier.hinted import HEAD, SKIPS_PER_PASS, HintQueue

from .harness import KiB, engine_stack, run, until

E = 64 * KiB


def _stack(tmp_path):
    # Uploads held off: every written file stays hot (and dirty) for the whole test.
    return engine_stack(tmp_path, extent_size=E, cache_size=1 << 30, upload_delay=3600,
                        checkpoint_every=0)


async def _hot_files(s, n: int) -> list[int]:
    inos = []
    for _ in range(n):
        ino = s.create()
        await s.engine.write(ino, 0, b"x")
        inos.append(ino)
    return inos


def test_a_replaced_list_is_no_longer_wanted_and_the_new_one_is(tmp_path):
    async def scenario():
        async with _stack(tmp_path) as s:
            old, new = await _hot_files(s, 60), await _hot_files(s, 50)
            q = HintQueue(s.engine)  # not running: the lists stay queued
            q.add(old, replace=True)
            # The rest of a list sent in several requests: appended, not a new head.
            q.add(old[:5], replace=False)
            mine = q.lists[None]
            assert list(mine.head) == old[:HEAD] and list(mine.queue) == old[HEAD:] + old[:5]
            assert all(q.wanted(ino) for ino in old) and mine.queued[old[0]] == 2
            q.add(new, replace=True)
            assert not any(q.wanted(ino) for ino in old)
            assert all(q.wanted(ino) for ino in new)
            mine = q.lists[None]
            assert list(mine.head) == new[:HEAD] and list(mine.queue) == new[HEAD:]
            depth = q.depth
            q.loader_waited(old[0])  # a miss of a file no longer hinted: not behind
            assert q.depth == depth
            q.loader_waited(new[-1])  # a miss of a file still queued: behind
            assert q.depth == depth + 1
    run(scenario)


def test_a_long_list_of_hot_files_is_skipped_with_the_loop_free_between_passes(tmp_path):
    passes = 10
    steps = TaskSteps()

    async def scenario():
        trio.lowlevel.add_instrument(steps)
        async with _stack(tmp_path) as s:
            inos = await _hot_files(s, HEAD + passes * SKIPS_PER_PASS)
            q = HintQueue(s.engine)
            s.nursery.start_soon(q.run, name="hints")
            q.add(inos, replace=True)
            await until(lambda: q.done == len(inos), 30, "every hinted file counted done")
            assert not q.waiting() and not q.in_flight
            assert s.engine.stats.snapshot().get("hinted_files") == len(inos)
    run(scenario, timeout=60)
    # Skipping is a pass of SKIPS_PER_PASS files at a time: any other request of the
    # mount waits for one pass at most, not for the whole list.
    assert steps.steps["hints"] >= passes


def test_a_full_no_replace_tier_gets_no_hinted_file_it_would_not_keep(tmp_path):
    """Under no-replace a full hot tier keeps no fetched file. A hinted prefetch then
    fetched each file all the same and threw its bytes away: a data set larger than
    the tier came from the bucket twice an epoch (once for the hint, once for the
    loader's read). Now the hinted files are not fetched while nothing would keep them."""
    async def scenario():
        async with engine_stack(tmp_path, extent_size=E, cache_size=4 * E, upload_delay=0,
                                checkpoint_every=0) as s:
            cold = []
            for _ in range(8):
                ino = s.create()
                await s.engine.write(ino, 0, b"c" * E)
                await s.uploader.flush({ino})
                s.evict_all()
                cold.append(ino)
            for _ in range(4):  # the tier's first fill: clean, hot, and kept
                ino = s.create()
                await s.engine.write(ino, 0, b"h" * E)
                await s.uploader.flush({ino})
            s.space.policy = "no-replace"
            assert s.space._over(E) > 0, s.describe_space()
            gets = s.engine.stats.snapshot().get("cold_reads", 0)
            q = HintQueue(s.engine)
            s.nursery.start_soon(q.run)
            q.add(cold, replace=True)
            await until(lambda: not q.waiting() and not q.in_flight, 10, "the hint list done")
            assert s.engine.stats.snapshot().get("cold_reads", 0) == gets, (
                "hinted files fetched from the bucket though the tier keeps none of them")
            assert not any(s.engine.index.extents_of(ino) for ino in cold)
    run(scenario)


def test_lists_appended_faster_than_they_are_fetched_stop_at_max_queued(tmp_path):
    """hint() without replace appends: a loader that sends its whole order every epoch
    while the prefetch is behind grew the queue (and the daemon's memory) by a data
    set's length an epoch, without end. Files past max_queued waiting are dropped and
    counted; the answer says how many were queued; a replacing list starts afresh."""
    async def scenario():
        async with _stack(tmp_path) as s:
            inos = await _hot_files(s, 70)
            q = HintQueue(s.engine, max_queued=100)  # not running: the lists stay queued
            assert q.add(inos[:60], replace=True) == 60
            for _epoch in range(3):
                q.add(inos, replace=False)
            mine = q.lists[None]
            assert q.waiting() == 100
            assert sum(mine.queued.values()) == 100
            assert list(mine.head) + list(mine.queue) == inos[:60] + inos[:40]
            assert s.engine.stats.snapshot().get("hints_dropped") == 3 * 70 - 40
            assert q.add(inos, replace=False) == 0
            assert q.add(inos[:50], replace=True) == 50
            mine = q.lists[None]
            assert list(mine.head) + list(mine.queue) == inos[:50]
    run(scenario)


def test_lists_replaced_one_after_another_keep_the_fetches_in_flight_bounded(tmp_path):
    """Each new list starts its first HEAD files at once. Replaced again and again (a
    loader hinting each next batch, several clients replacing each other's lists)
    while the bucket is slow, every list added HEAD more fetches to those still
    running, without bound: hundreds of stale fetches queued for the bucket ahead of
    the loader's own reads. Now a list's head starts only while fewer than HEAD +
    max_depth files are in flight."""
    lists = 10

    async def scenario():
        async with engine_stack(tmp_path, extent_size=E, cache_size=1 << 30, upload_delay=0,
                                checkpoint_every=0) as s:
            inos = []
            for _ in range(lists * HEAD):
                ino = s.create()
                await s.engine.write(ino, 0, b"c" * 100)
                inos.append(ino)
            await s.uploader.flush(None)
            s.evict_all()
            gets = s.gate.hold("get")
            q = HintQueue(s.engine)
            s.nursery.start_soon(q.run)
            cap = HEAD + q.max_depth
            for i in range(lists):
                q.add(inos[i * HEAD:(i + 1) * HEAD], replace=True)
                await trio.testing.wait_all_tasks_blocked()  # the queue took it up
            assert q.in_flight.total() <= cap, f"{q.in_flight.total()} hinted fetches at once"
            assert gets.entered
            gets.release()
            await until(lambda: not q.waiting() and not q.in_flight, 10,
                        "the last list fetched")
            assert all(s.engine.index.extents_of(ino) for ino in inos[-HEAD:])
    run(scenario)


def test_lists_of_different_clients_do_not_replace_each_other(tmp_path):
    """The ranks of a job on one node each send their own epoch order with
    replace=True: each replaced the one before, and only the last rank's files were
    prefetched. Each client now has its own list; the lists take turns; an empty
    replacing list drops the sender's own files only; and a client past max_lists
    drops the list sent to least recently."""
    async def scenario():
        async with _stack(tmp_path) as s:
            inos = await _hot_files(s, 3 * (HEAD + 4))
            a, b, c = (inos[i * (HEAD + 4):(i + 1) * (HEAD + 4)] for i in range(3))
            q = HintQueue(s.engine, max_lists=2)  # not running: the lists stay queued
            q.add(a, replace=True, client="rank 0")
            q.add(b, replace=True, client="rank 1")
            assert all(q.wanted(ino) for ino in a + b), "one rank's list replaced another's"
            q.add([], replace=True, client="rank 0")
            assert not any(q.wanted(ino) for ino in a) and all(q.wanted(ino) for ino in b)
            q.add(a, replace=True, client="rank 0")
            q.add(c, replace=True, client="rank 2")  # past max_lists: rank 1 sent last longest ago
            assert not any(q.wanted(ino) for ino in b)
            assert all(q.wanted(ino) for ino in a + c)
            assert s.engine.stats.snapshot().get("hint_lists_dropped") == 1
    run(scenario)


def test_the_lists_of_several_clients_take_turns(tmp_path):
    """Files past the heads come a file of each list in turn, not one list after the
    other: every rank's next files are prefetched ahead of its loader."""
    async def scenario():
        async with engine_stack(tmp_path, extent_size=E, cache_size=1 << 30, upload_delay=0,
                                checkpoint_every=0) as s:
            inos = []
            for _ in range(2 * (HEAD + 8)):
                ino = s.create()
                await s.engine.write(ino, 0, b"c" * 100)
                inos.append(ino)
            await s.uploader.flush(None)
            s.evict_all()
            a, b = inos[:HEAD + 8], inos[HEAD + 8:]
            gets = s.gate.hold("get")  # every fetch stays in flight
            q = HintQueue(s.engine, max_depth=2 * HEAD + 4)
            q.depth = 2 * HEAD + 4  # both heads and the next 4 files
            q.add(a, replace=True, client="rank 0")
            q.add(b, replace=True, client="rank 1")
            s.nursery.start_soon(q.run)
            await until(lambda: q.in_flight.total() == 2 * HEAD + 4, 10,
                        "the heads and four files more in flight")
            await trio.testing.wait_all_tasks_blocked()
            assert q.in_flight.total() == 2 * HEAD + 4
            assert list(q.lists["rank 0"].queue) == a[HEAD + 2:], "not a file of each in turn"
            assert list(q.lists["rank 1"].queue) == b[HEAD + 2:], "not a file of each in turn"
            gets.release()
            await until(lambda: not q.waiting() and not q.in_flight, 10, "both lists fetched")
    run(scenario)
