"""The `tierfs` command: one entry point, one subcommand per verb."""
from __future__ import annotations

import argparse
import json
import os
import sys

from .. import __version__
from ..config import OPTIONS, MountConfig, build_config, default, format_size
from ..mountpoint import DEAD_MOUNT
from ..errors import EXIT_NOT_IN_BUCKET, NotInBucket, UserError
from . import offline, tiering


def _add_mount_parser(sub) -> None:
    p = sub.add_parser("mount", help="mount a filesystem (creating it on first use)",
                       description="Mount the tierfs filesystem stored at COLD_URL on MOUNTPOINT. "
                       "The first mount of an empty location creates the filesystem. Every "
                       "option can also come from a TOML file (--config; keys as the long "
                       "options) or an environment variable TIERFS_<OPTION> (e.g. "
                       "TIERFS_CACHE_SIZE=200G); a flag beats the environment, which beats the "
                       "file. Sizes take units: 64M, 200G, 1.5T.")
    p.add_argument("cold_url", metavar="COLD_URL", nargs="?",
                   help="where cold data lives: file:///path or s3://bucket/prefix")
    p.add_argument("mountpoint", metavar="MOUNTPOINT", nargs="?", help="an empty directory")
    p.add_argument("--config", metavar="FILE", help="TOML file with mount options")
    for opt in OPTIONS:
        flag = "--" + opt.name.replace("_", "-")
        if opt.hidden:
            p.add_argument(flag, default=None, help=argparse.SUPPRESS)
            continue
        dflt = default(opt.name)
        shown = ("auto" if dflt is None and opt.kind == "bool" else
                 format_size(dflt) if opt.kind == "size" and dflt else dflt)
        helptext = f"{opt.help} (default: {shown})" if opt.name != "cache_dir" else opt.help
        if opt.kind == "bool":
            p.add_argument(flag, default=None, action=argparse.BooleanOptionalAction,
                           help=helptext)
        else:
            p.add_argument(flag, default=None, choices=opt.choices or None, help=helptext)


def _config(args) -> MountConfig:
    flags = {opt.name: getattr(args, opt.name) for opt in OPTIONS}
    flags["cold_url"], flags["mountpoint"] = args.cold_url, args.mountpoint
    return build_config(flags, args.config)


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
    from ..client import call
    path = os.path.abspath(args.path)
    st = os.stat(path)
    import stat as _stat
    req = {"ino": st.st_ino} if _stat.S_ISREG(st.st_mode) else {}
    out = call(path, "status", **req)
    out.pop("ok", None)
    fenced = out.get("fenced_by")
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
        return EXIT_NOT_IN_BUCKET if fenced else 0
    print(f"mount        {out['mountpoint']}  ->  {out['cold']}")
    if fenced:
        print(f"FENCED       {fenced} took the filesystem over: this mount is read-only and "
              f"uploads nothing; unmount it")
    print(f"hot          {format_size(out['hot_bytes'])} in {out['hot_extents']} extents")
    print(f"cold only    {format_size(out['cold_bytes'])} (in the bucket, not on the hot tier)")
    print(f"dirty        {format_size(out['dirty_bytes'])} in {out['dirty_extents']} extents")
    print(f"pinned       {format_size(out['pinned_bytes'])}")
    print(f"cache        limit {format_size(out['cache_limit'])}, policy {out['cache_policy']}")
    print(f"uploads      backlog {format_size(out['upload_backlog_bytes'])}, oldest "
          f"{out['upload_backlog_age_s']:.1f}s, extents uploading now {out['uploads_in_flight']}"
          + (f", failing: {out['upload_error']}" if out.get("upload_error") else ""))
    print(f"bucket gc    {out['gc_backlog_objects']} superseded objects "
          f"({format_size(out['gc_backlog_bytes'])}) waiting for deletion")
    hit = out["hit_rate"]
    print(f"hit rate     {'-' if hit is None else f'{hit * 100:.1f}%'} of bytes read")
    c = out["counters"]
    requests = sum(v for k, v in c.items() if k.startswith("s3_requests:"))
    errors = sum(v for k, v in c.items() if k.startswith("s3_errors:"))
    print(f"bucket       {requests} requests, {errors} errors, {c.get('uploads', 0)} uploads "
          f"({format_size(c.get('upload_bytes', 0))}), {c.get('cold_reads', 0)} fetches "
          f"({format_size(c.get('cold_read_bytes', 0))})")
    print(f"hot tier     {c.get('evictions', 0)} evictions, "
          f"{c.get('backpressure_waits', 0)} writer waits for room")
    print(f"integrity    {c.get('checksum_errors', 0)} bucket and "
          f"{c.get('hot_checksum_errors', 0)} hot checksum failures, "
          f"{c.get('checkpoints', 0)} metadata checkpoints")
    if "file" in out:
        f = out["file"]
        print(f"file         {path}: {format_size(f['size'])}, hot {format_size(f['hot'])}, "
              f"cold {format_size(f['cold'])}, dirty {format_size(f['dirty'])}")
        for first, last, state in _runs(f["extents"]):
            span = f"{first}" if first == last else f"{first}-{last}"
            print(f"  extents {span:<13} {state}")
    return EXIT_NOT_IN_BUCKET if fenced else 0


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
            if cfg.foreground:
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
    except NotInBucket as e:
        print(f"tierfs: {e}", file=sys.stderr)
        return EXIT_NOT_IN_BUCKET
    except UserError as e:
        print(f"tierfs: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a path the user named: missing, or on a dead mount
        if e.errno in DEAD_MOUNT:
            print(f"tierfs: the daemon serving {e.filename} has died: run tierfs umount on "
                  f"its mount point, then mount again", file=sys.stderr)
        else:
            print(f"tierfs: {e.filename}: {e.strerror}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output piped into head & co.
        sys.stderr.close()
        return 0
    return 2
