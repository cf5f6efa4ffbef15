"""The `tierfs` command: one entry point, one subcommand per verb."""
from __future__ import annotations

import argparse
import json
import os
import sys

from .. import __version__
from ..config import MountConfig, format_size, parse_size
from ..errors import UserError
from . import offline, tiering


def _add_mount_parser(sub) -> None:
    d = MountConfig("", "", "")
    p = sub.add_parser("mount", help="mount a filesystem (creating it on first use)",
                       description="Mount the tierfs filesystem stored at COLD_URL on MOUNTPOINT. "
                       "The first mount of an empty location creates the filesystem.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("cold_url", metavar="COLD_URL",
                   help="where cold data lives: file:///path or s3://bucket/prefix")
    p.add_argument("mountpoint", metavar="MOUNTPOINT", help="an empty directory")
    p.add_argument("--cache-dir", required=True,
                   help="directory on local NVMe for the hot tier and the metadata")
    p.add_argument("--foreground", action="store_true", help="stay in the foreground")
    p.add_argument("--extent-size", default="4M",
                   help="extent size of a NEW filesystem (fixed once created)")
    p.add_argument("--cache-size", default="0",
                   help="hot tier high watermark, e.g. 200G (0: 90%% of the cache disk)")
    p.add_argument("--min-free", default="1G", help="free space to keep on the cache disk")
    p.add_argument("--upload-delay", type=float, default=d.upload_delay,
                   help="seconds after the last write before an extent is uploaded")
    p.add_argument("--upload-parallel", type=int, default=d.upload_parallel,
                   help="concurrent uploads")
    p.add_argument("--cache-policy", choices=("lru", "no-replace"), default=d.cache_policy,
                   help="eviction policy of the hot tier")
    p.add_argument("--attr-timeout", type=float, default=d.attr_timeout,
                   help="seconds the kernel may cache attributes and names")
    p.add_argument("--no-allow-other", dest="allow_other", action="store_const", const=False,
                   default=None, help="make the mount visible only to the user who mounted it "
                   "(default: visible to all users when run as root)")
    p.add_argument("--no-default-permissions", dest="default_permissions", action="store_false",
                   help="do not let the kernel check file permissions")
    p.add_argument("--no-writeback-cache", dest="writeback_cache", action="store_false",
                   help="disable the kernel's writeback cache")
    p.add_argument("--read-ahead-kb", type=int, default=d.read_ahead_kb,
                   help="kernel readahead of the mount in KiB")
    p.add_argument("--s3-endpoint", default=None,
                   help="S3 endpoint URL (default: AWS_ENDPOINT_URL or AWS)")
    p.add_argument("--s3-region", default=None, help="S3 region")
    p.add_argument("--s3-path-style", action="store_true", help="path-style S3 addressing")
    p.add_argument("--checkpoint-interval", type=float, default=d.checkpoint_interval,
                   help="seconds between metadata checkpoints into the bucket (0: only on "
                   "sync --wait and unmount)")
    p.add_argument("--checkpoint-keep", type=int, default=d.checkpoint_keep,
                   help="metadata checkpoints kept in the bucket")
    p.add_argument("--cold-timeout", type=float, default=d.cold_timeout,
                   help="seconds a cold read retries a failing bucket before EIO")
    p.add_argument("--force", action="store_true",
                   help="take over the filesystem from another node known to be dead")
    p.add_argument("--fault-file", default=None, help=argparse.SUPPRESS)  # tests only
    p.add_argument("--log-level", default=d.log_level,
                   choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="daemon log level")


