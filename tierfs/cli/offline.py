"""`tierfs recover` and `tierfs fsck`: work on a cache dir and its bucket while
nothing is mounted."""
from __future__ import annotations

import logging
import os
import sys

from ..config import MountConfig
from ..errors import UserError
from .progress import Progress, plural

FSCK_TRASH_WAIT = 600.0  # seconds fsck waits for the hot copies it removed to be emptied


def s3_args(p) -> None:
    """How to reach an S3 bucket, for the commands that open one without a mount."""
    p.add_argument("--s3-endpoint", default=None)
    p.add_argument("--s3-region", default=None)
    p.add_argument("--s3-path-style", action="store_true")


def _location_args(p, shared: bool = False) -> None:
    p.add_argument("cold_url", metavar="COLD_URL", help="file:///path or s3://bucket/prefix")
    p.add_argument("--cache-dir", required=not shared, help="the node's cache dir")
    if shared:
        p.add_argument("--meta-url", default=None,
                       help="check a shared namespace (postgresql://...) instead of a cache dir")
    s3_args(p)


def add_parsers(sub) -> None:
    p = sub.add_parser("recover", help="rebuild a lost node's metadata from the bucket",
                       description="Rebuild the namespace in a new, empty cache dir from the "
                       "newest metadata checkpoint in the bucket, and report what was lost. "
                       "(Mounting with an empty cache dir does the same.)")
    _location_args(p)
    p.add_argument("--force", action="store_true",
                   help="take over from a node that still holds the writer lease (known dead)")
    p = sub.add_parser("fsck", help="check (and repair) a cache dir against its bucket",
                       description="Offline check of metadata, hot tier files and bucket "
                       "objects. Exit status: 0 clean, 1 problems repaired, 4 problems left "
                       "(found without --repair, or that no repair can fix).")
    _location_args(p, shared=True)
    p.add_argument("--repair", action="store_true", help="fix what can be fixed safely")
    p.add_argument("--verify-data", action="store_true",
                   help="also read every clean extent (hot and cold) and verify checksums")


def _config(args) -> MountConfig:
    cfg = MountConfig(args.cold_url, "", os.path.abspath(args.cache_dir or ""),
                      s3_endpoint=args.s3_endpoint, s3_region=args.s3_region,
                      s3_path_style=args.s3_path_style)
    return cfg


def _log_errors_to_stderr() -> None:
    """Only errors of the library reach the terminal: what it logs at lower levels
    (the recovery report, retries) is the daemon log's business, and the command
    prints its own report on stdout. Without a handler Python would print every
    warning on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.ERROR)
    handler.setFormatter(logging.Formatter("tierfs: %(message)s"))
    logging.getLogger().addHandler(handler)


def cmd_recover(args) -> int:
    from ..filesystem import attach, has_metadata, open_cold
    from ..runtime import lock_cache_dir
    _log_errors_to_stderr()
    cfg = _config(args)
    lock = lock_cache_dir(cfg.cache_dir)
    try:
        if has_metadata(cfg.cache_dir):
            raise UserError(f"cache dir {cfg.cache_dir} already holds metadata: recover into a "
                            f"new, empty cache dir")
        cold = open_cold(cfg)
        meta, _sb, lease, notes = attach(cfg, cold, force=args.force)
        for line in notes:
            print(line)
        meta.close()
        lease.release()
        print(f"ready: tierfs mount {args.cold_url} MOUNTPOINT --cache-dir {cfg.cache_dir}")
        return 0
    finally:
        os.close(lock)


def cmd_fsck(args) -> int:
    from ..filesystem import has_metadata, meta_dir, open_cold, read_superblock
    from ..hot import HotStore
    from ..meta import MetaStore
    from ..runtime import lock_cache_dir
    from ..tier.fsck import Fsck
    _log_errors_to_stderr()
    if args.meta_url:
        return _fsck_shared(args)
    if not args.cache_dir:
        raise UserError("no --cache-dir given: name the node's cache dir (or --meta-url for "
                        "a shared namespace)")
    cfg = _config(args)
    if not has_metadata(cfg.cache_dir):
        raise UserError(f"{cfg.cache_dir} holds no tierfs metadata: give the cache dir of a node")
    lock = lock_cache_dir(cfg.cache_dir)
    try:
        cold = open_cold(cfg)
        sb = read_superblock(cold)
        meta = MetaStore(meta_dir(cfg.cache_dir))
        local = meta.superblock()
        if sb is None or local is None or local.fs_id != sb.fs_id:
            raise UserError(f"cache dir {cfg.cache_dir} does not belong to the filesystem at "
                            f"{cold.describe()}")
        hot = HotStore(os.path.join(cfg.cache_dir, "hot"))
        with Progress("verifying data", None) as progress:
            findings = Fsck(meta, hot, cold, local.extent_size, repair=args.repair,
                            verify_data=args.verify_data, on_progress=progress.update).run()
        hot.trash.settle(FSCK_TRASH_WAIT)  # what the repair removed, emptied before it says so
        hot.close()
        meta.close()
    finally:
        os.close(lock)
    return _report(findings, f"{cfg.cache_dir} and {args.cold_url}", args.repair)


def _fsck_shared(args) -> int:
    """fsck of a namespace in a shared engine against its bucket (nodes may be
    mounted: what their sessions hold is left alone)."""
    from ..filesystem import open_cold, read_superblock
    from ..meta import MetaStore
    from ..tier.fsck import Fsck
    cfg = _config(args)
    cold = open_cold(cfg)
    sb = read_superblock(cold)
    meta = MetaStore(args.meta_url)
    try:
        shared = meta.superblock()
        if sb is None or shared is None or shared.fs_id != sb.fs_id:
            raise UserError(f"the database does not hold the namespace of the filesystem at "
                            f"{cold.describe()}")
        findings = Fsck(meta, None, cold, shared.extent_size, repair=args.repair,
                        verify_data=args.verify_data).run()
    finally:
        meta.close()
    return _report(findings, f"the shared namespace and {args.cold_url}", args.repair)


def _report(findings, what: str, repair: bool) -> int:
    for f in findings:
        print(f"{f.problem}" + (f": {f.fix}" if f.fix else ""))
    if not findings:
        print(f"{what}: clean")
        return 0
    if not repair:
        print(plural(len(findings), "problem") + "; run again with --repair to fix them")
        return 4
    # A problem repair cannot fix (data lost, no good copy anywhere) is still there.
    left = sum(1 for f in findings if not f.fix)
    if not left:
        print(plural(len(findings), "problem") + " repaired")
        return 1
    fixed = len(findings) - left
    print((f"{plural(fixed, 'problem')} repaired, {left}" if fixed else plural(left, "problem"))
          + " left that no repair can fix")
    return 4


COMMANDS = {"recover": cmd_recover, "fsck": cmd_fsck}
