"""`tierfs dump` and `tierfs load`: move a namespace between metadata engines
(meta/dump.py has the rules and the file format)."""
from __future__ import annotations

import os
import shutil
import tempfile

from ..errors import UserError
from .offline import _log_errors_to_stderr, s3_args


def add_parsers(sub) -> None:
    p = sub.add_parser("dump", help="write a filesystem's namespace to a file",
                       description="Write the namespace (metadata) of a filesystem to FILE: from "
                       "a node's cache dir (nothing mounted on it), a postgresql:// URL (no "
                       "mount open on it), or a bucket location (its newest metadata "
                       "checkpoint, as a new node would recover it). Data not in the bucket "
                       "yet is refused: run `tierfs sync --wait` first.")
    p.add_argument("source", metavar="SOURCE", help="cache dir, postgresql:// URL or COLD_URL")
    p.add_argument("file", metavar="FILE")
    s3_args(p)
    p = sub.add_parser("load", help="write a dumped namespace into an empty engine",
                       description="Write the namespace in FILE (from `tierfs dump`) into "
                       "TARGET: a new cache dir, or an empty postgresql:// database schema.")
    p.add_argument("file", metavar="FILE")
    p.add_argument("target", metavar="TARGET", help="new cache dir or postgresql:// URL")


def _is_bucket(location: str) -> bool:
    return location.startswith(("s3://", "file://"))


def cmd_dump(args) -> int:
    from ..meta import MetaStore
    from ..meta.dump import dump
    from ..meta.kv import is_postgres_url
    _log_errors_to_stderr()
    if is_postgres_url(args.source):
        meta = MetaStore(args.source)
        try:
            count = dump(meta, args.file)
        finally:
            meta.close()
    elif _is_bucket(args.source):
        count = _dump_bucket(args)
    else:
        count = _dump_cache_dir(os.path.abspath(args.source), args.file)
    print(f"dumped {count} records to {args.file}")
    return 0


def _dump_cache_dir(cache_dir: str, path: str) -> int:
    from ..filesystem import has_metadata, meta_dir
    from ..meta import MetaStore
    from ..meta.dump import dump
    from ..runtime import lock_cache_dir
    if not has_metadata(cache_dir):
        raise UserError(f"{cache_dir} holds no tierfs metadata: give a node's cache dir")
    lock = lock_cache_dir(cache_dir)  # refuses while a daemon runs on it
    try:
        meta = MetaStore(meta_dir(cache_dir))
        try:
            return dump(meta, path)
        finally:
            meta.close()
    finally:
        os.close(lock)


def _dump_bucket(args) -> int:
    from ..config import MountConfig
    from ..filesystem import open_cold
    from ..meta.dump import dump
    from ..tier.recover import recover
    cfg = MountConfig(args.source, "", "", s3_endpoint=args.s3_endpoint,
                      s3_region=args.s3_region, s3_path_style=args.s3_path_style)
    tmp = tempfile.mkdtemp(prefix="tierfs-dump-")
    try:
        meta, report = recover(open_cold(cfg), os.path.join(tmp, "meta"))
        try:
            for line in report.lines():
                print(line)
            return dump(meta, args.file)
        finally:
            meta.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def cmd_load(args) -> int:
    from ..meta import MetaStore
    from ..meta.dump import check, load
    from ..meta.kv import is_postgres_url
    _log_errors_to_stderr()
    header = check(args.file)  # before anything is created
    lock = None
    if is_postgres_url(args.target):
        where = args.target
        meta = MetaStore(where)
    else:
        from ..filesystem import has_metadata, meta_dir
        from ..runtime import lock_cache_dir
        where = os.path.abspath(args.target)
        if has_metadata(where):
            raise UserError(f"cache dir {where} already holds metadata: load into a new, "
                            "empty cache dir")
        lock = lock_cache_dir(where)  # no daemon starts on it while it is written
        meta = MetaStore(meta_dir(where))
    try:
        load(args.file, header, meta)
    finally:
        meta.close()
        if lock is not None:
            os.close(lock)
    print(f"loaded {header['records']} records of filesystem {header['fs_id']} into {where}")
    return 0


COMMANDS = {"dump": cmd_dump, "load": cmd_load}
