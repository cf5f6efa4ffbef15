"""The metadata store: namespace, attributes, extent maps, xattrs, the object
table and the gc queue, as semantic operations over an ordered key-value engine
(kv.py: LMDB on one node, PostgreSQL shared by many).

Every public method runs in its own short transaction and never awaits. Writes
go through `_transaction`, which lets the engine run the whole method again
when the attempt may be retried (a grown LMDB map, a PostgreSQL serialization
failure), so a method's body must be safe to run twice. Errors are FsError with
the errno the kernel should see.
"""
from __future__ import annotations

import errno
import functools
import itertools
import os
import stat
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from ..errors import FsError, SessionLost
from . import schema as s
from .kv import is_postgres_url, prefix_end
from .lmdb_kv import DEFAULT_MAP_SIZE, MAX_MAP_SIZE, LmdbKV
from .schema import Extent, Inode, Pack, Ref, Session, Superblock

NAME_MAX = 255
ID_BLOCK = 1024  # inode and object ids a node of a shared engine takes at a time
# Extent records one transaction of a purge deletes (about 10 ms of LMDB work): a
# huge file's purge goes in parts, so the requests waiting on the event loop get in.
PURGE_BATCH = 4096
# Files with at least this many extent records have their count kept in memory for
# st_blocks (MetaStore.blocks): a stat of a 1 TiB file no longer reads 262,144 keys.
COUNTED_RECORDS = 64


def _transaction(method):
    """A write: the engine may run it again (see the module's doc)."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return self.kv.run(method, self, *args, **kwargs)
        finally:
            if self._recount:
                self._forget_counts()
    return wrapper


_READS: list[str] = []  # names of the methods below marked @_reads


def _reads(method):
    """A read: an engine that can fail a read for a while (a database server
    restarting) runs it again. On LMDB the store binds the undecorated method
    instead (MetaStore.__init__), so the hot path pays for no wrapper."""
    _READS.append(method.__name__)

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        return self.kv.run(method, self, *args, **kwargs)
    return wrapper


def now_ns() -> int:
    return time.time_ns()


@dataclass(frozen=True)
class Published:
    """What a node publishes of one file (MetaStore.publish)."""
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int
    extents: dict[int, Extent]
    held_bytes: int


def count_blocks(node: Inode, indices: Iterable[int], extent_size: int) -> int:
    """512-byte blocks that hold a file's data (st_blocks): holes (missing extents)
    count nothing; a symlink counts its target."""
    if not stat.S_ISREG(node.mode) or node.size == 0:
        return (node.size + 511) // 512 if stat.S_ISLNK(node.mode) else 0
    E = extent_size
    last = (node.size - 1) // E
    covered = sum(min(E, node.size - i * E) for i in indices if i <= last)
    return (covered + 511) // 512


def open_engine(location: str, *, map_size: int = DEFAULT_MAP_SIZE,
                max_map_size: int = MAX_MAP_SIZE, wait: float = 60.0):
    """The key-value engine for a location: a postgresql:// URL or an LMDB directory."""
    if is_postgres_url(location):
        from .postgres_kv import PostgresKV  # psycopg only where it is used
        return PostgresKV(location, wait=wait)
    return LmdbKV(location, map_size=map_size, max_map_size=max_map_size)


