"""Prefetch of hinted files: a queue worked through in order, ahead of the data loader
that sent the hints.

Each fetch also brings the hinted files packed right next to the one it is for (one
ranged GET of up to 8 MiB instead of one per file), so a random epoch order over
packed small files costs a few GETs per pack. The first HEAD files of a new list (the
loader's first batch) are fetched at once, each on its own: in a random order they
lie all over the packs, and wide GETs would bring them only with most of the data
set, while the loader waits for its first batch (unless HEAD + MAX_DEPTH files are in
flight already: lists replaced quickly one after another). The number of files fetched at once
adapts: it starts at MIN_DEPTH and grows by one each time the loader has to wait for
the bucket for a file still in the queue (the prefetch is behind), up to MAX_DEPTH;
a failing bucket halves it. Named files follow the cache policy (no-replace: only
while there is room); the neighbours read along only fill free room.

A list may hold a million files: replacing it costs the same whatever its length
(queued files are counted apart from those in flight), and a run of files already
hot is skipped SKIPS_PER_PASS at a time, with the event loop free in between. The
queue holds MAX_QUEUED files at most: a client that appends list after list faster
than they are fetched (hint() without replace, every epoch) has the files past it
dropped and counted, rather than grow the daemon's memory without end.

Each client has its own list (keyed by its process and the name it gives: a
HintingSampler names its list after its files), so the ranks of a job on one node do
not replace each other's lists: replace=True replaces the sender's own list only, and
the lists take turns, a file of each in turn. MAX_LISTS lists are kept at most; a new
one past that drops the one sent to least recently.
"""
from __future__ import annotations

import collections
import logging

import trio

from ..errors import TierfsError
from . import actions

log = logging.getLogger(__name__)

MIN_DEPTH = 4
# More wide GETs at once do not bring the next batches sooner: each brings a run of
# the data set, and their installs then compete with the loader's reads for the
# daemon (a full-size cold epoch was 8 points less busy at 32 than at 8).
MAX_DEPTH = 8
HEAD = 32  # files at the front of a new hint list fetched at once, each on its own
SKIPS_PER_PASS = 256  # hot files skipped between two checkpoints
MAX_QUEUED = 4_000_000  # files waiting at most (the queue and its counter cost memory per file)
MAX_LISTS = 64  # clients' lists kept at most (a node's ranks, a sampler or two each)


class HintList:
    """One client's files waiting: the head (fetched at once, each alone), the rest
    in order, and how often each file is in either."""

    def __init__(self):
        self.head: collections.deque[int] = collections.deque()
        self.queue: collections.deque[int] = collections.deque()
        self.queued: collections.Counter[int] = collections.Counter()

    def __len__(self) -> int:
        return len(self.head) + len(self.queue)


