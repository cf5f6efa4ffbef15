"""A node's view of a namespace shared by many nodes (--meta-url).

The shared engine (PostgreSQL) holds the namespace and, for every extent, where
its data is: an object in the bucket, or "only on node S" (published DIRTY,
schema.py). The data engine keeps running synchronously against this node's own
LMDB in its cache dir, which holds the files this node works with: their inode,
their extent records with the node-local bits (hot, pinned), its hot index. The
two meet where close-to-open consistency says they must:

- pull, at open(): the shared records replace this node's copy; hot copies of
  extents whose data changed elsewhere are dropped. Data only on another node is
  waited for (that node uploads at close), up to a bound, then EIO naming the node.
- push, at flush() (every close()), fsync() and after an upload: this node's size,
  times and extent records become the shared ones; objects they no longer name go
  to gc. Files written here and not yet pushed carry a W record in the local LMDB,
  so a restart pushes them again.

Every call of the shared engine runs in a worker thread: a database round trip
must not stop the trio loop.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import logging
import socket
from collections import deque
from dataclasses import replace

import trio

from ..errors import FsError
from ..meta.store import ID_BLOCK, MetaStore, Published

log = logging.getLogger(__name__)

ALL = (1 << 64) - 1
IDS_LOW = ID_BLOCK // 4  # object ids left when a new block is fetched ahead
PUSH_BATCH = 256  # files published in one transaction after their uploads
PUSH_RETRY_MAX_S = 5.0  # longest pause between tries to publish while the database is away
PUBLISHED_KEEP = 4096  # publishes newer_here() remembers; older reads count as raced


class SharedView:
    def __init__(self, shared: MetaStore, engine, *, wait: float, threads: int = 8):
        self.shared = shared
        self.local: MetaStore = engine.meta
        self.engine = engine
        self.sid = shared.session
        self.node = socket.gethostname()
        self.wait = wait  # longest wait for data another node holds
        self.limiter = trio.CapacityLimiter(threads)
        self.unpublished: set[int] = set(self.local.unpublished())
        self._gen: dict[int, int] = {}
        self._changing: dict[int, int] = {}  # changes of each file still on their way
        # Files counted as published, numbered, for newer_here(): a database read
        # that began before a push committed holds the records from before it.
        self.published = 0
        self._published_recent: deque[tuple[int, int]] = deque(maxlen=PUBLISHED_KEEP)
        # Files whose copy here changed under the kernel's cached attributes or pages
        # (by any pull: open, setattr, a tiering command): the next open drops them.
        self.stale_in_kernel: set[int] = set()
        self._locks: dict[int, trio.Lock] = {}
        self._due: set[int] = set()
        self._wake = trio.Event()
        self._ids: deque[int] = deque()
        self._ids_lock = trio.Lock()
        self.local.object_ids = self._object_id
        self.local.private_objects = set()  # deleted by this node's gc only until published
        self.hurry = lambda ino: None  # upload a closed file's data now (the uploader)

    async def call(self, fn, *args):
        """A shared-engine call, in a worker thread."""
        return await trio.to_thread.run_sync(functools.partial(fn, *args),
                                             limiter=self.limiter, abandon_on_cancel=True)

    # ---- object ids -------------------------------------------------------------------
    def _object_id(self) -> int:
        if not self._ids:  # not reached: every taker awaits ids_ready() first
            self._add_block(self.shared._take_block(b"obj"))
        return self._ids.popleft()

    def _add_block(self, first: int) -> None:
        self._ids.extend(range(first, first + ID_BLOCK))

    async def ids_ready(self) -> None:
        """Object ids in hand for the next uploads, fetched in a worker thread (the
        uploader awaits this before it takes one: no database call on the trio loop)."""
        async with self._ids_lock:
            if len(self._ids) < IDS_LOW:
                self._add_block(await self.call(self.shared._take_block, b"obj"))

    # ---- changes made here ----------------------------------------------------------
    def touched(self, ino: int) -> None:
        """This node changed a file's data or size: push it at close."""
        self._gen[ino] = self._gen.get(ino, 0) + 1
        if ino not in self.unpublished:
            self.unpublished.add(ino)
            self.local.set_unpublished(ino, True)

    @contextlib.contextmanager
    def changing(self, ino: int):
        """Around a change of a file's data or size that may wait (a write fetching the
        extent it partly overwrites, a full hot tier): touched before it lands, so a
        crash then still pushes the file, and no push meanwhile counts the file as
        published, since what it read did not hold the change yet."""
        self.touched(ino)
        self._changing[ino] = self._changing.get(ino, 0) + 1
        try:
            yield
        finally:
            left = self._changing[ino] - 1
            if left:
                self._changing[ino] = left
            else:
                del self._changing[ino]

    def uploaded(self, inos) -> None:
        """Uploads of these files finished: publish their objects soon."""
        due = [i for i in inos if i in self.unpublished]
        if due:
            self._due.update(due)
            self._wake.set()

    async def run(self) -> None:
        """Push files whose uploads finished (and, first, those the last run left
        unpublished)."""
        self._due.update(self.unpublished)
        failures = 0
        while True:
            while self._due:
                batch = sorted(self._due)[:PUSH_BATCH]
                self._due.difference_update(batch)
                try:
                    await self.push_many(batch)
                except FsError as e:  # the database is away: they stay due
                    self._due.update(batch)
                    failures += 1
                    if failures == 1:
                        log.warning("publishing %d uploaded files failed (%s); will retry",
                                    len(batch), e)
                    await trio.sleep(min(PUSH_RETRY_MAX_S, 0.5 * 2 ** min(failures, 4)))
                    continue
                if failures:
                    log.info("publishing uploaded files works again")
                failures = 0
            await self._wake.wait()
            self._wake = trio.Event()

    # ---- pull and push -------------------------------------------------------------
    def _lock(self, ino: int) -> trio.Lock:
        lock = self._locks.get(ino)
        if lock is None:
            lock = self._locks[ino] = trio.Lock()
        return lock

    async def pull(self, ino: int) -> bool:
        """Make this node's copy of a file the shared one (at open). Returns whether
        the kernel's cached pages and attributes may be older than it, after this
        pull or an earlier one: the caller that drops them calls kernel_told()."""
        if ino in self.unpublished:  # written here since: this copy is the newer one
            return ino in self.stale_in_kernel
        deadline = trio.current_time() + self.wait
        delay = 0.02
        async with self._lock(ino):
            while True:
                node, exts = await self.call(self.shared.file_view, ino)
                held = {e.holder for e in exts.values() if e.dirty and e.holder != self.sid}
                if not held:
                    break
                await self._holders_alive(ino, held)
                if trio.current_time() + delay > deadline:
                    log.error("inode %d: its data is still only on session %s after %gs; "
                              "reads fail with EIO", ino, sorted(held), self.wait)
                    raise FsError(errno.EIO)
                await trio.sleep(delay)  # the holder uploads at its close: look again
                delay = min(delay * 2, 0.5)
            asked = self._new_objects(ino, exts)
            packs = set(await self.call(self.shared.packs_among, sorted(asked))) if asked else set()
            if ino not in self.unpublished and self._take(node, exts, packs, asked):
                self.stale_in_kernel.add(ino)
            return ino in self.stale_in_kernel

    def kernel_told(self, ino: int) -> None:
        """The kernel's cached pages and attributes of a file were dropped."""
        self.stale_in_kernel.discard(ino)

    def _new_objects(self, ino: int, exts) -> set[int]:
        """Objects of published records this node's copy does not hold yet."""
        try:
            local = self.local.get_extents(ino, 0, ALL)[1]
        except FsError:
            local = {}
        return {e.obj_id for idx, e in exts.items()
                if e.obj_id and not (idx in local and local[idx].same_data(e))}

    async def _holders_alive(self, ino: int, holders: set[int]) -> None:
        live = {x.sid for x in await self.call(self.shared.sessions)}
        gone = holders - live
        if gone:
            names = {sid: node for i, sid, _n, node in await self.call(self.shared.held)
                     if i == ino}
            who = ", ".join(f"{names.get(sid, '?')} (session {sid})" for sid in sorted(gone))
            log.error("inode %d has data that was never uploaded by %s, which is gone: "
                      "reading it fails with EIO", ino, who)
            raise FsError(errno.EIO)

    def _take(self, node, exts, packs: set[int], asked: set[int]) -> bool:
        """On the trio thread, without an await: replace the local records. Returns
        whether the kernel may hold pages or attributes of an older version. Objects
        that are packs get a marker here (this node never deletes them); one not
        `asked` about counts as a pack: never deleting it here is the safe side."""
        engine, ino = self.engine, node.ino
        try:
            old, local = self.local.get_extents(ino, 0, ALL)
        except FsError:
            old, local = None, {}
        changed = {}
        for idx in set(local) | set(exts):
            pub, mine = exts.get(idx), local.get(idx)
            if mine is not None and mine.dirty:
                self.touched(ino)  # never let a pull drop data written here
                return False
            if pub is not None and mine is not None and mine.same_data(pub):
                continue
            changed[(ino, idx)] = pub
            if mine is not None and mine.hot:
                engine.forget_hot(ino, idx)
        if not changed and old == node:
            return False  # nothing new: no write, the kernel's caches stay
        taken = {e.obj_id for e in changed.values() if e is not None and e.obj_id}
        self.local.take_view(node, changed, sorted(packs | (taken - asked)))
        # A file this node never held has no pages here, but the kernel may hold
        # attributes from a lookup made before its writer closed it (the change feed
        # that would drop them can come later): they go too.
        return old is None or bool(changed) or \
            (old.size, old.mtime_ns) != (node.size, node.mtime_ns)

    async def push(self, ino: int) -> None:
        """Publish this node's copy of a file (at close, fsync, truncate)."""
        await self.push_many([ino])

    async def push_many(self, inos) -> None:
        """Publish files in one transaction (after uploads: one commit for many)."""
        inos = sorted({i for i in inos if i in self.unpublished})
        if not inos:
            return
        async with contextlib.AsyncExitStack() as held_locks:
            for ino in inos:  # in order: two pushes never wait for each other's locks
                await held_locks.enter_async_context(self._lock(ino))
            snaps = [snap for snap in map(self._snapshot, inos) if snap is not None]
            if not snaps:
                return
            try:
                alive = await self.call(self.shared.publish, [p for _g, _d, p in snaps],
                                        self.sid, self.node)
            except FsError:
                # The database is away: run() publishes them once it is back, not only
                # this node's next close, upload or mount.
                self._due.update(p.ino for _g, _d, p in snaps)
                self._wake.set()
                raise
            for (gen, dirty, pub), ok in zip(snaps, alive):
                if ok:  # named by shared records now: the shared gc's to delete
                    self.local.private_objects.difference_update(
                        e.obj_id for e in pub.extents.values())
                if not ok:
                    self.forget(pub.ino)
                elif dirty:
                    self.hurry(pub.ino)
                elif (gen is not None and self._gen.get(pub.ino, 0) == gen
                      and pub.ino not in self._changing):
                    self.unpublished.discard(pub.ino)
                    self._gen.pop(pub.ino, None)
                    self.local.set_unpublished(pub.ino, False)
                    self.published += 1
                    self._published_recent.append((self.published, pub.ino))

    def _snapshot(self, ino: int):
        """(write generation, dirty?, what to publish) of a file, None if gone here.
        The generation is None while a change of the file is landing (changing()):
        what was read may not hold it yet, so this push must not count the file as
        published, even if the change ends before the database answers."""
        if ino not in self.unpublished:
            return None  # pushed while this push waited for its lock
        try:
            node, exts = self.local.get_extents(ino, 0, ALL)
        except FsError:
            return None
        sizes = self.engine.index.sizes
        held = sum(sizes.get((ino, idx), 0) for idx, e in exts.items() if e.dirty)
        pub = Published(ino, node.size, node.mtime_ns, node.ctime_ns,
                        {idx: e.published(self.sid) for idx, e in exts.items()}, held)
        gen = None if ino in self._changing else self._gen.get(ino, 0)
        return gen, any(e.dirty for e in exts.values()), pub

    async def push_all(self) -> None:
        for ino in sorted(self.unpublished):
            await self.push(ino)

    async def checkpoint(self) -> None:
        """What `sync --wait` makes durable besides the data: every file's records."""
        await self.push_all()

    def forget(self, ino: int) -> None:
        """The shared namespace purged a file: so does this node."""
        self.unpublished.discard(ino)
        self.stale_in_kernel.discard(ino)
        self._gen.pop(ino, None)
        self._locks.pop(ino, None)
        self.engine.drop_inode(ino)
        try:
            self.local.purge(ino)
        except FsError:
            pass

    def created(self, node) -> None:
        """A file made here: this node's copy starts as the shared record."""
        self.local.take_view(node, {}, ())

    def newer_here(self, ino: int, since: int) -> bool:
        """Whether this node's copy of a file is at least as new as a shared record
        read after `since` (the value of `published` before the read): it holds
        changes not published yet, or published them since, maybe after the read
        (a getattr that read the database while a push committed must not answer
        the size from before this node's writes: the kernel would take it)."""
        if ino in self.unpublished:
            return True
        if self.published == since:
            return False
        recent = self._published_recent
        if not recent or recent[0][0] > since + 1:
            return True  # forgotten already: assume it was
        for n, done in reversed(recent):
            if n <= since:
                return False
            if done == ino:
                return True
        return False

    def local_attrs(self, node, since: int):
        """A file's attributes as this node has them: its own size and times if its
        copy is newer than the shared record `node`, read after `since` (a value of
        `published`)."""
        if not self.newer_here(node.ino, since):
            return node
        try:
            mine = self.local.get_inode(node.ino)
        except FsError:
            return node
        return replace(node, size=mine.size, mtime_ns=mine.mtime_ns,
                       ctime_ns=max(node.ctime_ns, mine.ctime_ns))