class MetaStore:
    def __init__(self, location, map_size: int = DEFAULT_MAP_SIZE,
                 max_map_size: int = MAX_MAP_SIZE):
        """`location`: an engine (kv.py), a postgresql:// URL or an LMDB directory."""
        self.kv = location if not isinstance(location, str) else open_engine(
            location, map_size=map_size, max_map_size=max_map_size)
        self._read, self._write = self.kv.read, self.kv.write  # one call less per operation
        self._peek = self.kv.peek
        if not self.kv.shared:
            for name in _READS:
                setattr(self, name, getattr(type(self), name).__wrapped__.__get__(self))
        self.epoch = self.peek_counter(b"epoch")  # last checkpoint sequence begun
        # Objects first referenced in this epoch after its checkpoint copy was taken:
        # no checkpoint can hold them, so once dropped they may go at once. In memory
        # only: after a restart every object waits for the checkpoints (safe side).
        self._fresh: set[int] = set()
        self._copying = False  # between begin_epoch() and copy_taken(): nothing is fresh
        self._ids: dict[bytes, tuple[int, int]] = {}  # counter -> this node's (next, end)
        self._ids_lock = threading.Lock()  # stores are called from worker threads too
        # Where a node's own LMDB gets object ids when the namespace is shared: from
        # the shared engine's blocks (SharedView), so ids stay unique across nodes.
        self.object_ids: Callable[[], int] | None = None
        # A node's own LMDB on a shared namespace (SharedView): the objects it took ids
        # for that no shared record names yet. Only those are its own gc's to delete;
        # a published object is the shared gc's, which takes it once the change that
        # drops it is published, and never if another node's record names it again.
        self.private_objects: set[int] | None = None
        self.session: int | None = None  # this mount's session on a shared engine
        # Unlinks purge at most this many extent records in their own transaction and
        # leave the rest to purge_orphan(limit=...). None (a shared engine, called in
        # worker threads, off the event loop): all at once.
        self.purge_batch: int | None = None if self.kv.shared else PURGE_BATCH
        self._owner = b""  # what its orphan and upload-intent records say (schema: owner)
        # Extent records per big file (blocks()), on one node's LMDB only: a shared
        # engine's records change on other nodes. A write transaction names the files
        # whose records it adds or deletes (_recount); the counts go once it committed.
        self._record_counts: dict[int, int] | None = None if self.kv.shared else {}
        self._recount: set[int] = set()
        self._counts_changed = 0  # counts forgotten so far: a count read before is stale
        self._counts_lock = threading.Lock()

    def _forget_counts(self) -> None:
        with self._counts_lock:
            for ino in self._recount:
                self._record_counts.pop(ino, None)
            self._recount.clear()
            self._counts_changed += 1

    def _records_change(self, ino: int) -> None:
        """In a write transaction: the file's extent records are added or deleted."""
        if self._record_counts is not None:
            with self._counts_lock:
                self._recount.add(ino)

    # ---- lifecycle ------------------------------------------------------------
    def close(self) -> None:
        self.kv.close()

    def sync(self) -> None:
        """Make committed transactions survive power loss (blocking: call from a thread)."""
        self.kv.sync()

    def watch(self, on_change):
        """What other nodes change: on_change(inodes, entries, everything) from a
        thread, until stop() of what this returns; None on a one-node engine."""
        return self.kv.listen(on_change)

    def reading_in_thread(self):
        """Wrap a worker thread's whole-database reads (LMDB: the map must not move)."""
        return self.kv.reading_in_thread()

    def _scan(self, txn, prefix: bytes, start: bytes | None = None, values: bool = True):
        """(key, value) of the keys starting with `prefix`, from `start` on, in order."""
        return self.kv.scan(txn, start or prefix, prefix_end(prefix), values)

    def _any(self, txn, prefix: bytes) -> bool:
        return next(iter(self._scan(txn, prefix, values=False)), None) is not None

    @_reads
    def superblock(self) -> Superblock | None:
        raw = self.kv.get(s.SUPERBLOCK_KEY)
        return Superblock.decode(raw) if raw else None

    @_transaction
    def put_superblock(self, sb: Superblock) -> None:
        with self._write() as txn:
            txn.put(s.SUPERBLOCK_KEY, sb.encode())

    @_transaction
    def format(self, sb: Superblock, uid: int, gid: int) -> None:
        """Create an empty filesystem: superblock, counters and the root directory."""
        with self._write() as txn:
            self._format(txn, sb, uid, gid)

    def _format(self, txn, sb: Superblock, uid: int, gid: int) -> None:
        t = now_ns()
        root = Inode(s.ROOT_INO, stat.S_IFDIR | 0o755, uid, gid, nlink=2,
                     atime_ns=t, mtime_ns=t, ctime_ns=t, parent=s.ROOT_INO)
        txn.put(s.SUPERBLOCK_KEY, sb.encode())
        txn.put(s.counter_key(b"ino"), s.u64(s.ROOT_INO + 1))
        txn.put(s.counter_key(b"obj"), s.u64(1))
        txn.put(s.inode_key(s.ROOT_INO), root.encode())

    @_transaction
    def claim(self, sb: Superblock, uid: int, gid: int) -> Superblock:
        """A shared engine: format it with `sb` unless it holds a filesystem already
        (nodes mounting a new one at once agree on the first); the one it holds."""
        with self._write() as txn:
            raw = txn.get(s.SUPERBLOCK_KEY)
            if raw is not None:
                return Superblock.decode(raw)
            self._format(txn, sb, uid, gid)
        return sb

    def _next(self, txn, name: bytes, count: int = 1) -> int:
        """The first of `count` fresh values of a counter."""
        raw = txn.get(s.counter_key(name))
        value = s.read_u64(raw)
        txn.put(s.counter_key(name), s.u64(value + count))
        return value

    @_transaction
    def _take_block(self, name: bytes) -> int:
        with self._write() as txn:
            return self._next(txn, name, ID_BLOCK)

    def _reserve_id(self, name: bytes) -> int | None:
        """On a shared engine, an id from this node's block of ID_BLOCK ids (taken
        in a transaction of its own, before the caller opens its own), so nodes
        creating at once do not all write one counter record. Ids stay unique and
        never reused; a block a node does not use up is skipped. None on LMDB: the
        caller takes the id inside its transaction (_next)."""
        if not self.kv.shared:
            return None
        with self._ids_lock:
            nxt, end = self._ids.get(name, (0, 0))
            if nxt >= end:
                nxt = self._take_block(name)
                end = nxt + ID_BLOCK
            self._ids[name] = (nxt + 1, end)
            return nxt

    @_transaction
    def next_object_id(self) -> int:
        """A fresh object id, recorded as an upload intent until the upload ends."""
        reserved = self.object_ids() if self.object_ids else self._reserve_id(b"obj")
        with self._write() as txn:
            obj_id = reserved if reserved is not None else self._next(txn, b"obj")
            txn.put(s.intent_key(obj_id), self._owner)
            if self.private_objects is not None:
                self.private_objects.add(obj_id)
            return obj_id

    @_transaction
    def raise_counter(self, name: bytes, at_least: int) -> None:
        with self._write() as txn:
            raw = txn.get(s.counter_key(name))
            if raw is None or s.read_u64(raw) < at_least:
                txn.put(s.counter_key(name), s.u64(at_least))

    def raise_epoch(self, at_least: int) -> None:
        self.raise_counter(b"epoch", at_least)
        self.epoch = max(self.epoch, at_least)

    @_reads
    def peek_counter(self, name: bytes) -> int:
        raw = self.kv.get(s.counter_key(name))
        return s.read_u64(raw) if raw else 0

    @_transaction
    def begin_epoch(self) -> int:
        """Start checkpoint epoch N+1: objects dropped from now on may be in it, and
        so may objects referenced until copy_taken() says its copy is done."""
        with self._write() as txn:
            epoch = self.epoch + 1  # assigned after the commit: the body may run twice
            txn.put(s.counter_key(b"epoch"), s.u64(epoch))
        self.epoch = epoch
        self._fresh.clear()
        self._copying = True
        return self.epoch

    def copy_taken(self) -> None:
        """The checkpoint copy of this epoch is taken (or failed): objects referenced
        from now on are in no checkpoint."""
        self._copying = False

    def _drop_object(self, txn, obj, referenced: bool = True) -> None:
        """Drop a reference to an object: `obj` is an extent's (id, offset, length), or
        an id or (id, bytes) of an object no extent references. A pack loses that one
        reference (dropping it twice changes nothing) and goes to gc with its last;
        any other object goes to gc at once. One that no checkpoint can reference (never
        referenced, or fresh) may be deleted at once (epoch 0 is older than every
        checkpoint); others wait for the checkpoints of this epoch."""
        if isinstance(obj, tuple) and len(obj) == 3:
            obj_id, offset, size = obj
            raw = txn.get(s.pack_key(obj_id))
            if raw is not None:
                if not txn.delete(s.ref_key(obj_id, offset)):
                    return  # dropped before
                pack = Pack.decode(raw)
                pack.live = max(0, pack.live - size)
                if self._any(txn, s.ref_prefix(obj_id)):
                    txn.put(s.pack_key(obj_id), pack.encode())
                    return
                txn.delete(s.pack_key(obj_id))
                size = pack.total
        else:
            obj_id, size = obj if isinstance(obj, tuple) else (obj, 0)
            if referenced and txn.get(s.pack_key(obj_id)) is not None:
                raise ValueError(f"object {obj_id} is a pack: drop its references one by one")
        if self.private_objects is not None:
            if referenced and obj_id not in self.private_objects:
                return  # published: the shared namespace's gc decides
            self.private_objects.discard(obj_id)
        now = not referenced or obj_id in self._fresh
        self._fresh.discard(obj_id)
        # Shared: a publish may take the object out of the queue and a later one put it
        # back; a stamp of its own each time lets gc count its grace from then.
        stamp = os.urandom(8) if self.kv.shared else b""
        txn.put(s.gc_key(obj_id), s.u64(0 if now else self.epoch) + s.u64(size) + stamp)

    @_transaction
    def set_pack_refs(self, obj_id: int, refs: list[Ref], total: int | None = None) -> None:
        """Make a pack's recorded references exactly `refs` (fsck's repair). With
        none, the pack (if it is one) goes to gc. `total`: the size of a pack whose
        own record was lost, to record it again."""
        prefix = s.ref_prefix(obj_id)
        with self._write() as txn:
            old = [key for key, _ in self._scan(txn, prefix, values=False)]
            for key in old:
                txn.delete(key)
            raw = txn.get(s.pack_key(obj_id))
            if raw is None:
                if total is None or not refs:
                    return
                raw = Pack(total, 0).encode()
            pack = Pack.decode(raw)
            if not refs:
                txn.delete(s.pack_key(obj_id))
                self._drop_object(txn, (obj_id, pack.total))
                return
            for ref in refs:
                txn.put(s.ref_key(obj_id, ref.offset), ref.encode())
            pack.live = sum(r.length for r in refs)
            txn.put(s.pack_key(obj_id), pack.encode())

    @_reads
    def pack(self, obj_id: int) -> Pack | None:
        raw = self.kv.get(s.pack_key(obj_id))
        return Pack.decode(raw) if raw is not None else None

    @_reads
    def pack_refs(self, obj_id: int, start: int = 0, end: int = 1 << 64) -> list[Ref]:
        """The live references into a pack at offsets start <= offset < end, in
        offset order."""
        prefix = s.ref_prefix(obj_id)
        with self._read() as txn:
            out = []
            for key, val in self._scan(txn, prefix, s.ref_key(obj_id, start)):
                ref = Ref.decode(key, val)
                if ref.offset >= end:
                    break
                out.append(ref)
        return out

    # ---- inodes ---------------------------------------------------------------
    @_reads
    def get_inode(self, ino: int) -> Inode:
        raw = self.kv.get(s.inode_key(ino))
        if raw is None:
            raise FsError(errno.ENOENT)
        return Inode.decode(ino, raw)

    def _get(self, txn, ino: int) -> Inode:
        raw = txn.get(s.inode_key(ino))
        if raw is None:
            raise FsError(errno.ENOENT)
        return Inode.decode(ino, raw)

    @_transaction
    def put_inode(self, inode: Inode) -> None:
        with self._write() as txn:
            txn.put(s.inode_key(inode.ino), inode.encode())

    @_reads
    def inode_count(self) -> int:
        """Inode numbers handed out so far: at least the inodes in use (statfs)."""
        return s.read_u64(self.kv.get(s.counter_key(b"ino")))

    # ---- names ----------------------------------------------------------------
    @staticmethod
    def _check_name(name: bytes) -> None:
        if len(name) > NAME_MAX:
            raise FsError(errno.ENAMETOOLONG)
        if not name or b"/" in name or name in (b".", b".."):
            raise FsError(errno.EINVAL)

    @_reads
    def lookup(self, parent: int, name: bytes) -> int:
        if len(name) > NAME_MAX:
            raise FsError(errno.ENAMETOOLONG)
        if name == b".":
            return parent
        if name == b"..":
            return self.get_inode(parent).parent
        raw = self.kv.get(s.dentry_key(parent, name))
        if raw is None:
            raise FsError(errno.ENOENT)
        return s.read_u64(raw)

    def _add_entry(self, txn, parent: Inode, name: bytes, ino: int, t: int) -> None:
        cookie = parent.next_cookie
        parent.next_cookie += 1
        parent.mtime_ns = parent.ctime_ns = t
        txn.put(s.dentry_key(parent.ino, name), s.u64(ino) + s.u64(cookie))
        txn.put(s.cookie_key(parent.ino, cookie), name)

    def _remove_entry(self, txn, parent: Inode, name: bytes, t: int) -> None:
        raw = txn.pop(s.dentry_key(parent.ino, name))
        txn.delete(s.cookie_key(parent.ino, s.read_u64(raw, 8)))
        parent.mtime_ns = parent.ctime_ns = t

    def _dir_for_change(self, txn, parent_ino: int) -> Inode:
        parent = self._get(txn, parent_ino)
        if not stat.S_ISDIR(parent.mode):
            raise FsError(errno.ENOTDIR)
        if parent.nlink == 0:
            raise FsError(errno.ENOENT)  # directory was removed while we held it
        return parent

    @_transaction
    def create_node(self, parent_ino: int, name: bytes, mode: int, uid: int, gid: int,
                    rdev: int = 0, target: bytes | None = None) -> Inode:
        """Create a file, directory, symlink or special node in one transaction."""
        self._check_name(name)
        t = now_ns()
        reserved = self._reserve_id(b"ino")
        with self._write() as txn:
            parent = self._dir_for_change(txn, parent_ino)
            if txn.get(s.dentry_key(parent_ino, name)) is not None:
                raise FsError(errno.EEXIST)
            if parent.mode & stat.S_ISGID:  # BSD group semantics of setgid dirs
                gid = parent.gid
                if stat.S_ISDIR(mode):
                    mode |= stat.S_ISGID
            ino = reserved if reserved is not None else self._next(txn, b"ino")
            node = Inode(ino, mode, uid, gid, size=0, nlink=1, atime_ns=t, mtime_ns=t,
                         ctime_ns=t, rdev=rdev, generation=0)
            if stat.S_ISDIR(mode):
                node.nlink = 2
                node.parent = parent_ino
                parent.nlink += 1
            if target is not None:
                node.size = len(target)
                txn.put(s.symlink_key(ino), target)
            self._add_entry(txn, parent, name, ino, t)
            txn.put(s.inode_key(ino), node.encode())
            txn.put(s.inode_key(parent_ino), parent.encode())
        return node

    @_transaction
    def link(self, ino: int, parent_ino: int, name: bytes) -> Inode:
        self._check_name(name)
        t = now_ns()
        with self._write() as txn:
            parent = self._dir_for_change(txn, parent_ino)
            node = self._get(txn, ino)
            if stat.S_ISDIR(node.mode):
                raise FsError(errno.EPERM)
            if txn.get(s.dentry_key(parent_ino, name)) is not None:
                raise FsError(errno.EEXIST)
            if node.nlink >= 0xFFFFFFFF:
                raise FsError(errno.EMLINK)
            node.nlink += 1
            node.ctime_ns = t
            self._add_entry(txn, parent, name, ino, t)
            txn.put(s.inode_key(ino), node.encode())
            txn.put(s.inode_key(parent_ino), parent.encode())
        return node

    @_reads
    def readlink(self, ino: int) -> bytes:
        target = self.kv.get(s.symlink_key(ino))
        if target is None:
            raise FsError(errno.EINVAL)
        return target

    def _drop_link(self, txn, node: Inode, t: int, in_use: Callable[[int], bool]) -> bool:
        """One name of `node` is gone: update nlink; purge or orphan at zero.
        Returns True if the inode's data must be purged now (caller frees hot files)."""
        if stat.S_ISDIR(node.mode):
            node.nlink = 0
        else:
            node.nlink -= 1
        node.ctime_ns = t
        if node.nlink > 0:
            txn.put(s.inode_key(node.ino), node.encode())
            return False
        # A file too big to purge in this transaction stays an orphan, as one still in
        # use does: the caller purges the rest in parts (purge_orphan with a limit).
        if in_use(node.ino) or not self._purge(txn, node.ino, self.purge_batch):
            txn.put(s.inode_key(node.ino), node.encode())
            txn.put(s.orphan_key(node.ino), self._owner)
            return False
        return True

    @_transaction
    def unlink(self, parent_ino: int, name: bytes,
               in_use: Callable[[int], bool]) -> tuple[int, bool]:
        """Remove a non-directory name. Returns (ino, purged)."""
        if len(name) > NAME_MAX:
            raise FsError(errno.ENAMETOOLONG)
        t = now_ns()
        with self._write() as txn:
            parent = self._dir_for_change(txn, parent_ino)
            raw = txn.get(s.dentry_key(parent_ino, name))
            if raw is None:
                raise FsError(errno.ENOENT)
            node = self._get(txn, s.read_u64(raw))
            if stat.S_ISDIR(node.mode):
                raise FsError(errno.EISDIR)
            self._remove_entry(txn, parent, name, t)
            txn.put(s.inode_key(parent_ino), parent.encode())
            purged = self._drop_link(txn, node, t, in_use)
        return node.ino, purged

    def _is_empty_dir(self, txn, ino: int) -> bool:
        return not self._any(txn, s.dentry_prefix(ino))

    @_transaction
    def rmdir(self, parent_ino: int, name: bytes,
              in_use: Callable[[int], bool]) -> tuple[int, bool]:
        if len(name) > NAME_MAX:
            raise FsError(errno.ENAMETOOLONG)
        if name == b".":
            raise FsError(errno.EINVAL)
        if name == b"..":
            raise FsError(errno.ENOTEMPTY)
        t = now_ns()
        with self._write() as txn:
            parent = self._dir_for_change(txn, parent_ino)
            raw = txn.get(s.dentry_key(parent_ino, name))
            if raw is None:
                raise FsError(errno.ENOENT)
            node = self._get(txn, s.read_u64(raw))
            if not stat.S_ISDIR(node.mode):
                raise FsError(errno.ENOTDIR)
            if not self._is_empty_dir(txn, node.ino):
                raise FsError(errno.ENOTEMPTY)
            self._remove_entry(txn, parent, name, t)
            parent.nlink -= 1
            txn.put(s.inode_key(parent_ino), parent.encode())
            purged = self._drop_link(txn, node, t, in_use)
        return node.ino, purged

    def _is_ancestor(self, txn, maybe_ancestor: int, ino: int) -> bool:
        """True if `maybe_ancestor` is `ino` or one of its parents."""
        while True:
            if ino == maybe_ancestor:
                return True
            if ino == s.ROOT_INO:
                return False
            ino = self._get(txn, ino).parent

    @_transaction
    def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes,
               flags: int, in_use: Callable[[int], bool],
               noreplace: int, exchange: int) -> tuple[int | None, bool]:
        """rename(2) with RENAME_NOREPLACE / RENAME_EXCHANGE.
        Returns (ino of a replaced target or None, whether it was purged)."""
        if flags & ~(noreplace | exchange):
            raise FsError(errno.EINVAL)  # RENAME_WHITEOUT: no whiteouts here
        self._check_name(new_name)
        if len(old_name) > NAME_MAX:
            raise FsError(errno.ENAMETOOLONG)
        t = now_ns()
        with self._write() as txn:
            src_dir = self._dir_for_change(txn, old_parent)
            dst_dir = src_dir if new_parent == old_parent else self._dir_for_change(txn, new_parent)
            raw = txn.get(s.dentry_key(old_parent, old_name))
            if raw is None:
                raise FsError(errno.ENOENT)
            src = self._get(txn, s.read_u64(raw))
            raw_dst = txn.get(s.dentry_key(new_parent, new_name))
            dst = self._get(txn, s.read_u64(raw_dst)) if raw_dst is not None else None
            if dst is not None and dst.ino == src.ino:
                return None, False  # same file: POSIX says do nothing
            if flags & noreplace and dst is not None:
                raise FsError(errno.EEXIST)
            if flags & exchange:
                if dst is None:
                    raise FsError(errno.ENOENT)
                return self._exchange(txn, src_dir, old_name, src, dst_dir, new_name, dst, t)
            src_is_dir = stat.S_ISDIR(src.mode)
            if src_is_dir and new_parent != old_parent and self._is_ancestor(txn, src.ino, new_parent):
                raise FsError(errno.EINVAL)
            if dst is not None:
                if stat.S_ISDIR(dst.mode):
                    if not src_is_dir:
                        raise FsError(errno.EISDIR)
                    if not self._is_empty_dir(txn, dst.ino):
                        raise FsError(errno.ENOTEMPTY)
                elif src_is_dir:
                    raise FsError(errno.ENOTDIR)
            self._remove_entry(txn, src_dir, old_name, t)
            purged = False
            if dst is not None:
                self._remove_entry(txn, dst_dir, new_name, t)
                if stat.S_ISDIR(dst.mode):
                    dst_dir.nlink -= 1
                purged = self._drop_link(txn, dst, t, in_use)
            self._add_entry(txn, dst_dir, new_name, src.ino, t)
            if src_is_dir and new_parent != old_parent:
                src.parent = new_parent
                src_dir.nlink -= 1
                dst_dir.nlink += 1
            src.ctime_ns = t
            txn.put(s.inode_key(src.ino), src.encode())
            txn.put(s.inode_key(src_dir.ino), src_dir.encode())
            if dst_dir is not src_dir:
                txn.put(s.inode_key(dst_dir.ino), dst_dir.encode())
        return (dst.ino if dst is not None else None), purged

    def _exchange(self, txn, src_dir, old_name, src, dst_dir, new_name, dst, t):
        if src_dir.ino != dst_dir.ino:
            for moving, into in ((src, dst_dir), (dst, src_dir)):
                if stat.S_ISDIR(moving.mode) and self._is_ancestor(txn, moving.ino, into.ino):
                    raise FsError(errno.EINVAL)
        # Keep both cookies; just swap which inode each name points at.
        for d, name, ino in ((src_dir, old_name, dst.ino), (dst_dir, new_name, src.ino)):
            key = s.dentry_key(d.ino, name)
            cookie = txn.get(key)[8:]
            txn.put(key, s.u64(ino) + cookie)
            d.mtime_ns = d.ctime_ns = t
        if src_dir.ino != dst_dir.ino:
            for moving, into, out_of in ((src, dst_dir, src_dir), (dst, src_dir, dst_dir)):
                if stat.S_ISDIR(moving.mode):
                    moving.parent = into.ino
                    into.nlink += 1
                    out_of.nlink -= 1
        src.ctime_ns = dst.ctime_ns = t
        for node in (src, dst, src_dir, dst_dir):
            txn.put(s.inode_key(node.ino), node.encode())
        return None, False

    @_reads
    def readdir(self, ino: int, after_cookie: int, limit: int = 1024) -> list[tuple[int, bytes, int]]:
        """Entries of a directory with cookie > after_cookie: (cookie, name, child ino)."""
        out = []
        prefix = s.cookie_prefix(ino)
        start = s.cookie_key(ino, max(after_cookie + 1, s.FIRST_COOKIE))
        with self._read() as txn:
            page = []
            for key, name in self._scan(txn, prefix, start):
                if len(page) >= limit:
                    break
                page.append((s.read_u64(key, 9), name))
            children = self.kv.get_many(txn, [s.dentry_key(ino, name) for _c, name in page])
            for (cookie, name), child in zip(page, children):
                out.append((cookie, name, s.read_u64(child)))
        return out

    @_reads
    def get_inodes(self, inos: Iterable[int]) -> list[Inode]:
        inos = list(inos)
        with self._read() as txn:
            raws = self.kv.get_many(txn, [s.inode_key(i) for i in inos])
        if any(raw is None for raw in raws):
            raise FsError(errno.ENOENT)
        return [Inode.decode(i, raw) for i, raw in zip(inos, raws)]

    # ---- orphans and purge ----------------------------------------------------
    def _purge(self, txn, ino: int, limit: int | None = None) -> bool:
        """Delete an inode and everything hanging off it; its objects go to gc. With
        `limit`, first at most that many of its extent records: if more are left, False,
        and the inode itself stays."""
        self._records_change(ino)
        if limit is not None:
            part = list(itertools.islice(self._scan(txn, s.extent_prefix(ino)), limit + 1))
            if len(part) > limit:
                self._delete_records(txn, part[:limit])
                return False
        txn.delete(s.inode_key(ino))
        txn.delete(s.symlink_key(ino))
        txn.delete(s.orphan_key(ino))
        for prefix in (s.xattr_prefix(ino), s.extent_prefix(ino), s.held_prefix(ino)):
            self._delete_records(txn, list(self._scan(txn, prefix)))
        return True

    def _delete_records(self, txn, records: list[tuple[bytes, bytes]]) -> None:
        """Delete (key, value) records of a file; the objects its extent records name
        go to gc."""
        for key, val in records:
            if key[:1] == b"E":
                ext = Extent.decode(val)
                if ext.obj_id:
                    self._drop_object(txn, ext.ref)
            txn.delete(key)

    @_transaction
    def purge_orphan(self, ino: int, limit: int | None = None) -> bool | None:
        """Purge an unlinked inode once nothing uses it. Returns True if purged, False
        if it is no orphan; with `limit` (extent records in this transaction), None if
        some are left: call again."""
        with self._write() as txn:
            if txn.get(s.orphan_key(ino)) is None:
                return False
            if not self._purge(txn, ino, limit):
                return None
        return True

    @_reads
    def is_orphan(self, ino: int) -> bool:
        return self.kv.get(s.orphan_key(ino)) is not None

    @_reads
    def orphans(self) -> list[int]:
        return [s.read_u64(k, 1) for k in self._keys(b"O")]

    def _keys(self, prefix: bytes) -> list[bytes]:
        with self._read() as txn:
            return [key for key, _ in self._scan(txn, prefix, values=False)]

    # ---- xattrs ---------------------------------------------------------------
    @_reads
    def get_xattr(self, ino: int, name: bytes) -> bytes | None:
        return self.kv.get(s.xattr_key(ino, name))

    @_transaction
    def set_xattr(self, ino: int, name: bytes, value: bytes, flags: int = 0) -> None:
        with self._write() as txn:
            node = self._get(txn, ino)
            key = s.xattr_key(ino, name)
            exists = txn.get(key) is not None
            if flags & os.XATTR_CREATE and exists:
                raise FsError(errno.EEXIST)
            if flags & os.XATTR_REPLACE and not exists:
                raise FsError(errno.ENODATA)
            txn.put(key, value)
            node.ctime_ns = now_ns()
            txn.put(s.inode_key(ino), node.encode())

    @_reads
    def list_xattrs(self, ino: int) -> list[bytes]:
        prefix = s.xattr_prefix(ino)
        return [k[len(prefix):] for k in self._keys(prefix)]

    @_reads
    def xattr_name_exists(self, name: bytes) -> bool:
        """Does any inode carry an xattr of this name? (one scan, at startup)"""
        with self._read() as txn:
            return any(key[9:] == name for key, _ in self._scan(txn, b"X", values=False))

    @_transaction
    def remove_xattr(self, ino: int, name: bytes) -> None:
        with self._write() as txn:
            node = self._get(txn, ino)
            if not txn.delete(s.xattr_key(ino, name)):
                raise FsError(errno.ENODATA)
            node.ctime_ns = now_ns()
            txn.put(s.inode_key(ino), node.encode())

    # ---- extents --------------------------------------------------------------
    @_reads
    def get_extents(self, ino: int, first: int, last: int) -> tuple[Inode, dict[int, Extent]]:
        """The inode and its extent records with first <= index <= last."""
        out = {}
        with self._read() as txn:
            node = self._get(txn, ino)
            if first == last:
                raw = txn.get(s.extent_key(ino, first))
                if raw is not None:
                    out[first] = Extent.decode(raw)
                return node, out
            end = s.extent_key(ino, last) + b"\x00"  # just above the last one
            for key, val in self.kv.scan(txn, s.extent_key(ino, first), end):
                out[s.read_u64(key, 9)] = Extent.decode(val)
        return node, out

    @_reads
    def extent_indices(self, ino: int) -> list[int]:
        """Indices of the extents a file has records for (keys only: nothing decoded)."""
        out = []
        prefix = s.extent_prefix(ino)
        with self._read() as txn:
            for key, _ in self._scan(txn, prefix, values=False):
                out.append(s.read_u64(key, 9))
        return out

    @_reads
    def last_extent_indices(self, ino: int, first: int, limit: int) -> list[int]:
        """Indices of a file's last `limit` extent records from index `first` on,
        highest first (keys only: the rest of a huge file is not read)."""
        with self._read() as txn:
            keys = self.kv.last_keys(txn, s.extent_key(ino, first),
                                     prefix_end(s.extent_prefix(ino)), limit)
        return [s.read_u64(key, 9) for key in keys]

    @_reads
    def blocks(self, node: Inode, extent_size: int) -> int:
        """st_blocks of a file (count_blocks). It reads the records from its last
        extent on; those below it are counted once for a big file and the count kept
        until a transaction adds or deletes one of its records."""
        if not stat.S_ISREG(node.mode) or node.size == 0:
            return count_blocks(node, (), extent_size)
        ino, E = node.ino, extent_size
        last = (node.size - 1) // E
        prefix = s.extent_prefix(ino)
        counts = self._record_counts
        seen = self._counts_changed  # before the snapshot: see _forget_counts
        with self._read() as txn:
            tail = [s.read_u64(k, 9) for k, _v in
                    self.kv.scan(txn, s.extent_key(ino, last), prefix_end(prefix), False)]
            records = counts.get(ino) if counts is not None else None
            if records is None:
                records = sum(1 for _ in self._scan(txn, prefix, values=False))
                if counts is not None and records >= COUNTED_RECORDS:
                    with self._counts_lock:
                        if self._counts_changed == seen:
                            counts[ino] = records
        covered = (records - len(tail)) * E  # every extent below the last one: whole
        if tail and tail[0] == last:
            covered += node.size - last * E
        return (covered + 511) // 512

    def all_extents(self, ino: int) -> dict[int, Extent]:
        return self.get_extents(ino, 0, (1 << 64) - 1)[1]

    @_transaction
    def update(self, inode: Inode | None, extents: dict[tuple[int, int], Extent | None] = {},
               gc_objects: Iterable[tuple[int, int, int]] = (), uploaded: Iterable[int] = (),
               unreferenced: Iterable[int] = (),
               packs: dict[int, tuple[int, list[Ref]]] | None = None,
               failed: Iterable[int] = ()) -> None:
        """In one transaction: write an inode and extent records (None deletes), drop
        the references extents no longer hold (their (id, offset, length): objects
        and packs without references go to gc), record new packs (id -> (size, the
        references its extents hold)), close the upload intents of objects now
        referenced (`uploaded`), and of objects nothing ever referenced
        (`unreferenced`: a superseded upload, deleted at once). Objects whose PUT
        failed (`failed`) are deleted at once too, but keep their intent, so the
        next mount deletes them again: a PUT the client gave up on may still land."""
        with self._write() as txn:
            for obj_id, (total, refs) in (packs or {}).items():
                txn.put(s.pack_key(obj_id), Pack(total, sum(r.length for r in refs)).encode())
                for ref in refs:
                    txn.put(s.ref_key(obj_id, ref.offset), ref.encode())
            if inode is not None:
                txn.put(s.inode_key(inode.ino), inode.encode())
            self._put_extents(txn, extents)
            for obj in gc_objects:
                self._drop_object(txn, obj)
            for obj in uploaded:
                txn.delete(s.intent_key(obj))
                if not self._copying:
                    self._fresh.add(obj)
            for obj in unreferenced:
                txn.delete(s.intent_key(obj))
                self._drop_object(txn, obj, referenced=False)
            for obj in failed:
                self._drop_object(txn, obj, referenced=False)

    def _put_extents(self, txn, extents: dict[tuple[int, int], Extent | None]) -> None:
        """Write extent records; None deletes one."""
        for (ino, idx), ext in extents.items():
            self._records_change(ino)
            if ext is None:
                txn.delete(s.extent_key(ino, idx))
            else:
                txn.put(s.extent_key(ino, idx), ext.encode())

    @_transaction
    def put_extent_if(self, ino: int, idx: int, expect: Extent, new: Extent) -> bool:
        """Compare-and-set an extent record (used after an await)."""
        with self._write() as txn:
            raw = txn.get(s.extent_key(ino, idx))
            if raw is None or Extent.decode(raw) != expect:
                return False
            txn.put(s.extent_key(ino, idx), new.encode())
            return True

    @_transaction
    def put_extents_if(self, items: list) -> list[bool]:
        """put_extent_if() of every ((ino, idx), expect, new), in one transaction;
        whether each was set."""
        out = []
        with self._write() as txn:
            for (ino, idx), expect, new in items:
                raw = txn.get(s.extent_key(ino, idx))
                won = raw is not None and Extent.decode(raw) == expect
                if won:
                    txn.put(s.extent_key(ino, idx), new.encode())
                out.append(won)
        return out

    def gc_pending(self, limit: int | None = None) -> list[tuple[int, int]]:
        """(object id, epoch it was dropped in) of objects awaiting deletion."""
        return [(obj_id, epoch) for obj_id, epoch, _record in self.gc_queue(limit)]

    @_reads
    def gc_queue(self, limit: int | None = None, start: int = 0
                 ) -> list[tuple[int, int, bytes]]:
        """gc_pending() with each object's queue record, which on a shared engine
        differs each time the object is queued (see _drop_object); from object id
        `start` on."""
        out = []
        with self._read() as txn:
            for key, val in self._scan(txn, b"G", s.gc_key(start)):
                if limit is not None and len(out) >= limit:
                    break
                out.append((s.read_u64(key, 1), s.read_u64(val) if val else 0, val))
        return out

    @_reads
    def gc_backlog(self) -> tuple[int, int]:
        """(objects, bytes known) waiting in the gc table (a full scan: use a thread)."""
        count = size = 0
        with self._read() as txn:
            for _key, val in self._scan(txn, b"G"):
                count += 1
                if len(val) >= 16:
                    size += s.read_u64(val, 8)
        return count, size

    @_reads
    def upload_intents(self) -> list[int]:
        return [s.read_u64(k, 1) for k in self._keys(b"U")]

    @_transaction
    def abandon_intents(self) -> int:
        """This owner's uploads that never finished (its daemon died): their objects,
        if any, go to gc. On LMDB that is every intent; on a shared engine a new
        session has none, and a dead session's go with end_session()."""
        with self._read() as txn:
            ids = [s.read_u64(k, 1) for k, owner in self._scan(txn, b"U") if owner == self._owner]
        if ids:
            self.update(None, {}, unreferenced=ids)
        return len(ids)

    # ---- sessions (a shared engine: one per mount) ---------------------------------
    @_transaction
    def open_session(self, node: str, pid: int, mountpoint: str) -> int:
        """Register this mount; its orphans and upload intents are recorded as its own.
        Session times are the engine's clock (the database server's), not this node's."""
        with self._write() as txn:
            t = self.kv.now_ns(txn)
            raw = txn.get(s.counter_key(b"session"))
            sid = s.read_u64(raw) if raw else 1
            txn.put(s.counter_key(b"session"), s.u64(sid + 1))
            txn.put(s.session_key(sid), Session(sid, node, pid, mountpoint, t, t).encode())
        self.session, self._owner = sid, s.u64(sid)
        return sid

    @_transaction
    def heartbeat(self) -> None:
        """Say this session is alive; SessionLost if another node ended it."""
        with self._write() as txn:
            raw = txn.get(s.session_key(self.session))
            if raw is None:
                raise SessionLost(f"session {self.session} was ended by another node")
            session = Session.decode(self.session, raw)
            session.heartbeat_ns = self.kv.now_ns(txn)
            txn.put(s.session_key(self.session), session.encode())

    @_reads
    def sessions(self) -> list[Session]:
        with self._read() as txn:
            return [Session.decode(s.read_u64(k, 1), v) for k, v in self._scan(txn, b"N")]

    @_reads
    def expired_sessions(self, timeout_s: float) -> list[Session]:
        """Other sessions whose last heartbeat is older than `timeout_s`."""
        with self._read() as txn:
            oldest = self.kv.now_ns(txn) - int(timeout_s * 1e9)
            found = [Session.decode(s.read_u64(k, 1), v) for k, v in self._scan(txn, b"N")]
        return [x for x in found if x.heartbeat_ns < oldest and x.sid != self.session]

    @_transaction
    def end_session(self, sid: int, *, stale_s: float | None = None,
                    decide_by: float | None = None) -> tuple[int, int] | None:
        """End a session (a clean unmount, or a dead node's, found expired): purge the
        files it held open after their last name was gone, and send the objects of
        uploads it never finished to gc. Returns (files purged, intents abandoned).
        Ending a session twice does nothing the second time.

        Another node's session (`stale_s` given) is ended only if, inside this
        transaction, its heartbeat is still older than `stale_s` and the clock
        (time.monotonic) has not passed `decide_by`: a call the engine held up
        through an outage decides nothing (None), since the other node could not
        beat its heart either."""
        owner = s.u64(sid)
        with self._write() as txn:
            if stale_s is not None:
                raw = txn.get(s.session_key(sid))
                if (raw is None or (decide_by is not None and time.monotonic() > decide_by)
                        or Session.decode(sid, raw).heartbeat_ns
                        >= self.kv.now_ns(txn) - int(stale_s * 1e9)):
                    return None
            orphans = [s.read_u64(k, 1) for k, v in self._scan(txn, b"O") if v == owner]
            intents = [s.read_u64(k, 1) for k, v in self._scan(txn, b"U") if v == owner]
            for ino in orphans:
                self._purge(txn, ino)
            for obj in intents:
                txn.delete(s.intent_key(obj))
                self._drop_object(txn, obj, referenced=False)
            txn.delete(s.session_key(sid))
        if sid == self.session:
            self.session, self._owner = None, b""
        return len(orphans), len(intents)

    @_reads
    def held(self) -> list[tuple[int, int, int, str]]:
        """(ino, session, bytes, node) of files with data only on one node."""
        with self._read() as txn:
            return [(s.read_u64(k, 1), s.read_u64(k, 9), s.read_u64(v), v[8:].decode())
                    for k, v in self._scan(txn, b"H")]

    # ---- a node's view of a shared namespace (tier/shared_view.py) -----------------
    def _inode_ranges(self, inos: list[int]) -> list[tuple[bytes, bytes]]:
        """Key ranges of inode records and of the inodes' extent records."""
        out = []
        for ino in inos:
            key, prefix = s.inode_key(ino), s.extent_prefix(ino)
            out += [(key, key + b"\x00"), (prefix, prefix_end(prefix))]
        return out

    def _files(self, txn, inos: list[int], extent_size: int | None):
        """Each inode (None if missing) with its extent records, or with its st_blocks
        if `extent_size` is given, in one scan (one statement: one snapshot)."""
        unique = list(dict.fromkeys(inos))  # hard links: one inode under two names
        found = self.kv.scan_many(txn, self._inode_ranges(unique))
        at = {ino: i for i, ino in enumerate(unique)}
        out = []
        for ino in inos:
            rows, exts = found[2 * at[ino]], found[2 * at[ino] + 1]
            node = Inode.decode(ino, rows[0][1]) if rows else None
            if extent_size is None:
                out.append((node, {s.read_u64(k, 9): Extent.decode(v) for k, v in exts}))
            else:
                indices = [s.read_u64(k, 9) for k, _v in exts]
                out.append((node, count_blocks(node, indices, extent_size) if node else 0))
        return out

    @_reads
    def attrs(self, ino: int, extent_size: int, name: bytes | None = None
              ) -> tuple[Inode, int]:
        """An inode (or, with `name`, its entry of that name) with its st_blocks."""
        with self._peek() as txn:
            if name == b"..":
                ino = self._get(txn, ino).parent
            elif name is not None and name != b".":
                if len(name) > NAME_MAX:
                    raise FsError(errno.ENAMETOOLONG)
                raw = txn.get(s.dentry_key(ino, name))
                if raw is None:
                    raise FsError(errno.ENOENT)
                ino = s.read_u64(raw)
            (node, blocks), = self._files(txn, [ino], extent_size)
        if node is None:
            raise FsError(errno.ENOENT)
        return node, blocks

    @_reads
    def readdir_plus(self, ino: int, after_cookie: int, limit: int, extent_size: int):
        """The directory, its parent and up to `limit` entries after a cookie with their
        attributes and st_blocks: (dir, parent, [(cookie, name, (inode, blocks))]). Four
        statements, each its own snapshot: an entry renamed meanwhile may be missing."""
        with self._peek() as txn:
            node = self._get(txn, ino)
            parent = self._get(txn, node.parent or ino)
            page = []
            start = s.cookie_key(ino, max(after_cookie + 1, s.FIRST_COOKIE))
            for key, name in self._scan(txn, s.cookie_prefix(ino), start):
                if len(page) >= limit:
                    break
                page.append((s.read_u64(key, 9), name))
            dents = self.kv.get_many(txn, [s.dentry_key(ino, name) for _c, name in page])
            page = [(c, n, s.read_u64(d)) for (c, n), d in zip(page, dents) if d is not None]
            files = self._files(txn, [i for _c, _n, i in page], extent_size)
        return node, parent, [(c, n, found) for (c, n, _i), found in zip(page, files)
                              if found[0] is not None]

    @_reads
    def existing(self, inos: list[int]) -> set[int]:
        """Which of these inodes exist."""
        with self._peek() as txn:
            raws = self.kv.get_many(txn, [s.inode_key(i) for i in inos])
        return {i for i, raw in zip(inos, raws) if raw is not None}

    @_transaction
    def modify_inode(self, ino: int, change: Callable[[Inode], None]) -> Inode:
        """change(inode) applied to the record in one transaction (it may run twice:
        it must only assign); returns the new inode."""
        with self._write() as txn:
            node = self._get(txn, ino)
            change(node)
            txn.put(s.inode_key(ino), node.encode())
        return node

    @_reads
    def file_view(self, ino: int) -> tuple[Inode, dict[int, Extent]]:
        """A file's inode and every extent record, in one snapshot."""
        with self._peek() as txn:
            (node, exts), = self._files(txn, [ino], None)
        if node is None:
            raise FsError(errno.ENOENT)
        return node, exts

    @_reads
    def packs_among(self, obj_ids: list[int]) -> list[int]:
        """Which of these objects are packs."""
        with self._peek() as txn:
            raws = self.kv.get_many(txn, [s.pack_key(i) for i in obj_ids])
        return [i for i, raw in zip(obj_ids, raws) if raw is not None]

    @_transaction
    def publish(self, files: list[Published], holder: int, node_name: str) -> list[bool]:
        """Make files' shared records say what one node has, in one transaction: each
        file's size and times and all its extent records (published form); objects no
        record names any more go to gc; `held_bytes` of a file's data are on that node
        only (session `holder`). Per file: False if it is gone."""
        out = []
        with self._write() as txn:
            found = self.kv.scan_many(txn, [r for f in files for r in self._file_ranges(f.ino)])
            named: set[int] = set()  # objects records name that they did not before
            for i, f in enumerate(files):
                rows, old_exts, helds = found[3 * i:3 * i + 3]
                out.append(bool(rows))
                if rows:
                    named |= self._publish_one(txn, f, Inode.decode(f.ino, rows[0][1]),
                                               old_exts, helds, holder, node_name)
            # A node publishing its copy of a file opened before another node rewrote
            # it names objects that rewrite dropped: they leave the gc queue again.
            named_ids = sorted(named)
            queued = self.kv.get_many(txn, [s.gc_key(i) for i in named_ids]) if named else []
            for obj_id, raw in zip(named_ids, queued):
                if raw is not None:
                    txn.delete(s.gc_key(obj_id))
        return out

    def _file_ranges(self, ino: int) -> list[tuple[bytes, bytes]]:
        held = s.held_prefix(ino)
        return self._inode_ranges([ino]) + [(held, prefix_end(held))]

    def _publish_one(self, txn, f: Published, node: Inode, old_exts, helds, holder: int,
                     node_name: str) -> set[int]:
        """Publish one file; returns the objects its records name that they did not."""
        node.size, node.mtime_ns = f.size, f.mtime_ns
        node.ctime_ns = max(node.ctime_ns, f.ctime_ns)
        txn.put(s.inode_key(f.ino), node.encode())
        self._records_change(f.ino)
        old = {s.read_u64(k, 9): Extent.decode(v) for k, v in old_exts}
        for idx, ext in old.items():
            new = f.extents.get(idx)
            if ext.obj_id and (new is None or new.ref != ext.ref):
                self._drop_object(txn, ext.ref)
            if new is None:
                txn.delete(s.extent_key(f.ino, idx))
        named = set()
        for idx, new in f.extents.items():
            if old.get(idx) != new:
                txn.put(s.extent_key(f.ino, idx), new.encode())
                if new.obj_id and (idx not in old or old[idx].obj_id != new.obj_id):
                    named.add(new.obj_id)
        mine = s.held_key(f.ino, holder)
        value = s.u64(f.held_bytes) + node_name.encode()
        held = f.held_bytes or any(e.dirty for e in f.extents.values())
        for key, raw in helds:
            if not (held and key == mine and raw == value):
                txn.delete(key)
        if held and (mine, value) not in helds:
            txn.put(mine, value)
        return named

    @_transaction
    def take_view(self, node: Inode, extents: dict[tuple[int, int], Extent | None],
                  packs: Iterable[int]) -> None:
        """A node's own LMDB: hold the shared inode and extent records as pulled, and
        mark objects that are packs (another node's: with no references recorded here,
        this node never deletes them)."""
        with self._write() as txn:
            txn.put(s.inode_key(node.ino), node.encode())
            self._put_extents(txn, extents)
            for obj_id in packs:
                if txn.get(s.pack_key(obj_id)) is None:
                    txn.put(s.pack_key(obj_id), Pack(0, 0).encode())

    @_transaction
    def purge(self, ino: int) -> None:
        """A node's own LMDB: forget an inode the shared namespace purged."""
        with self._write() as txn:
            self._purge(txn, ino)
            txn.delete(s.unpublished_key(ino))

    @_transaction
    def set_unpublished(self, ino: int, on: bool) -> None:
        with self._write() as txn:
            if on:
                txn.put(s.unpublished_key(ino), b"")
            else:
                txn.delete(s.unpublished_key(ino))

    @_reads
    def unpublished(self) -> list[int]:
        return [s.read_u64(k, 1) for k in self._keys(b"W")]

    @_transaction
    def delete_raw(self, keys: Iterable[bytes]) -> None:
        """Delete keys as they are (fsck repairs)."""
        with self._write() as txn:
            for key in keys:
                if key[:1] == b"E":
                    self._records_change(s.read_u64(key, 1))
                txn.delete(key)

    @_transaction
    def relink(self, ino: int, parent_ino: int, name: bytes) -> None:
        """Give an unreachable inode a name again (fsck: lost+found)."""
        t = now_ns()
        with self._write() as txn:
            parent = self._dir_for_change(txn, parent_ino)
            node = self._get(txn, ino)
            if stat.S_ISDIR(node.mode):
                node.nlink = 2
                node.parent = parent_ino
                parent.nlink += 1
            else:
                node.nlink = 1
            self._add_entry(txn, parent, name, ino, t)
            txn.put(s.inode_key(ino), node.encode())
            txn.put(s.inode_key(parent_ino), parent.encode())

    @_transaction
    def gc_done(self, obj_ids: Iterable[int]) -> None:
        with self._write() as txn:
            for obj in obj_ids:
                txn.delete(s.gc_key(obj))
