"""Assemble the daemon: stores, engine, FUSE adapter, background tasks; run them
in one trio nursery and shut down cleanly on unmount or signal."""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import signal
import stat
import time
import uuid

import pyfuse3
import trio

from . import cold as cold_mod
from .config import MountConfig
from .errors import ObjectNotFound, UserError
from .fs.control import Control
from .fs.ops import Operations
from .hot import HotStore
from .meta import MetaStore
from .meta.schema import FORMAT_VERSION, SUPERBLOCK_OBJECT, Superblock
from .mountpoint import check_fuse_available, check_mountpoint
from .tier.engine import Engine
from .tier.gc import GarbageCollector
from .tier.space import Space
from .tier.stats import Stats
from .tier.uploader import Uploader

log = logging.getLogger("tierfs")


def lock_cache_dir(cache_dir: str) -> int:
    """Hold an exclusive lock on the cache dir for the daemon's lifetime."""
    try:
        os.makedirs(cache_dir, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create cache dir {cache_dir}: {e.strerror}") from None
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


def open_filesystem(cfg: MountConfig, cold, meta: MetaStore) -> tuple[Superblock, bool]:
    """Find or create the filesystem at the cold location and match it with the
    cache dir. Returns (superblock, created)."""
    try:
        raw = cold.get(SUPERBLOCK_OBJECT)
    except ObjectNotFound:
        raw = None
    local = meta.superblock()
    if raw is None:
        if cold.list(""):
            raise UserError(f"{cold.describe()} holds data that is not a tierfs filesystem: "
                            f"use an empty location")
        if local is not None:
            raise UserError(f"cache dir {cfg.cache_dir} belongs to filesystem {local.fs_id}, "
                            f"which is not at {cold.describe()}: use the right URL or a new cache dir")
        sb = Superblock(fs_id=str(uuid.uuid4()), extent_size=cfg.extent_size,
                        created_ns=time.time_ns())
        cold.put(SUPERBLOCK_OBJECT, sb.encode())
        meta.format(sb, os.getuid(), os.getgid())
        return sb, True
    try:
        sb = Superblock.decode(raw)
    except (ValueError, KeyError):
        raise UserError(f"{cold.describe()}/{SUPERBLOCK_OBJECT} is not a valid tierfs "
                        f"superblock: use another location") from None
    if sb.format_version != FORMAT_VERSION:
        raise UserError(f"filesystem at {cold.describe()} has format version {sb.format_version}, "
                        f"this tierfs reads version {FORMAT_VERSION}: use a matching tierfs release")
    if local is None:
        raise UserError(f"cache dir {cfg.cache_dir} is empty but {cold.describe()} holds filesystem "
                        f"{sb.fs_id}: mount with the cache dir it was created with")
    if local.fs_id != sb.fs_id:
        raise UserError(f"cache dir {cfg.cache_dir} belongs to filesystem {local.fs_id}, not to "
                        f"{sb.fs_id} at {cold.describe()}: use the matching cache dir")
    return local, False


def set_bdi_readahead(mountpoint: str, kb: int) -> None:
    """Raise the FUSE connection's readahead: bigger reads, fewer round trips."""
    try:
        dev = os.stat(mountpoint).st_dev
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
        self._lock_fd = None
        self.meta = None
        self.engine = None
        self.mounted = False

    def prepare(self) -> None:
        """Everything that can fail with a user error, before mounting."""
        cfg = self.cfg
        check_fuse_available()
        self.notes += check_mountpoint(cfg.mountpoint)
        self._lock_fd = lock_cache_dir(cfg.cache_dir)
        self.cold = cold_mod.open_store(cfg.cold_url, s3_endpoint=cfg.s3_endpoint,
                                        s3_region=cfg.s3_region, s3_path_style=cfg.s3_path_style)
        self.cold.check()
        self.meta = MetaStore(os.path.join(cfg.cache_dir, "meta"))
        self.sb, created = open_filesystem(cfg, self.cold, self.meta)
        if created:
            self.notes.append(f"created a new tierfs filesystem {self.sb.fs_id} at "
                              f"{self.cold.describe()} (extent size {self.sb.extent_size})")
        self.hot = HotStore(os.path.join(cfg.cache_dir, "hot"))
        self.engine = Engine(self.meta, self.hot, self.cold, self.sb.extent_size, self.stats)
        for problem in self.engine.load_index():
            log.warning("hot tier check: %s", problem)
        for ino in self.meta.orphans():  # unlinked while open when the daemon stopped
            if self.meta.purge_orphan(ino):
                self.engine.drop_inode(ino)
        self.space = Space(self.engine, cache_size=cfg.cache_size, min_free=cfg.min_free,
                           policy=cfg.cache_policy)
        self.engine.space = self.space
        self.uploader = Uploader(self.engine, self.space, delay=cfg.upload_delay,
                                 parallel=cfg.upload_parallel)
        self.gc = GarbageCollector(self.engine)
        self.control = Control(self)
        self.ops = Operations(self.meta, self.engine, timeout=cfg.attr_timeout,
                              control=self.control)
        self.ops.enable_writeback_cache = cfg.writeback_cache

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
            nursery.start_soon(self._signals, nursery)
            nursery.start_soon(self._announce_ready, on_ready)
            nursery.start_soon(self.control.serve, os.path.join(self.cfg.cache_dir, "control.sock"))
            nursery.start_soon(self._background)
            await pyfuse3.main()
            log.info("FUSE session ended; shutting down")
            nursery.cancel_scope.cancel()
        await self._final_flush()

    async def _background(self) -> None:
        async with trio.open_nursery() as nursery:
            self.engine.nursery = nursery
            nursery.start_soon(self.uploader.run)
            nursery.start_soon(self.gc.run)

    async def _final_flush(self) -> None:
        """After the kernel let go: make local state durable, then try to upload
        what is dirty for a bounded time (the rest uploads on the next mount)."""
        await self.engine.sync_all()
        if not self.engine.index.dirty:
            await self.gc.collect()
            return
        log.info("uploading %d dirty extents before exit", len(self.engine.index.dirty))
        with trio.move_on_after(self.cfg.unmount_upload_timeout):
            async with trio.open_nursery() as nursery:
                self.engine.nursery = nursery
                nursery.start_soon(self.uploader.run)
                await self.uploader.flush(None)
                await self.gc.collect()
                nursery.cancel_scope.cancel()
        if self.engine.index.dirty:
            log.warning("%d extents still dirty at exit; they upload on the next mount",
                        len(self.engine.index.dirty))

    async def _announce_ready(self, on_ready) -> None:
        # The mount answers only once pyfuse3.main runs; stat it from a thread.
        await trio.to_thread.run_sync(os.stat, self.cfg.mountpoint)
        set_bdi_readahead(self.cfg.mountpoint, self.cfg.read_ahead_kb)
        on_ready()

    async def _signals(self, nursery) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for sig in signals:
                log.info("signal %d: unmounting", sig)
                pyfuse3.terminate()
                return

    def close(self) -> None:
        if self.mounted:
            try:
                pyfuse3.close(unmount=True)
            except Exception as e:  # already unmounted by fusermount3 -u
                log.debug("close: %s", e)
            self.mounted = False
        if self.engine is not None:
            self.hot.close()
        if self.meta is not None:
            self.meta.close()
            self.meta = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
