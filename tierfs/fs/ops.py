"""pyfuse3 adapter: the only place that speaks FUSE and raises FUSEError.

Keeps the kernel-facing state (lookup counts, open file handles) and turns
every domain error into an errno once. Namespace changes go straight to the
metadata store; file data goes through the tiering engine.
"""
from __future__ import annotations

import errno
import functools
import logging
import os
import stat
import time

import pyfuse3
import trio

from ..errors import FsError, TierfsError
from ..meta import MetaStore
from ..meta.schema import Inode
from ..tier.engine import Engine, kill_suid

log = logging.getLogger(__name__)

BLKSIZE = 128 * 1024
CONTROL_XATTR = b"user.tierfs.control"
STATE_XATTR = b"user.tierfs.state"
CAPABILITY_XATTR = b"security.capability"
# Namespaces tierfs does not implement: POSIX ACLs (access is checked on mode bits by the
# kernel's default_permissions; a stored ACL would not be enforced) and security labels
# other than file capabilities. EOPNOTSUPP says so, and lets `ls -l` stop asking: coreutils
# remembers it per filesystem instead of sending two xattr requests per entry.
UNSUPPORTED_XATTRS = (b"system.", b"security.")


def _unsupported(name: bytes) -> bool:
    return name.startswith(UNSUPPORTED_XATTRS) and name != CAPABILITY_XATTR


