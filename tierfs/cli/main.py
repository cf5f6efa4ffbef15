"""The `tierfs` command: one entry point, one subcommand per verb."""
from __future__ import annotations

import argparse
import math
import os
import select
import sys

from .. import __version__
from ..config import OPTIONS, MountConfig, build_config, default, format_size
from ..mountpoint import DEAD_MOUNT
from ..errors import EXIT_NOT_IN_BUCKET, ColdStoreError, NotInBucket, UserError
from . import dumpload, offline, status, tiering


def _add_mount_parser(sub) -> None:
    p = sub.add_parser("mount", help="mount a filesystem (creating it on first use)",
                       description="Mount the tierfs filesystem stored at COLD_URL on MOUNTPOINT. "
                       "The first mount of an empty location creates the filesystem. Every "
                       "option can also come from a TOML file (--config; keys as the long "
                       "options) or an environment variable TIERFS_<OPTION> (e.g. "
                       "TIERFS_CACHE_SIZE=200G); a flag beats the environment, which beats the "
                       "file. Sizes take units K, M, G, T, P: 64M, 200G, 1.5T.")
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
        shown = (format_size(dflt) if opt.kind == "size" and dflt else
                 ("on" if dflt else "off") if opt.kind == "bool" else dflt)
        # Help that explains its own default (or a required option) gets no second one.
        own = opt.name == "cache_dir" or "default:" in opt.help
        helptext = opt.help if own else f"{opt.help} (default: {shown})"
        if opt.kind == "bool":
            p.add_argument(flag, default=None, action=argparse.BooleanOptionalAction,
                           help=helptext)
        else:
            # Choices are checked by config.convert, in one line like every other value.
            metavar = "{" + ",".join(opt.choices) + "}" if opt.choices else None
            p.add_argument(flag, default=None, metavar=metavar, help=helptext)
    # argparse takes "-5G" for an option ("expected one argument"): let values shaped like
    # negative sizes through, so that the option's own check says what is wrong.
    import re
    p._negative_number_matcher = re.compile(
        r"^-(\d+\.?\d*|\.\d+)\s*([KMGTP](i?B)?|B)?$", re.IGNORECASE)


def _config(args) -> MountConfig:
    from ..config import unknown_env_warnings
    for line in unknown_env_warnings():
        print(line, file=sys.stderr)
    flags = {opt.name: getattr(args, opt.name) for opt in OPTIONS}
    flags["cold_url"], flags["mountpoint"] = args.cold_url, args.mountpoint
    cfg = build_config(flags, args.config)
    if cfg.cold_url.startswith("s3://"):
        # What boto3 would refuse in the daemon, said here before it is spawned.
        from ..cold import check_s3_environment
        check_s3_environment(endpoint=cfg.s3_endpoint, region=cfg.s3_region)
    return cfg


def _umount_target(args) -> str:
    """The mount point to unmount: given, else as `tierfs mount` would find it."""
    if args.mountpoint:
        return args.mountpoint
    from ..config import read_config_file
    found = os.environ.get("TIERFS_MOUNTPOINT") or (
        read_config_file(args.config).get("mountpoint") if args.config else None)
    if not found:
        raise UserError("no mount point given: pass MOUNTPOINT, or --config FILE with a "
                        "mountpoint key")
    return found


def _seconds(text: str) -> float:
    """A wait in seconds: NaN would never end it, a negative one end it at once."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is no number of seconds (0 or more)")
    return value


class OneLineParser(argparse.ArgumentParser):
    """Usage errors in one line that names the problem and where help is, as every
    other error of the command (argparse would print the whole usage first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="tierfs", description="Tiered POSIX filesystem: "
                           "local NVMe hot tier, S3 cold tier, one namespace.")
    parser.add_argument("--version", action="version", version=f"tierfs {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_mount_parser(sub)
    p = sub.add_parser("umount", help="flush, unmount and stop the daemon",
                       description="Flush data and metadata, unmount MOUNTPOINT and wait "
                       "until its daemon has exited. Exit status 3: unmounted, but some "
                       "data is not in the bucket yet (it uploads on the next mount).")
    p.add_argument("mountpoint", metavar="MOUNTPOINT", nargs="?",
                   help="the mount point (default: the mountpoint of --config, or "
                   "TIERFS_MOUNTPOINT)")
    p.add_argument("--config", metavar="FILE", help="TOML file the mount was made with")
    p.add_argument("--timeout", type=_seconds, default=3600.0, metavar="SECONDS",
                   help="give up waiting for the daemon to exit after this long, exit "
                   "status 3 (default: 3600)")
    p = sub.add_parser("status", help="show the state of a mount, a directory or a file",
                       description="Hot, cold and dirty bytes of a mount; with a directory, "
                       "the totals of everything below it; with a file, where each of its "
                       "extents is.")
    p.add_argument("path", metavar="PATH", nargs="?", default=".",
                   help="mount point or a path inside it (default: the current directory)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    tiering.add_parsers(sub)
    offline.add_parsers(sub)
    dumpload.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        rc = _run(sys.argv[1:] if argv is None else argv)
        sys.stdout.flush()  # a pipe buffers: the reader may be gone by now
        return rc
    except BrokenPipeError:
        if not stdout_gone():  # a pipe or socket of the command's own work broke
            print("tierfs: a connection broke off before the command finished (broken "
                  "pipe): run it again", file=sys.stderr)
            return 1
        # Output piped into head & co., which stopped reading: Python would complain
        # again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader has gone: its write end then polls
    POLLERR."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _fd, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no stdout, or not a real file
        return False


def _run(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "mount":
            from .mount import run_daemon, spawn_daemon
            cfg = _config(args)
            from ..cold import parse_cold_url
            parse_cold_url(cfg.cold_url)  # fail fast on a malformed URL
            if cfg.foreground:
                return run_daemon(cfg)
            return spawn_daemon(argv, cfg)
        if args.command == "umount":
            from .mount import umount
            return umount(_umount_target(args), args.timeout)
        if args.command == "status":
            return status.cmd_status(args)
        if args.command in offline.COMMANDS:
            return offline.COMMANDS[args.command](args)
        if args.command in dumpload.COMMANDS:
            return dumpload.COMMANDS[args.command](args)
        if args.command in tiering.COMMANDS:
            return tiering.COMMANDS[args.command](args)
    except NotInBucket as e:
        print(f"tierfs: {e}", file=sys.stderr)
        return EXIT_NOT_IN_BUCKET
    except UserError as e:
        print(f"tierfs: {e}", file=sys.stderr)
        return 1
    except ColdStoreError as e:  # the bucket failed past its retries (offline commands)
        print(f"tierfs: {e}: check that the bucket answers and its objects are readable, "
              f"then run the command again", file=sys.stderr)
        return 1
    except BrokenPipeError:
        raise
    except OSError as e:  # a path the user named: missing, or on a dead mount
        if e.errno in DEAD_MOUNT:
            print(f"tierfs: the daemon serving {e.filename} has died: run tierfs umount on "
                  f"its mount point, then mount again", file=sys.stderr)
        else:
            print(f"tierfs: {e.filename}: {e.strerror}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 2
