"""The FUSE adapter when the namespace is shared by many nodes (--meta-url).

Namespace requests await the shared engine in worker threads (a database round
trip must not stop the trio loop); file data stays with the engine on this node's
own LMDB, which SharedView keeps in step: pulled at open, pushed at every close
(flush), fsync and truncate. That is close-to-open consistency: once close() or
fsync() returned on one node, an open() on any other sees the new size and data.
"""
from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time

import pyfuse3
import trio

from ..errors import FsError
from ..tier.engine import kill_suid
from .ops import CAPABILITY_XATTR, Operations, _guard, attr_change
from .recent_changes import RecentChanges

log = logging.getLogger(__name__)

STATFS_WAIT_S = 1.0  # longest statfs waits for the database's file count


class SharedOperations(Operations):
    def __init__(self, shared, view, engine, **kwargs):
        super().__init__(view.local, engine, **kwargs)
        self.ns = shared
        self.view = view
        self.call = self._names = view.call
        self.capabilities_exist = shared.xattr_name_exists(CAPABILITY_XATTR)
        # Inodes this node's unlink, rmdir or rename may have left as orphans (no name,
        # open here): only those need the database's purge when the kernel lets go.
        # Every other forget, thousands after a cache drop, costs nothing.
        self.maybe_orphans: set[int] = set()
        self._files = 0  # the namespace's file count as last counted (statfs)
        self._counted: trio.Event | None = None  # set when the count asked for is in
        self.changes = RecentChanges()  # the change feed's, told by the runtime
        # (size, mtime) of each inode as last answered to the kernel for it to cache:
        # an open that pulled those very attributes need not have the kernel drop them.
        self.answered: dict[int, tuple[int, int]] = {}
        # The names the kernel was given for each inode it holds: when the change feed
        # lost notifications ("everything"), those names go as well as the attributes.
        # Tuples are replaced, never changed: the feed's thread reads them.
        self.names: dict[int, tuple[tuple[int, bytes], ...]] = {}
        # Inodes the change feed named (another node changed them), for forget_purged():
        # if one is gone from the namespace, this node's copy of it goes too. Filled by
        # the feed's thread, under the lock.
        self._elsewhere: set[int] = set()
        self._elsewhere_lock = threading.Lock()
        self._elsewhere_told = trio.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self.purged_elsewhere: set[int] = set()  # still in use here: dropped at release

    def _answer(self, seq: int, entry: pyfuse3.EntryAttributes,
                name: tuple[int, bytes] | None = None, note: bool = True
                ) -> pyfuse3.EntryAttributes:
        """Count an entry as looked up, then, if the change feed named it since `seq`
        (taken before the database read), let the kernel cache none of it: that
        notification's invalidation found nothing in the kernel to drop. Counted
        first, so a notification after this check finds the inode and invalidates.
        `note`: the answer surely reaches the kernel (see `answered`)."""
        self._looked_up(entry.st_ino)
        if name is not None and name not in self.names.get(entry.st_ino, ()):
            self.names[entry.st_ino] = self.names.get(entry.st_ino, ()) + (name,)
        if self.changes.since(seq, entry.st_ino, name):
            entry.entry_timeout = entry.attr_timeout = 0
            self.answered.pop(entry.st_ino, None)
        elif note:
            self._note_answer(entry)
        else:
            self.answered.pop(entry.st_ino, None)
        return entry

    def _note_answer(self, entry: pyfuse3.EntryAttributes) -> None:
        self.answered[entry.st_ino] = (entry.st_size, entry.st_mtime_ns)

    def _unlooked(self, ino: int, n: int = 1) -> bool:
        gone = super()._unlooked(ino, n)
        if gone:
            self.names.pop(ino, None)
        return gone

    def held_names(self) -> set[tuple[int, bytes]]:
        """Every (directory, name) the kernel may hold (called from the feed's thread)."""
        return {name for names in list(self.names.values()) for name in names}

    # ---- attributes ---------------------------------------------------------------
    def _shared_entry(self, found, since: int) -> pyfuse3.EntryAttributes:
        """The entry of a shared record read after `since` (view.published before
        the read): with this node's size and blocks where its copy is newer."""
        node, blocks = found
        mine = self.view.local_attrs(node, since)  # `node` itself if that is current
        return self._entry(node, blocks) if mine is node else self._entry(mine)

    @_guard
    async def lookup(self, parent_inode, name, ctx):
        seq, since = self.changes.seq, self.view.published
        found = await self.call(self.ns.attrs, parent_inode, self.engine.E, name)
        return self._answer(seq, self._shared_entry(found, since), (parent_inode, name))

    @_guard
    async def getattr(self, inode, ctx):
        since = self.view.published
        entry = self._shared_entry(await self.call(self.ns.attrs, inode, self.engine.E), since)
        self._note_answer(entry)
        return entry

    @_guard
    async def setattr(self, inode, attr, fields, fh, ctx):
        self.state.check_writable()
        self.answered.pop(inode, None)  # the kernel takes what this answers, or not
        since = self.view.published
        if fields.update_size:
            node = await self.call(self.ns.get_inode, inode)
            if stat.S_ISDIR(node.mode):
                raise FsError(errno.EISDIR)
            if not stat.S_ISREG(node.mode):
                raise FsError(errno.EINVAL)
            await self.view.pull(inode)
            with self.view.changing(inode):
                if attr.st_size != self.meta.get_inode(inode).size:
                    await self.engine.truncate(inode, attr.st_size)
        change = attr_change(attr, fields, ctx.uid, time.time_ns())
        node = await self.call(self.ns.modify_inode, inode, change)
        self._change_local(inode, change)
        if fields.update_size or fields.update_mtime:
            await self.view.push(inode)
        # The kernel takes this size as it is: this node's, if it wrote the file.
        return self._entry(self.view.local_attrs(node, since))

    async def _fresh(self, ino: int) -> None:
        await self.view.pull(ino)  # the state of this node's copy, made current

    def _change_local(self, ino: int, change) -> None:
        try:
            self.meta.modify_inode(ino, change)
        except FsError:
            pass  # this node holds no copy of it

    # ---- namespace ------------------------------------------------------------------
    async def _create_shared(self, parent, name, mode, ctx, rdev=0, target=None):
        """The new node and its entry for the kernel, counted as looked up."""
        self.state.check_writable()
        seq = self.changes.seq
        node = await self.call(self.ns.create_node, parent, name, mode, ctx.uid, ctx.gid,
                               rdev, target)
        if stat.S_ISREG(node.mode):
            self.view.created(node)
        blocks = None if stat.S_ISLNK(node.mode) else 0
        return node, self._answer(seq, self._entry(node, blocks), (parent, name))

    @_guard
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        return (await self._create_shared(parent_inode, name, mode, ctx, rdev))[1]

    @_guard
    async def mkdir(self, parent_inode, name, mode, ctx):
        return (await self._create_shared(parent_inode, name,
                                          stat.S_IFDIR | stat.S_IMODE(mode), ctx))[1]

    @_guard
    async def symlink(self, parent_inode, name, target, ctx):
        if len(target) > 4095:
            raise FsError(errno.ENAMETOOLONG)
        return (await self._create_shared(parent_inode, name, stat.S_IFLNK | 0o777, ctx,
                                          target=target))[1]

    @_guard
    async def link(self, inode, new_parent_inode, new_name, ctx):
        self.state.check_writable()
        seq, since = self.changes.seq, self.view.published
        await self.call(self.ns.link, inode, new_parent_inode, new_name)
        found = await self.call(self.ns.attrs, inode, self.engine.E)
        return self._answer(seq, self._shared_entry(found, since),
                            (new_parent_inode, new_name))

    def _gone(self, ino: int | None, purged: bool) -> None:
        if ino is None:
            return
        if purged:
            self.view.forget(ino)
        else:  # an orphan if it lost its last name while open here
            self.maybe_orphans.add(ino)

    @_guard
    async def unlink(self, parent_inode, name, ctx):
        self.state.check_writable()
        self._gone(*await self.call(self.ns.unlink, parent_inode, name, self._in_use))

    @_guard
    async def rmdir(self, parent_inode, name, ctx):
        self.state.check_writable()
        self._gone(*await self.call(self.ns.rmdir, parent_inode, name, self._in_use))

    @_guard
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        self.state.check_writable()
        self._gone(*await self.call(
            self.ns.rename, parent_inode_old, name_old, parent_inode_new, name_new, flags,
            self._in_use, pyfuse3.RENAME_NOREPLACE, pyfuse3.RENAME_EXCHANGE))

    async def _maybe_purge(self, ino: int) -> None:
        if self._in_use(ino):
            return
        self.view.kernel_told(ino)  # the kernel let go: it caches nothing of it
        self.answered.pop(ino, None)
        if ino in self.purged_elsewhere:
            self.purged_elsewhere.discard(ino)
            self.maybe_orphans.discard(ino)
            if ino not in self.view.unpublished:
                self.view.forget(ino)
            return
        if ino in self.maybe_orphans:
            self.maybe_orphans.discard(ino)
            try:
                if await self.call(self.ns.purge_orphan, ino):
                    self.view.forget(ino)
            except FsError as e:  # the database is away: the session's end purges it
                log.warning("could not purge unlinked inode %d (%s); it goes when this "
                            "mount's session ends", ino, e)

    # ---- files other nodes purged -------------------------------------------------
    def changed_elsewhere(self, inodes) -> None:
        """The change feed's thread: other nodes changed these inodes."""
        with self._elsewhere_lock:
            self._elsewhere.update(inodes)
        if self._token is not None:
            try:
                self._token.run_sync_soon(lambda: self._elsewhere_told.set())
            except trio.RunFinishedError:
                pass  # the daemon is ending: nothing left to forget

    async def forget_purged(self) -> None:
        """Drop this node's records and hot copies of files another node purged (the
        feed named them; the namespace no longer has them), at once or, if this node
        still uses one, when it lets go. Only inodes this node holds a copy of cost a
        database read."""
        self._token = trio.lowlevel.current_trio_token()
        while True:
            await self._elsewhere_told.wait()
            self._elsewhere_told = trio.Event()
            with self._elsewhere_lock:
                inos, self._elsewhere = self._elsewhere, set()
            held = sorted(i for i in inos if self._holds_copy(i))
            if not held:
                continue
            try:
                alive = await self.call(self.ns.existing, held)
            except FsError:
                continue  # the database is away: the copies stay (they are only space)
            for ino in held:
                if ino in alive or ino in self.view.unpublished:
                    continue  # a push of this node's change finds it gone and forgets it
                if self._in_use(ino):
                    self.purged_elsewhere.add(ino)
                else:
                    self.view.forget(ino)

    def _holds_copy(self, ino: int) -> bool:
        try:
            self.meta.get_inode(ino)
        except FsError:
            return False
        return True

    # ---- files ----------------------------------------------------------------------
    @_guard
    async def open(self, inode, flags, ctx):
        if flags & os.O_ACCMODE != os.O_RDONLY:
            self.state.check_writable()
        changed = await self.view.pull(inode)
        if flags & os.O_TRUNC:
            with self.view.changing(inode):
                if self.meta.get_inode(inode).size:
                    await self.engine.truncate(inode, 0)
            t = time.time_ns()
            uid = ctx.uid

            def change(node) -> None:
                node.size = 0
                node.mtime_ns = node.ctime_ns = t
                if uid != 0:
                    node.mode = kill_suid(node.mode)

            await self.call(self.ns.modify_inode, inode, change)
            self._change_local(inode, change)
            await self.view.push(inode)
        else:
            self.engine.opened(inode)
        if changed:  # another node changed it: the kernel's size and times may be old
            self.view.kernel_told(inode)  # before: a pull meanwhile marks it again
            node = self.meta.get_inode(inode)
            if self.answered.get(inode) != (node.size, node.mtime_ns):
                # Not what the kernel was last told (a lookup before the writer's
                # close): they go. A lookup just before this open told it these.
                self.answered.pop(inode, None)
                await trio.to_thread.run_sync(self._invalidate_attrs, inode)
        return pyfuse3.FileInfo(fh=self._new_fh(inode, flags), keep_cache=not changed)

    @staticmethod
    def _invalidate_attrs(ino: int) -> None:
        try:
            pyfuse3.invalidate_inode(ino, attr_only=True)
        except OSError:
            pass  # the kernel does not hold it

    @_guard
    async def create(self, parent_inode, name, mode, flags, ctx):
        try:
            node, entry = await self._create_shared(parent_inode, name,
                                                    stat.S_IFREG | stat.S_IMODE(mode), ctx)
        except FsError as e:
            if e.errno == errno.EEXIST and not flags & os.O_EXCL:
                # Another node made the name since the kernel looked it up. POSIX
                # opens the file there is: ESTALE makes the kernel walk the path
                # again, afresh, and open what it finds (with its own permission
                # checks and O_TRUNC), once.
                raise FsError(errno.ESTALE) from None
            raise
        fh = self._new_fh(node.ino, flags)
        return pyfuse3.FileInfo(fh=fh, keep_cache=True), entry

    @_guard
    async def write(self, fh, off, buf):
        ino = self.handles[fh].ino
        with self.view.changing(ino):
            return await self.engine.write(ino, off, buf)

    @_guard
    async def flush(self, fh):
        # Every close(): what this node wrote becomes visible to every other node's
        # next open (close-to-open), at the cost of one round trip per written file.
        await self.view.push(self.handles[fh].ino)

    @_guard
    async def fsync(self, fh, datasync):
        self.state.check_durable()
        ino = self.handles[fh].ino
        await self.engine.fsync(ino)
        await self.view.push(ino)

    # ---- directories -------------------------------------------------------------
    @_guard
    async def readdir(self, fh, start_id, token):
        ino = self.handles[fh].ino
        after = start_id
        while True:
            seq, since = self.changes.seq, self.view.published
            node, parent, batch = await self.call(self.ns.readdir_plus, ino, after, 256,
                                                  self.engine.E)
            if after < 1:
                if not pyfuse3.readdir_reply(token, b".", self._entry(node, 0), 1):
                    return
                after = 1
            if after < 2:
                if not pyfuse3.readdir_reply(token, b"..", self._entry(parent, 0), 2):
                    return
                after = 2
            if not batch:
                return
            for cookie, name, found in batch:
                # Counted before the reply: the kernel holds the entry once it is in.
                entry = self._answer(seq, self._shared_entry(found, since), (ino, name),
                                     False)
                if not pyfuse3.readdir_reply(token, name, entry, cookie):
                    self._unlooked(entry.st_ino)  # not sent: the kernel never had it
                    return
                after = cookie

    @_guard
    async def fsyncdir(self, fh, datasync):
        self.state.check_durable()  # the shared engine commits durably: nothing to do

    @_guard
    async def statfs(self, ctx):
        """The hot tier's space, and the namespace's file count as the database gives
        it within STATFS_WAIT_S, else as it last gave it: `df`, and the check of
        `tierfs mount` and `tierfs umount` that a mount answers, keep working while
        the database is away. One count at a time is asked for."""
        out = await super().statfs(ctx)
        if self._counted is None:
            self._counted = trio.Event()
            # A task of its own: a statfs that stops waiting leaves the count running.
            trio.lowlevel.spawn_system_task(self._count_files, self._counted)
        with trio.move_on_after(STATFS_WAIT_S):
            await self._counted.wait()
        out.f_files = self._files + (1 << 32)
        return out

    async def _count_files(self, counted: trio.Event) -> None:
        try:
            self._files = await self.call(self.ns.inode_count)
        except FsError:
            pass  # the database is away: the last count stands
        except Exception:  # a system task's error would end the mount
            log.exception("counting the namespace's files failed")
        finally:
            counted.set()
            self._counted = None
