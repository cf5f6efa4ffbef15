"""Assemble the daemon: stores, engine, FUSE adapter, background tasks; run them
in one trio nursery and shut down cleanly on unmount or signal."""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import resource
import signal
import socket
import sys
import time
from types import SimpleNamespace

import pyfuse3
import trio

from . import exit_report, guard, registry, sdnotify
from .config import MountConfig
from .errors import ColdStoreError, FsError, UserError
from .filesystem import attach, attach_shared, bucket_failed_the_mount, open_cold
from .fs import request_wait
from .fs.control import Control
from .fs.ops import Operations
from .fs.shared_ops import SharedOperations
from .hot import HotStore
from .cold import parse_cold_url
from .mountpoint import check_fuse_available, check_mountpoint, check_outside_mount
from .tier.cache import HotIndex
from .tier.checkpoint import Checkpointer, CopyFailed, Fenced
from .tier.engine import AROUND_INSTALL_THREADS, Engine
from .tier.compact import Compactor
from .tier.gc import GarbageCollector
from .tier.hinted import HintQueue
from .tier.sessions import SessionKeeper
from .tier.shared_view import SharedView
from .tier.space import Space, check_cache_size
from .tier.state import NodeState
from .tier.stats import Stats
from .tier.uploader import HotFilesLost, Uploader

log = logging.getLogger("tierfs")


# A Unix socket's path must fit in sockaddr_un.sun_path (108 bytes with its NUL).
MAX_SOCKET_PATH = 107
INSTALL_WAIT_S = 0.02  # how long a lookup answer on its way may take to reach the kernel
# The trio thread answers every FUSE request and gives the interpreter lock away at
# each of its system calls; a worker thread running Python (a GET's checks, an
# install's hand-over) then keeps it until it blocks or this interval passes
# (Python's default: 5 ms). A cold epoch's first batch waited that out request after
# request.
SWITCH_INTERVAL_S = 0.0005