def _guard(fn):
    """Map domain errors to FUSEError; anything unexpected is logged once and
    becomes EIO, because an exception escaping a handler kills the mount."""
    op = fn.__name__

    @functools.wraps(fn)
    async def wrapper(self, *args):
        t0 = time.perf_counter()
        try:
            return await fn(self, *args)
        except pyfuse3.FUSEError:
            raise
        except FsError as e:
            raise pyfuse3.FUSEError(e.errno) from None
        except TierfsError as e:
            log.error("%s failed: %s", fn.__name__, e)
            raise pyfuse3.FUSEError(e.errno) from None
        except OSError as e:
            log.error("%s failed: %s", fn.__name__, e)
            raise pyfuse3.FUSEError(e.errno or errno.EIO) from None
        except Exception:
            log.exception("unexpected error in %s", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None
        finally:
            self.stats.observe("fuse_op_seconds", op, time.perf_counter() - t0)
    return wrapper


def attr_change(attr, fields, uid: int, t: int):
    """What a setattr request does to an inode record (the size itself is the
    engine's truncate), as a function that only assigns: a retried transaction
    may apply it twice."""
    def change(node: Inode) -> None:
        if fields.update_size:
            node.size = attr.st_size
            node.mtime_ns = t
            if uid != 0:
                node.mode = kill_suid(node.mode)
        if fields.update_mode:
            node.mode = stat.S_IFMT(node.mode) | stat.S_IMODE(attr.st_mode)
        if fields.update_uid or fields.update_gid:
            if fields.update_uid:
                node.uid = attr.st_uid
            if fields.update_gid:
                node.gid = attr.st_gid
            if not stat.S_ISDIR(node.mode) and not fields.update_mode:
                node.mode = kill_suid(node.mode)
        if fields.update_atime:
            node.atime_ns = attr.st_atime_ns
        if fields.update_mtime:
            node.mtime_ns = attr.st_mtime_ns
        node.ctime_ns = attr.st_ctime_ns if fields.update_ctime else t
    return change


class Handle:
    __slots__ = ("ino", "flags")

    def __init__(self, ino: int, flags: int):
        self.ino = ino
        self.flags = flags


class Operations(pyfuse3.Operations):
    enable_writeback_cache = True
    # False answers every xattr request with ENOSYS, which the kernel remembers for the
    # connection: no more xattr round trips (one before each write, two per `ls -l` entry).
    xattrs = True

    def __init__(self, meta: MetaStore, engine: Engine, *, timeout: float = 60.0,
                 control=None):
        super().__init__()
        self.meta = meta
        self.ns = meta  # the namespace's store: the same one on a single node
        self.engine = engine
        self.state = engine.state  # fenced: every change is refused (EROFS)
        self.timeout = timeout
        self.control = control  # answers the user.tierfs.* virtual xattrs
        self.stats = engine.stats
        self.capabilities_exist = meta.xattr_name_exists(CAPABILITY_XATTR)
        self.lookups: dict[int, int] = {}
        self.open_count: dict[int, int] = {}
        self.handles: dict[int, Handle] = {}
        self._next_fh = 1

    # ---- helpers ------------------------------------------------------------------
    def _entry(self, node: Inode, blocks: int | None = None) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino = node.ino
        e.generation = node.generation
        e.entry_timeout = self.timeout
        e.attr_timeout = self.timeout
        e.st_mode = node.mode
        e.st_nlink = node.nlink
        e.st_uid = node.uid
        e.st_gid = node.gid
        e.st_rdev = node.rdev
        e.st_size = node.size
        e.st_blksize = BLKSIZE
        e.st_blocks = self._blocks(node) if blocks is None else blocks
        e.st_atime_ns = node.atime_ns
        e.st_mtime_ns = node.mtime_ns
        e.st_ctime_ns = node.ctime_ns
        return e

    def _blocks(self, node: Inode) -> int:
        return self.meta.blocks(node, self.engine.E)

    def _looked_up(self, ino: int, n: int = 1) -> None:
        self.lookups[ino] = self.lookups.get(ino, 0) + n

    def _in_use(self, ino: int) -> bool:
        return ino in self.lookups or ino in self.open_count

    async def _maybe_purge(self, ino: int) -> None:
        """Purge an unlinked inode nothing uses any more: a huge file in parts, with
        a checkpoint between them, so that other requests are served meanwhile."""
        while not self._in_use(ino):
            purged = self.meta.purge_orphan(ino, self.meta.purge_batch)
            if purged is not None:
                if purged:
                    self.engine.drop_inode(ino)
                return
            await trio.sleep(0)

    async def _after_unlink(self, ino: int | None, purged: bool) -> None:
        if ino is None:
            return
        if purged:
            self.engine.drop_inode(ino)
        elif not self._in_use(ino) and self.meta.is_orphan(ino):
            await self._maybe_purge(ino)  # too big to purge in one transaction

    def _new_fh(self, ino: int, flags: int) -> int:
        fh = self._next_fh
        self._next_fh += 1
        self.handles[fh] = Handle(ino, flags)
        self.open_count[ino] = self.open_count.get(ino, 0) + 1
        return fh

    # ---- lookups --------------------------------------------------------------------
    @_guard
    async def lookup(self, parent_inode, name, ctx):
        ino = self.meta.lookup(parent_inode, name)
        node = self.meta.get_inode(ino)
        # Every successful lookup counts, "." and ".." included: the kernel sends
        # those only for exported (NFS) handles and forgets them like any other.
        self._looked_up(ino)
        return self._entry(node)

    def _unlooked(self, ino: int, n: int = 1) -> bool:
        """Take back n lookups of an inode; whether the kernel holds it no more."""
        left = self.lookups.get(ino, 0) - n
        if left > 0:
            self.lookups[ino] = left
            return False
        self.lookups.pop(ino, None)
        return True

    async def forget(self, inode_list):
        for ino, n in inode_list:
            # Each on its own: one purge that fails must not leave the counts of the
            # rest of the batch standing (those inodes would never be purged).
            try:
                if self._unlooked(ino, n):
                    await self._maybe_purge(ino)
            except Exception:
                log.exception("forget of inode %d failed", ino)

    @_guard
    async def getattr(self, inode, ctx):
        return self._entry(self.meta.get_inode(inode))

    @_guard
    async def setattr(self, inode, attr, fields, fh, ctx):
        self.state.check_writable()
        if fields.update_size:
            self._settle_direct_writes(inode)
            node = self.meta.get_inode(inode)
            if stat.S_ISDIR(node.mode):
                raise FsError(errno.EISDIR)
            if not stat.S_ISREG(node.mode):
                raise FsError(errno.EINVAL)
            if attr.st_size != node.size:
                await self.engine.truncate(inode, attr.st_size)
            elif not (fields.update_mtime or fields.update_ctime):
                pass  # truncate to the same size still updates times below
        node = self.meta.get_inode(inode)
        attr_change(attr, fields, ctx.uid, time.time_ns())(node)
        self.meta.put_inode(node)
        return self._entry(node)

    def _settle_direct_writes(self, inode: int) -> None:
        """What direct writers wrote so far is the file's, as a write() is: a truncate
        compares with, and cuts, a size that includes it."""
        if self.engine.index.held:
            self.engine.settle_held(inode)

    @_guard
    async def readlink(self, inode, ctx):
        return await self._names(self.ns.readlink, inode)

    # ---- namespace --------------------------------------------------------------------
    def _create(self, parent, name, mode, ctx, rdev=0, target=None):
        self.state.check_writable()
        node = self.meta.create_node(parent, name, mode, ctx.uid, ctx.gid, rdev, target)
        self._looked_up(node.ino)
        return node

    @_guard
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        return self._entry(self._create(parent_inode, name, mode, ctx, rdev))

    @_guard
    async def mkdir(self, parent_inode, name, mode, ctx):
        return self._entry(self._create(parent_inode, name, stat.S_IFDIR | stat.S_IMODE(mode), ctx))

    @_guard
    async def symlink(self, parent_inode, name, target, ctx):
        if len(target) > 4095:
            raise FsError(errno.ENAMETOOLONG)
        return self._entry(self._create(parent_inode, name, stat.S_IFLNK | 0o777, ctx,
                                        target=target))

    @_guard
    async def link(self, inode, new_parent_inode, new_name, ctx):
        self.state.check_writable()
        node = self.meta.link(inode, new_parent_inode, new_name)
        self._looked_up(inode)
        return self._entry(node)

    @_guard
    async def unlink(self, parent_inode, name, ctx):
        self.state.check_writable()
        await self._after_unlink(*self.meta.unlink(parent_inode, name, self._in_use))

    @_guard
    async def rmdir(self, parent_inode, name, ctx):
        self.state.check_writable()
        await self._after_unlink(*self.meta.rmdir(parent_inode, name, self._in_use))

    @_guard
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        self.state.check_writable()
        await self._after_unlink(*self.meta.rename(
            parent_inode_old, name_old, parent_inode_new, name_new, flags, self._in_use,
            pyfuse3.RENAME_NOREPLACE, pyfuse3.RENAME_EXCHANGE))

    # ---- files -------------------------------------------------------------------------
    @_guard
    async def open(self, inode, flags, ctx):
        # The kernel sends directories to opendir, so a plain open needs no
        # metadata read: this is the hottest request of small-file workloads.
        if flags & os.O_ACCMODE != os.O_RDONLY:
            self.state.check_writable()  # as on a read-only mount: refused at open
        if flags & os.O_TRUNC:
            self._settle_direct_writes(inode)
            node = self.meta.get_inode(inode)
            # The kernel leaves O_TRUNC to us (atomic_o_trunc), so do what a
            # truncate() through setattr does: new mtime/ctime even if the file
            # was already empty (POSIX), and a non-root caller loses setuid/setgid.
            if node.size:
                await self.engine.truncate(inode, 0)
            node = self.meta.get_inode(inode)
            node.mtime_ns = node.ctime_ns = time.time_ns()
            if ctx.uid != 0:
                node.mode = kill_suid(node.mode)
            self.meta.put_inode(node)
        else:
            self.engine.opened(inode)
        return pyfuse3.FileInfo(fh=self._new_fh(inode, flags), keep_cache=True)

    @_guard
    async def create(self, parent_inode, name, mode, flags, ctx):
        node = self._create(parent_inode, name, stat.S_IFREG | stat.S_IMODE(mode), ctx)
        fh = self._new_fh(node.ino, flags)
        return pyfuse3.FileInfo(fh=fh, keep_cache=True), self._entry(node)

    @_guard
    async def read(self, fh, off, size):
        return await self.engine.read(self.handles[fh].ino, off, size)

    @_guard
    async def write(self, fh, off, buf):
        return await self.engine.write(self.handles[fh].ino, off, buf)

    @_guard
    async def flush(self, fh):
        # Nothing to do at close (data is written through; fsync is separate).
        # ENOSYS tells the kernel to stop sending FLUSH at all: one round trip
        # less per close. It still writes back its cached pages before close.
        raise FsError(errno.ENOSYS)

    @_guard
    async def fsync(self, fh, datasync):
        self.state.check_durable()
        await self.engine.fsync(self.handles[fh].ino)

    async def release(self, fh):
        # Not under _guard: release must never fail, the handle is gone either way.
        t0 = time.perf_counter()
        try:
            handle = self.handles.pop(fh)
            left = self.open_count[handle.ino] - 1
            if left:
                self.open_count[handle.ino] = left
            else:
                del self.open_count[handle.ino]
                await self._maybe_purge(handle.ino)
        except Exception:
            log.exception("release failed")
        self.stats.observe("fuse_op_seconds", "release", time.perf_counter() - t0)

    # ---- directories -------------------------------------------------------------------
    @_guard
    async def opendir(self, inode, ctx):
        node = await self._names(self.ns.get_inode, inode)
        if not stat.S_ISDIR(node.mode):
            raise FsError(errno.ENOTDIR)
        return self._new_fh(inode, 0)

    @_guard
    async def readdir(self, fh, start_id, token):
        ino = self.handles[fh].ino
        node = self.meta.get_inode(ino)
        if start_id < 1:
            if not pyfuse3.readdir_reply(token, b".", self._entry(node), 1):
                return
        if start_id < 2:
            parent = self.meta.get_inode(node.parent or ino)
            if not pyfuse3.readdir_reply(token, b"..", self._entry(parent), 2):
                return
        after = start_id
        while True:
            batch = self.meta.readdir(ino, after, 256)
            if not batch:
                return
            children = self.meta.get_inodes(child for _c, _n, child in batch)
            for (cookie, name, _child), child in zip(batch, children):
                if not pyfuse3.readdir_reply(token, name, self._entry(child), cookie):
                    return
                self._looked_up(child.ino)
                after = cookie

    async def releasedir(self, fh):
        await self.release(fh)

    @_guard
    async def fsyncdir(self, fh, datasync):
        self.state.check_durable()
        await trio.to_thread.run_sync(self.meta.sync)

    @_guard
    async def statfs(self, ctx):
        st = self.engine.hot.disk_usage()
        out = pyfuse3.StatvfsData()
        out.f_bsize = BLKSIZE
        out.f_frsize = st.f_frsize
        out.f_blocks = st.f_blocks
        out.f_bfree = st.f_bfree
        out.f_bavail = st.f_bavail
        used = self.meta.inode_count()
        out.f_files = used + (1 << 32)
        out.f_ffree = out.f_favail = 1 << 32
        out.f_namemax = 255
        return out

    # ---- xattrs --------------------------------------------------------------------------
    def _check_xattrs(self) -> None:
        if not self.xattrs:
            raise FsError(errno.ENOSYS)

    async def _names(self, fn, *args):
        """A call of the namespace's store: inline here (LMDB at page-cache speed); a
        shared namespace's adapter awaits it in a worker thread."""
        return fn(*args)

    async def _fresh(self, ino: int) -> None:
        """Before answering this node's tiering state of a file (shared: pull it)."""

    @_guard
    async def setxattr(self, inode, name, value, ctx):
        self._check_xattrs()
        if _unsupported(name):
            raise FsError(errno.EOPNOTSUPP)
        if name.startswith(b"user.tierfs."):
            raise FsError(errno.EPERM)
        self.state.check_writable()
        await self._names(self.ns.set_xattr, inode, name, value)
        if name == CAPABILITY_XATTR:
            self.capabilities_exist = True

    @_guard
    async def getxattr(self, inode, name, ctx):
        self._check_xattrs()
        if name == CAPABILITY_XATTR and not self.capabilities_exist:
            # The kernel asks this before every write; answer without a lookup.
            raise FsError(pyfuse3.ENOATTR)
        if _unsupported(name):
            raise FsError(errno.EOPNOTSUPP)
        if name.startswith(b"user.tierfs.") and self.control is not None:
            if name != CONTROL_XATTR:  # which daemon this is: no file state involved
                await self._fresh(inode)
            value = self.control.virtual_xattr(inode, name)
            if value is not None:
                return value
        value = await self._names(self._get_xattr, inode, name)
        if value is None:
            raise FsError(pyfuse3.ENOATTR)
        return value

    def _get_xattr(self, inode: int, name: bytes) -> bytes | None:
        value = self.ns.get_xattr(inode, name)
        if value is None:
            self.ns.get_inode(inode)  # ENOENT beats ENODATA
        return value

    @_guard
    async def listxattr(self, inode, ctx):
        self._check_xattrs()
        names = await self._names(self.ns.list_xattrs, inode)
        return [n for n in names if not _unsupported(n)]

    @_guard
    async def removexattr(self, inode, name, ctx):
        self._check_xattrs()
        if _unsupported(name):
            raise FsError(errno.EOPNOTSUPP)
        self.state.check_writable()
        await self._names(self.ns.remove_xattr, inode, name)