def _config(args) -> MountConfig:
    return MountConfig(
        cold_url=args.cold_url, mountpoint=args.mountpoint, cache_dir=args.cache_dir,
        foreground=args.foreground, extent_size=parse_size(args.extent_size),
        cache_size=parse_size(args.cache_size), min_free=parse_size(args.min_free),
        upload_delay=args.upload_delay, upload_parallel=args.upload_parallel,
        cache_policy=args.cache_policy, attr_timeout=args.attr_timeout,
        allow_other=args.allow_other, default_permissions=args.default_permissions,
        writeback_cache=args.writeback_cache, read_ahead_kb=args.read_ahead_kb,
        s3_endpoint=args.s3_endpoint, s3_region=args.s3_region,
        s3_path_style=args.s3_path_style, log_level=args.log_level,
        checkpoint_interval=args.checkpoint_interval, checkpoint_keep=args.checkpoint_keep,
        cold_timeout=args.cold_timeout, force=args.force, fault_file=args.fault_file)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierfs", description="Tiered POSIX filesystem: "
                                     "local NVMe hot tier, S3 cold tier, one namespace.")
    parser.add_argument("--version", action="version", version=f"tierfs {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_mount_parser(sub)
    p = sub.add_parser("umount", help="flush, unmount and stop the daemon",
                       description="Flush data and metadata, unmount MOUNTPOINT and wait "
                       "until its daemon has exited.")
    p.add_argument("mountpoint", metavar="MOUNTPOINT")
    p = sub.add_parser("status", help="show the state of a mount or of a file",
                       description="Hot, cold and dirty bytes of a mount; with a file, "
                       "where each of its extents is.")
    p.add_argument("path", metavar="PATH", nargs="?", default=".",
                   help="mount point or a path inside it (default: the current directory)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    tiering.add_parsers(sub)
    offline.add_parsers(sub)
    return parser


def cmd_status(args) -> int:
    from .client import call
    path = os.path.abspath(args.path)
    st = os.stat(path)
    import stat as _stat
    req = {"ino": st.st_ino} if _stat.S_ISREG(st.st_mode) else {}
    out = call(path, "status", **req)
    out.pop("ok", None)
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
        return 0
    print(f"mount        {out['mountpoint']}  ->  {out['cold']}")
    print(f"hot          {format_size(out['hot_bytes'])} in {out['hot_extents']} extents")
    print(f"dirty        {format_size(out['dirty_bytes'])} in {out['dirty_extents']} extents")
    print(f"pinned       {format_size(out['pinned_bytes'])}")
    print(f"cache        limit {format_size(out['cache_limit'])}, policy {out['cache_policy']}")
    print(f"uploads      backlog {format_size(out['upload_backlog_bytes'])}, oldest "
          f"{out['upload_backlog_age_s']:.1f}s, in flight {out['uploads_in_flight']}")
    hit = out["hit_rate"]
    print(f"hit rate     {'-' if hit is None else f'{hit * 100:.1f}%'} of bytes read")
    if "file" in out:
        f = out["file"]
        print(f"file         {path}: {format_size(f['size'])}, hot {format_size(f['hot'])}, "
              f"cold {format_size(f['cold'])}, dirty {format_size(f['dirty'])}")
        for first, last, state in _runs(f["extents"]):
            span = f"{first}" if first == last else f"{first}-{last}"
            print(f"  extents {span:<13} {state}")
    return 0


def _runs(extents: list[dict]):
    """Group consecutive extents in the same state: (first, last, state)."""
    runs = []
    for e in extents:
        state = " ".join([e["where"]] + [w for w in ("dirty", "pinned") if e[w]])
        if runs and runs[-1][2] == state and runs[-1][1] == e["index"] - 1:
            runs[-1][1] = e["index"]
        else:
            runs.append([e["index"], e["index"], state])
    return runs


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        if args.command == "mount":
            from .mount import run_daemon, spawn_daemon
            cfg = _config(args)
            from ..cold import parse_cold_url
            parse_cold_url(cfg.cold_url)  # fail fast on a malformed URL
            if args.foreground:
                return run_daemon(cfg)
            return spawn_daemon(argv)
        if args.command == "umount":
            from .mount import umount
            return umount(args.mountpoint)
        if args.command == "status":
            return cmd_status(args)
        if args.command in offline.COMMANDS:
            return offline.COMMANDS[args.command](args)
        if args.command in tiering.COMMANDS:
            return tiering.COMMANDS[args.command](args)
    except UserError as e:
        print(f"tierfs: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output piped into head & co.
        sys.stderr.close()
        return 0
    return 2
