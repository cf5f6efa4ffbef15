"""Open the filesystem at a cold location for this node: find or create its
superblock, take the writer lease, and attach the cache dir's metadata
(recovering it from the newest checkpoint when the cache dir is new)."""
from __future__ import annotations

import logging
import os
import time
import uuid

from . import cold as cold_mod
from .cold.base import PROBE_KEY
from .cold.faulty import ControlledFaults
from .cold.retry import RetryingStore
from .errors import ColdConfigError, ColdStoreError, ObjectNotFound, UserError
from .meta import MetaStore
from .meta.store import open_engine
from .meta.schema import FORMAT_VERSION, READABLE_FORMATS, SUPERBLOCK_OBJECT, Superblock
from .tier.lease import LEASE_KEY, Lease
from .tier.recover import recover

log = logging.getLogger(__name__)


def open_cold(cfg, stats=None):
    """The configured object store, with retries (and test faults if asked)."""
    store = cold_mod.open_store(cfg.cold_url, s3_endpoint=cfg.s3_endpoint,
                                s3_region=cfg.s3_region, s3_path_style=cfg.s3_path_style,
                                timeout=cfg.cold_timeout)
    try:
        RetryingStore(store, timeout=cfg.cold_timeout).check()  # throttling is retried
    except ColdConfigError:
        raise
    except ColdStoreError as e:  # still failing after --cold-timeout of retries
        raise bucket_failed_the_mount(store.describe(), e) from None
    if getattr(cfg, "fault_file", None):
        store = ControlledFaults(store, cfg.fault_file)
    return RetryingStore(store, timeout=cfg.cold_timeout, stats=stats)


def bucket_failed_the_mount(cold_url: str, e: Exception) -> UserError:
    """The bucket failed the requests that open the filesystem past the retries (an
    outage, throttling, 5xx): one line for the user, not an internal error nor a
    setting to fix."""
    return UserError(f"{cold_url} failed the requests that open the filesystem ({e}): "
                     f"check that the bucket answers, then try again")


def read_superblock(cold) -> Superblock | None:
    """The filesystem's superblock, None for an empty location; refuses others."""
    try:
        raw = cold.get(SUPERBLOCK_OBJECT)
    except ObjectNotFound:
        # Another node's check may be probing it right now (or died while it did).
        if [k for k in cold.list("") if k != LEASE_KEY and not k.startswith(PROBE_KEY)]:
            raise UserError(f"{cold.describe()} holds data that is not a tierfs filesystem: "
                            f"use an empty location") from None
        return None
    try:
        sb = Superblock.decode(raw)
    except (ValueError, KeyError):
        raise UserError(f"{cold.describe()}/{SUPERBLOCK_OBJECT} is not a valid tierfs "
                        f"superblock: use another location") from None
    if sb.format_version not in READABLE_FORMATS:
        raise UserError(f"filesystem at {cold.describe()} has format version {sb.format_version}, "
                        f"this tierfs reads versions {READABLE_FORMATS[0]} to {FORMAT_VERSION}: "
                        f"use a newer tierfs release")
    return sb


def upgrade(cold, meta, sb: Superblock) -> str | None:
    """Bring an older format up to this release's, in place: format 2 only adds
    records for packs, so nothing is rewritten; the bucket's superblock then keeps
    releases that cannot read packs out. Returns a note for the user, or None."""
    if sb.format_version >= FORMAT_VERSION:
        return None
    old = sb.format_version
    sb.format_version = FORMAT_VERSION
    meta.put_superblock(sb)
    cold.put(SUPERBLOCK_OBJECT, sb.encode())
    return (f"upgraded filesystem {sb.fs_id} from format {old} to {FORMAT_VERSION} "
            f"(small files are packed from now on; older releases cannot mount it)")


def meta_dir(cache_dir: str) -> str:
    return os.path.join(cache_dir, "meta")


def open_meta(cfg) -> MetaStore:
    return MetaStore(meta_dir(cfg.cache_dir), map_size=cfg.meta_map_size,
                     max_map_size=cfg.meta_max_map_size)


def has_metadata(cache_dir: str) -> bool:
    return os.path.exists(os.path.join(meta_dir(cache_dir), "data.mdb"))


def attach(cfg, cold, *, force: bool = False, allow_recover: bool = True, state=None,
           check_new=None):
    """Returns (meta store, superblock, lease, notes for the user). check_new(extent
    size) may refuse a new filesystem (UserError) before anything is written for it."""
    notes = []
    sb = read_superblock(cold)
    if sb is not None and sb.shared:
        raise UserError(f"the namespace of the filesystem at {cold.describe()} is kept in a "
                        f"shared database: mount it with --meta-url postgresql://...")
    local_exists = has_metadata(cfg.cache_dir)
    if sb is None and local_exists:
        probe = open_meta(cfg)
        local = probe.superblock()
        probe.close()  # LMDB allows one open environment per file and process
        if local is not None:
            raise UserError(f"cache dir {cfg.cache_dir} belongs to filesystem {local.fs_id}, "
                            f"which is not at {cold.describe()}: use the right URL or a new "
                            f"cache dir")
    lease = Lease(cold, cfg.cache_dir, cfg.mountpoint, ttl=cfg.lease_ttl, state=state)
    took = lease.acquire(force)
    if took:
        notes.append(took)
    try:
        meta, more = _attach_metadata(cfg, cold, sb, allow_recover, lease, check_new)
        if sb is not None:
            note = upgrade(cold, meta, sb)
            if note:
                log.info("%s", note)
                more.append(note)
    except BaseException:
        lease.abandon()  # a refused mount must not keep others out, nor pose as the writer
        raise
    return meta, meta.superblock(), lease, notes + more