def lock_cache_dir(cache_dir: str) -> int:
    """Hold an exclusive lock on the cache dir for the daemon's lifetime."""
    socket_path = os.path.join(cache_dir, "control.sock")
    if len(os.fsencode(socket_path)) > MAX_SOCKET_PATH:
        raise UserError(f"cache dir {cache_dir} is too long a path for the control socket "
                        f"({len(os.fsencode(socket_path))} bytes, at most {MAX_SOCKET_PATH}): "
                        f"choose a shorter --cache-dir")
    if os.path.exists(cache_dir) and not os.path.isdir(cache_dir):
        raise UserError(f"cache dir {cache_dir} is a file, not a directory: choose a "
                        f"directory for --cache-dir")
    try:
        os.makedirs(cache_dir, exist_ok=True)
    except OSError as e:
        if e.errno == errno.EROFS:
            raise UserError(f"cannot create cache dir {cache_dir}: its filesystem is "
                            f"read-only; choose a --cache-dir on a writable disk") from None
        raise UserError(f"cannot create cache dir {cache_dir}: {e.strerror}") from None
    if os.statvfs(cache_dir).f_flag & os.ST_RDONLY:
        raise UserError(f"cache dir {cache_dir} is on a read-only filesystem: remount it "
                        f"read-write or choose a --cache-dir on a writable disk")
    if not os.access(cache_dir, os.W_OK | os.X_OK):
        raise UserError(f"cache dir {cache_dir} is not writable: fix its permissions or "
                        f"choose another --cache-dir")
    path = os.path.join(cache_dir, "lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise UserError(f"cache dir {cache_dir} is in use by another tierfs daemon "
                        f"(pid {holder}): unmount it first or use another --cache-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def set_bdi_readahead(dev: int, kb: int) -> None:
    """Raise the FUSE connection's readahead: bigger reads, fewer round trips."""
    try:
        path = f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb"
        with open(path, "w") as f:
            f.write(str(kb))
    except OSError as e:
        log.info("could not set FUSE readahead (%s); continuing with the default", e)


class Daemon:
    def __init__(self, cfg: MountConfig):
        self.cfg = cfg
        self.cfg.mountpoint = os.path.abspath(cfg.mountpoint)
        self.cfg.cache_dir = os.path.abspath(cfg.cache_dir)
        self.notes: list[str] = []
        self.stats = Stats()
        self.state = NodeState()
        self._lock_fd = None
        self.meta = None
        self.shared = None  # the shared namespace's store (--meta-url), else None
        self.feed = None
        self.engine = None
        self.lease = None
        self.mounted = False
        # The final checkpoint (one node) or push of every file (shared) succeeded:
        # only then is the lease released, so that no other node takes the filesystem
        # over from an older checkpoint without --force.
        self.checkpointed = False
        self._registered: str | None = None  # this mount's entry in the registry
        self.guard_process = None  # guard.py: aborts the connection if this daemon is killed
        self.on_cache_dir_locked = lambda: None  # the daemon's log starts here

    def _space(self, engine) -> Space:
        cfg = self.cfg
        return Space(engine, cache_size=cfg.cache_size, min_free=cfg.min_free,
                     policy=cfg.cache_policy, wait_limit=cfg.write_wait)

    def _check_new_hot_tier(self, extent_size: int) -> None:
        """A new filesystem: refuse a hot tier that cannot work with its extents before
        the superblock is in the bucket, so that another --extent-size can still be
        chosen (the extent size is fixed once the filesystem exists)."""
        hot = HotStore(os.path.join(self.cfg.cache_dir, "hot"))
        try:
            check_cache_size(self._space(SimpleNamespace(index=HotIndex(), hot=hot)),
                             extent_size)
        finally:
            hot.close()

    def prepare(self) -> None:
        """Everything that can fail with a user error, before mounting."""
        try:
            self._prepare()
        except ColdStoreError as e:
            if isinstance(e, UserError):  # misconfigured: says what to fix already
                raise
            raise bucket_failed_the_mount(self.cfg.cold_url, e) from None

    def _prepare(self) -> None:
        cfg = self.cfg
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        # The hot tier caches up to 2048 extent fds; allow that many and more.
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        check_fuse_available()
        self.notes += check_mountpoint(cfg.mountpoint)
        scheme, location, _prefix = parse_cold_url(cfg.cold_url)
        check_outside_mount(cfg.mountpoint, cfg.cache_dir,
                            location if scheme == "file" else None)
        self._lock_fd = lock_cache_dir(cfg.cache_dir)
        self.on_cache_dir_locked()
        self.cold = open_cold(cfg, self.stats)
        if cfg.meta_url:
            # With its writeback cache the kernel trusts its own idea of a file's size
            # and never takes a smaller one from us: another node's shorter rewrite
            # would read as the old length, zero-filled. Shared: off.
            cfg.writeback_cache = False
            self.shared, self.meta, self.sb, notes = attach_shared(cfg, self.cold)
            self.shared.open_session(socket.gethostname(), os.getpid(), cfg.mountpoint)
        else:
            self.meta, self.sb, self.lease, notes = attach(
                cfg, self.cold, force=cfg.force, state=self.state,
                check_new=self._check_new_hot_tier)
        self.notes += notes
        if self.meta.abandon_intents():
            log.info("uploads that failed or were interrupted before the last shutdown "
                     "were queued for cleanup")
        self.hot = HotStore(os.path.join(cfg.cache_dir, "hot"),
                            copy_writers=AROUND_INSTALL_THREADS)
        self.hot.copy_writers.start()  # on this, the main thread: they die with it
        self.engine = Engine(self.meta, self.hot, self.cold, self.sb.extent_size, self.stats,
                             cold_timeout=cfg.cold_timeout, state=self.state)
        self.engine.kernel_times = cfg.writeback_cache
        for problem in self.engine.load_index():
            log.error("hot tier check: %s", problem)
        for ino in self.meta.orphans():  # unlinked while open when the daemon stopped
            if self.meta.purge_orphan(ino):
                self.engine.drop_inode(ino)
        self.space = self._space(self.engine)
        check_cache_size(self.space, self.sb.extent_size)
        self.engine.space = self.space
        # Packs are not shared yet: on a shared namespace every extent is its own object.
        self.uploader = Uploader(self.engine, self.space, delay=cfg.upload_delay,
                                 parallel=cfg.upload_parallel,
                                 pack_below=0 if self.shared else cfg.pack_below,
                                 pack_size=cfg.pack_size)
        self.hints = HintQueue(self.engine)
        if self.shared:
            self._prepare_shared()
        else:
            self._prepare_lmdb()
        self.control = Control(self)
        if cfg.metrics_port:
            from . import metrics
            try:
                metrics.serve(self, cfg.metrics_port, cfg.metrics_addr)
            except OSError as e:
                raise UserError(f"cannot serve metrics on {cfg.metrics_addr}:{cfg.metrics_port} "
                                f"({e.strerror}): choose another --metrics-port") from None
        if self.shared:
            self.ops = SharedOperations(self.shared, self.view, self.engine,
                                        timeout=cfg.attr_timeout, control=self.control)
            self.tasks.append(self.ops.forget_purged)
        else:
            self.ops = Operations(self.meta, self.engine, timeout=cfg.attr_timeout,
                                  control=self.control)
        self.ops.enable_writeback_cache = cfg.writeback_cache
        self.ops.xattrs = cfg.xattr

    def _prepare_lmdb(self) -> None:
        """One node: the lease, LMDB checkpoints into the bucket, compaction of packs."""
        cfg = self.cfg
        self.gc = GarbageCollector(self.engine)
        self.compactor = Compactor(self.engine, dead_share=cfg.compact_dead,
                                   rate=cfg.compact_rate, pack_size=cfg.pack_size,
                                   interval=cfg.compact_interval)
        self.uploader.paused = self.gc.paused = self.compactor.paused = \
            lambda: self.state.fenced
        self.checkpointer = Checkpointer(self.engine, cfg.cache_dir,
                                         interval=cfg.checkpoint_interval,
                                         keep=cfg.checkpoint_keep)
        self.checkpointer.load()
        self.gc.still_ours = self.checkpointer.still_ours = self.lease.still_mine
        self.tasks = [self.uploader.run, self.gc.run, self.compactor.run,
                      self.checkpointer.run, self.lease.run, self.hints.run]

    def _prepare_shared(self) -> None:
        """Many nodes: a session instead of the lease, the shared engine as the
        namespace's home (no checkpoints), this node's view of it kept in step."""
        cfg = self.cfg
        self.view = SharedView(self.shared, self.engine, wait=cfg.cold_timeout)
        self.view.hurry = self.uploader.hurry
        self.uploader.on_finished = self.view.uploaded
        self.uploader.ids_ready = self.view.ids_ready
        # Objects another node may still be reading wait a while before they go.
        grace = max(2 * cfg.attr_timeout, 60.0)
        self.gc = GarbageCollector(self.engine, grace=grace)
        self.shared_gc = GarbageCollector(self.engine, meta=self.shared, grace=grace)
        self.lease = SessionKeeper(self.shared, self.state, self.stats,
                                   timeout=cfg.session_timeout)
        self.checkpointer = self.view  # sync --wait: the files' shared records
        self.uploader.paused = self.gc.paused = self.shared_gc.paused = \
            lambda: self.state.fenced
        self.gc.still_ours = self.shared_gc.still_ours = self.lease.still_mine
        self.tasks = [self.uploader.run, self.gc.run, self.shared_gc.run, self.view.run,
                      self.lease.run, self.hints.run]

    def _on_change(self, inodes, entries, everything) -> None:
        """Another node changed these (the change feed's thread): the kernel's cached
        attributes and names of them go, so stat and lookups ask again. Noted first,
        for lookups still reading (SharedOperations._answer)."""
        self.ops.changes.note(inodes, entries, everything)
        self.ops.changed_elsewhere(inodes)
        if everything:
            inodes = {pyfuse3.ROOT_INODE, *self.ops.lookups}
            entries = self.ops.held_names()
        missed = self._invalidate(inodes, entries)
        if missed:
            # Counted as looked up, but not in the kernel yet: a lookup's answer on
            # its way, which it will hold in a moment. Once more after that moment.
            time.sleep(INSTALL_WAIT_S)
            self._invalidate(missed, ())

    def _invalidate(self, inodes, entries) -> set[int]:
        """Drop the kernel's attributes and names of what it holds; returns the
        inodes counted as looked up that the kernel did not hold. (A name the kernel
        does not hold is no error, so a name on its way is not seen here: the window
        between a lookup's check and the kernel taking its answer stays.)"""
        missed = set()
        for ino in inodes:
            if self._held(ino):
                try:
                    pyfuse3.invalidate_inode(ino, attr_only=True)
                except OSError:
                    missed.add(ino)
        for parent, name in entries:
            if self._held(parent):
                try:
                    pyfuse3.invalidate_entry(parent, name)
                except OSError:
                    pass  # the kernel let go of the directory meanwhile
        return missed

    def _held(self, ino: int) -> bool:
        """Whether the kernel may hold the inode: one it looked up, or the root, which
        it holds from the mount on without a lookup."""
        return ino == pyfuse3.ROOT_INODE or ino in self.ops.lookups

    def fuse_options(self) -> set[str]:
        opts = {"fsname=tierfs", "subtype=tierfs"}
        if self.cfg.default_permissions:
            opts.add("default_permissions")
        allow_other = self.cfg.allow_other
        if allow_other is None:
            allow_other = os.getuid() == 0
        if allow_other:
            opts.add("allow_other")
        return opts

    def mount(self) -> None:
        try:
            pyfuse3.init(self.ops, self.cfg.mountpoint, self.fuse_options())
        except RuntimeError as e:
            raise UserError(f"mounting {self.cfg.mountpoint} failed ({e}): see the kernel log "
                            f"(dmesg) and check /dev/fuse access") from None
        self.mounted = True

    async def run(self, on_ready) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._signals)
            nursery.start_soon(self._announce_ready, on_ready)
            nursery.start_soon(self.control.serve, os.path.join(self.cfg.cache_dir, "control.sock"))
            nursery.start_soon(self._background)
            self.engine.give_way = request_wait.install(self.stats).give_way
            if self.shared is not None:
                self.feed = self.shared.watch(self._on_change)
            await pyfuse3.main()
            log.info("FUSE session ended; shutting down")
            # The kernel may give the mount's device number to the next mount from
            # now: this daemon's registry entry and guard must not stand for it.
            await trio.to_thread.run_sync(self._unregister)  # a file lock: not on the loop
            if self.guard_process is not None:
                self.guard_process.terminate()  # close() waits for it
            if self.feed is not None:  # no kernel to tell any more
                feed, self.feed = self.feed, None
                await trio.to_thread.run_sync(feed.stop)
            sdnotify.notify("STOPPING=1")  # under systemd: the final flush may take a while
            nursery.cancel_scope.cancel()
        await self._final_flush()
        await self._release_lease()

    async def _release_lease(self) -> None:
        """Mark the lease (or shared session) released, within --cold-timeout (a silent
        bucket or database must not keep the daemon from exiting; the lease or session
        then simply expires). Not after a final checkpoint that failed: the bucket's
        newest checkpoint lacks this node's last changes, which its cache dir holds."""
        lease, self.lease = self.lease, None
        if not self.checkpointed and not self.state.fenced:
            log.warning("the final metadata checkpoint did not complete: the lease stays "
                        "held (it lapses as a dead node's does), so that no other node starts "
                        "at once from an older checkpoint; mount this cache dir again to finish")
            return
        with trio.move_on_after(self.cfg.cold_timeout):
            try:
                await trio.to_thread.run_sync(lease.release, abandon_on_cancel=True)
            except (ColdStoreError, FsError) as e:
                log.warning("releasing this node's lease or session failed (%s); it "
                            "expires by itself", e)

    async def _background(self) -> None:
        async with trio.open_nursery() as nursery:
            self.engine.nursery = nursery
            for task in self.tasks:
                nursery.start_soon(self._supervised, task)

    async def _supervised(self, task) -> None:
        """Run a background task forever: a bug in one must not take the mount down."""
        while True:
            try:
                await task()
                return
            except Exception:
                log.exception("background task %s failed; restarting it",
                              getattr(task, "__qualname__", task))
                await trio.sleep(1.0)

    async def _final_flush(self) -> None:
        """After the kernel let go: make local state durable, then try to upload
        what is dirty for a bounded time (the rest uploads on the next mount)."""
        await self.engine.sync_all()
        if self.state.fenced:
            self._write_exit_report()
            return
        if self.engine.index.dirty:
            log.info("uploading %d dirty extents before exit", len(self.engine.index.dirty))
        with trio.move_on_after(self.cfg.unmount_upload_timeout):
            async with trio.open_nursery() as nursery:
                self.engine.nursery = nursery
                nursery.start_soon(self.uploader.run)
                nursery.start_soon(self._report_flush_progress)
                try:
                    try:
                        await self.uploader.flush(None)
                    except HotFilesLost as e:  # no wait uploads them: checkpoint the rest
                        log.error("%s", e)
                    await self.checkpointer.checkpoint()
                    self.checkpointed = True
                    await self.gc.collect()
                except (ColdStoreError, FsError, CopyFailed) as e:  # bucket, database, disk
                    log.warning("final metadata checkpoint failed: %s", e)
                except Fenced:
                    pass  # the exit report says so
                nursery.cancel_scope.cancel()
        left = len(self.engine.index.dirty) - len(self.uploader.lost_now())
        if left:
            log.warning("%d extents still dirty at exit; they upload on the next mount", left)
        self._write_exit_report()

    async def _report_flush_progress(self) -> None:
        """While unmount uploads, tell `tierfs umount` (which waits for this pid
        and shows progress on a terminal) how much is left."""
        index = self.engine.index
        start = index.dirty_bytes
        deadline = trio.current_time() + self.cfg.unmount_upload_timeout
        while index.dirty:
            report = {"pid": os.getpid(), "stopping": True, "start_dirty_bytes": start,
                      "dirty_bytes": index.dirty_bytes, "dirty_extents": len(index.dirty),
                      "seconds_left": max(0.0, deadline - trio.current_time()),
                      "fenced_by": None}
            await trio.to_thread.run_sync(exit_report.write, self.cfg.cache_dir, report)
            await trio.sleep(0.25)

    def _write_exit_report(self) -> None:
        """What `tierfs umount` tells the user once this daemon is gone."""
        index = self.engine.index
        lost = self.uploader.lost_now()  # dirty, but their hot files are gone
        report = {"pid": os.getpid(), "dirty_bytes": index.dirty_bytes,
                  "dirty_extents": len(index.dirty), "fenced_by": self.state.fenced_by,
                  "checkpointed": self.checkpointed, "lost_bytes": sum(lost.values()),
                  "lost_extents": len(lost)}
        exit_report.write(self.cfg.cache_dir, report)

    async def _announce_ready(self, on_ready) -> None:
        # The mount answers only once pyfuse3.main runs; stat it from a thread.
        st = await trio.to_thread.run_sync(os.stat, self.cfg.mountpoint)
        set_bdi_readahead(st.st_dev, self.cfg.read_ahead_kb)
        # Clients of a --no-xattr mount find the daemon here, and a later mount or
        # umount tells from it whether a mount that hangs had its daemon die.
        try:
            self._registered = await trio.to_thread.run_sync(  # a file lock: not on the loop
                registry.register, st.st_dev, self.control.info())
        except OSError as e:
            if not self.cfg.xattr:
                raise  # its clients could not find it
            log.info("mount not registered (%s): a hung mount after a crash will need "
                     "its connection aborted by hand", e)
        try:  # from this, the main thread: the guard learns when it exits
            self.guard_process = guard.start(os.getpid(), st.st_dev, self.cfg.mountpoint,
                                             self.cfg.log_path)
        except OSError as e:
            log.warning("connection guard not started (%s): if this daemon is killed while "
                        "a thread of it is stuck in the kernel, the mount hangs until "
                        "tierfs umount", e)
        on_ready()

    async def _signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for sig in signals:
                log.info("signal %d: unmounting", sig)
                pyfuse3.terminate()
                return

    def _unregister(self) -> None:
        if self._registered:
            registry.unregister(self._registered)
            self._registered = None

    def close(self) -> None:
        served = self.mounted
        if self.guard_process is not None:  # a clean exit: nothing to abort
            guard.stop(self.guard_process)
            self.guard_process = None
        self._unregister()
        if self.mounted:
            try:
                pyfuse3.close(unmount=True)
            except Exception as e:  # already unmounted by fusermount3 -u
                log.debug("close: %s", e)
            self.mounted = False
        if self.engine is not None:
            self.hot.close()
        if self.lease is not None:  # run() did not get to _release_lease
            lease, self.lease = self.lease, None
            if served and not self.checkpointed:
                # It ended with an error before its final checkpoint landed: as in
                # _release_lease, the lease stays held and lapses.
                log.warning("the daemon stopped before its final metadata checkpoint: the "
                            "lease stays held (it lapses as a dead node's does); mount this "
                            "cache dir again to finish")
            elif not served and self.shared is None:
                # Refused before it served (a check after attach failed): it wrote
                # nothing, so it puts back the lease it found instead of posing as the
                # last writer, whose cache dir would then be refused as stale.
                lease.abandon()
            else:
                lease.release()
        if self.feed is not None:
            self.feed.stop()
            self.feed = None
        if self.meta is not None:
            self.meta.close()
            self.meta = None
        if self.shared is not None:
            self.shared.close()
            self.shared = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