class HintQueue:
    def __init__(self, engine, max_depth: int = MAX_DEPTH, max_queued: int = MAX_QUEUED,
                 max_lists: int = MAX_LISTS):
        self.engine = engine
        self.max_depth = max_depth
        self.max_queued = max_queued
        self.max_lists = max_lists
        self.depth = min(MIN_DEPTH, max_depth)
        # Per client, the one sent to least recently first.
        self.lists: dict[object, HintList] = {}
        self.in_flight: collections.Counter[int] = collections.Counter()
        self._turn = 0  # which list gives the next file (they take turns)
        self._wake = trio.Event()
        self._room = trio.Event()
        self.done = 0
        engine.on_miss = self.loader_waited

    def add(self, inos: list[int], replace: bool, client=None) -> int:
        """Queue files on `client`'s list; the number queued (those past max_queued
        waiting are dropped)."""
        hints = self.lists.pop(client, None)  # put back last: the most recent
        # A new list: its first batch comes first. A list sent in several requests
        # goes on with its second (replace=False) while its first is in flight.
        new_list = replace or hints is None or not (hints or self.in_flight)
        if replace or hints is None:
            hints = HintList()
        self.lists[client] = hints
        while len(self.lists) > self.max_lists:
            del self.lists[next(iter(self.lists))]
            self.engine.stats.inc("hint_lists_dropped")
        room = max(0, self.max_queued - self.waiting())
        if len(inos) > room:
            self.engine.stats.inc("hints_dropped", len(inos) - room)
            inos = inos[:room]
        hints.queued.update(inos)
        if new_list:
            hints.head.extend(inos[:HEAD])
            self._room.set()
        hints.queue.extend(inos[HEAD:] if new_list else inos)
        self._wake.set()
        return len(inos)

    def waiting(self) -> int:
        """Files queued on all lists (not in flight)."""
        return sum(len(hints) for hints in self.lists.values())

    def wanted(self, ino: int) -> bool:
        return ino in self.in_flight or any(ino in h.queued for h in self.lists.values())

    def loader_waited(self, ino: int) -> None:
        """A read missed the hot tier: if its file is still hinted, prefetch is behind."""
        if self.wanted(ino) and self.depth < self.max_depth:
            self.depth += 1
            self.engine.stats.inc("hint_depth_raised")
            self._room.set()

    @staticmethod
    def _drop(counter: collections.Counter, ino: int) -> None:
        counter[ino] -= 1
        if counter[ino] <= 0:
            del counter[ino]

    def _take(self, hints: HintList, ino: int) -> None:
        """A file leaves its list for a fetch of its own."""
        self._drop(hints.queued, ino)
        self.in_flight[ino] += 1

    def _next_list(self) -> HintList:
        """The list whose turn it is to give a file (one of them has files queued)."""
        ready = [hints for hints in self.lists.values() if hints.queue]
        self._turn = (self._turn + 1) % len(ready)
        return ready[self._turn]

    async def run(self) -> None:
        skipped = 0
        async with trio.open_nursery() as nursery:
            while True:
                # A head starts at once, but fetches of lists replaced meanwhile may
                # still run: never more than HEAD + max_depth files in flight.
                heads = [hints for hints in self.lists.values() if hints.head]
                for hints in heads:
                    while hints.head and self.in_flight.total() < HEAD + self.max_depth:
                        ino = hints.head.popleft()
                        self._take(hints, ino)
                        nursery.start_soon(self._one, ino, True)
                heads_left = any(hints.head for hints in heads)
                if not heads_left and not any(h.queue for h in self.lists.values()):
                    self._wake = trio.Event()
                    await self._wake.wait()
                    continue
                if heads_left or self.in_flight.total() >= self.depth:
                    self._room = trio.Event()
                    await self._room.wait()
                    continue
                hints = self._next_list()
                ino = hints.queue.popleft()
                if self._all_hot(ino):  # fetched along with a neighbour meanwhile
                    self._drop(hints.queued, ino)
                    self.done += 1
                    self.engine.stats.inc("hinted_files")
                    skipped += 1
                    if skipped % SKIPS_PER_PASS == 0:
                        await trio.lowlevel.checkpoint()
                    continue
                self._take(hints, ino)
                nursery.start_soon(self._one, ino)

    def _all_hot(self, ino: int) -> bool:
        try:
            return all(ext.hot for ext in self.engine.meta.all_extents(ino).values())
        except TierfsError:
            return True  # gone: nothing to fetch

    async def _one(self, ino: int, alone: bool = False) -> None:
        try:
            await self.engine.give_way()  # planning a wide GET reads many records
            await actions.prefetch(self.engine, ino, parallel=1, for_write=False,
                                   wanted=None if alone else self.wanted)
            self.done += 1
            self.engine.stats.inc("hinted_files")
        except TierfsError as e:
            self.depth = max(MIN_DEPTH // 2, self.depth // 2)  # a failing bucket: back off
            self.engine.stats.inc("hinted_failed")
            log.debug("hinted prefetch of inode %d failed: %s", ino, e)
        except Exception:  # a hint is an optimisation: it never takes the mount down
            self.engine.stats.inc("hinted_failed")
            log.exception("hinted prefetch of inode %d failed", ino)
        finally:
            self._drop(self.in_flight, ino)
            self._room.set()