def _attach_metadata(cfg, cold, sb, allow_recover: bool, lease: Lease, check_new=None):
    """Create, recover or open the cache dir's metadata. Returns (store, notes)."""
    if sb is None:
        if check_new is not None:
            check_new(cfg.extent_size)
        sb = Superblock(fs_id=str(uuid.uuid4()), extent_size=cfg.extent_size,
                        created_ns=time.time_ns())
        cold.put(SUPERBLOCK_OBJECT, sb.encode())
        meta = open_meta(cfg)
        meta.format(sb, os.getuid(), os.getgid())
        return meta, [f"created a new tierfs filesystem {sb.fs_id} at {cold.describe()} "
                      f"(extent size {sb.extent_size})"]
    if not has_metadata(cfg.cache_dir):
        if not allow_recover:
            raise UserError(f"cache dir {cfg.cache_dir} holds no metadata of {cold.describe()}")
        meta, report = recover(cold, meta_dir(cfg.cache_dir))
        for line in report.lines():
            log.info("recovery: %s", line)  # the caller prints the report; once is enough
        return meta, report.lines()
    meta = open_meta(cfg)
    local = meta.superblock()
    if local is None or local.fs_id != sb.fs_id:
        meta.close()
        raise UserError(f"cache dir {cfg.cache_dir} belongs to filesystem "
                        f"{local.fs_id if local else '(none)'}, not to {sb.fs_id} at "
                        f"{cold.describe()}: use the matching cache dir")
    if lease.last_writer_elsewhere():
        meta.close()
        raise UserError(
            f"cache dir {cfg.cache_dir} holds older metadata of this filesystem: "
            f"{Lease.describe(lease.previous)} has written it since; move the cache dir "
            f"away (or use an empty --cache-dir) to mount from the bucket's newest checkpoint")
    return meta, []


def attach_shared(cfg, cold):
    """A namespace in a shared engine (--meta-url): returns (shared store, this node's
    own store in the cache dir, superblock, notes for the user)."""
    notes = []
    found = read_superblock(cold)
    shared = MetaStore(open_engine(cfg.meta_url, wait=cfg.meta_timeout))
    try:
        sb = shared.superblock()
        if sb is None and found is not None:
            raise UserError(
                f"{cold.describe()} holds filesystem {found.fs_id}, whose namespace is not in "
                f"this database: move it there with `tierfs dump` and `tierfs load`, or use "
                f"an empty bucket location")
        if sb is None:
            new = Superblock(fs_id=str(uuid.uuid4()), extent_size=cfg.extent_size,
                             created_ns=time.time_ns(), shared=True)
            sb = shared.claim(new, os.getuid(), os.getgid())
            if sb is new:
                notes.append(f"created a new tierfs filesystem {sb.fs_id} at "
                             f"{cold.describe()} with its namespace in the shared database "
                             f"(extent size {sb.extent_size})")
        if found is not None and found.fs_id != sb.fs_id:
            raise UserError(f"the database holds filesystem {sb.fs_id}, but {cold.describe()} "
                            f"holds {found.fs_id}: use the matching bucket location or "
                            f"database schema")
        if found is not None and not found.shared:
            lease = Lease(cold, cfg.cache_dir, cfg.mountpoint).read()
            if lease and not lease.get("released") and lease.get("expires", 0) > time.time():
                raise UserError(f"{Lease.describe(lease)} mounts this filesystem with its "
                                f"namespace in LMDB: unmount it there first")
        sb.shared = True
        if found is None or not found.shared or found.format_version != sb.format_version:
            note = upgrade(cold, shared, sb)
            if note:
                notes.append(note)
            else:
                shared.put_superblock(sb)
                cold.put(SUPERBLOCK_OBJECT, sb.encode())
        local = _own_store(cfg, sb)
    except BaseException:
        shared.close()
        raise
    return shared, local, sb, notes


def _own_store(cfg, sb: Superblock) -> MetaStore:
    """This node's own LMDB in the cache dir: what it holds of a shared namespace.
    One that belongs to another filesystem is refused; a missing one starts empty."""
    local = open_meta(cfg)
    mine = local.superblock()
    if mine is None:
        local.format(sb, os.getuid(), os.getgid())
    elif mine.fs_id != sb.fs_id or not mine.shared:
        local.close()
        what = (f"filesystem {mine.fs_id}" if mine.fs_id != sb.fs_id
                else "the one-node (LMDB) namespace of this filesystem")
        raise UserError(f"cache dir {cfg.cache_dir} holds {what}: use an empty --cache-dir "
                        f"with --meta-url")
    return local
