"""Mount options: one table with types, defaults and help, read from a TOML file
(--config), TIERFS_* environment variables and command-line flags.

Precedence: command-line flag > environment variable > config file > default.
"""
from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, fields

from .errors import UserError

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str | int) -> int:
    """'64M', '200G', '1.5T', '4096' -> bytes (binary units; a trailing 'iB'/'B' is allowed)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(?:i?B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise UserError(f"invalid size {text!r}: use a number with an optional unit, e.g. 64M or 200G")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


@dataclass
class MountConfig:
    cold_url: str
    mountpoint: str
    cache_dir: str
    foreground: bool = False
    extent_size: int = 4 << 20
    cache_size: int = 0
    min_free: int = 1 << 30
    upload_delay: float = 5.0
    upload_parallel: int = 8
    unmount_upload_timeout: float = 60.0
    checkpoint_interval: float = 300.0
    checkpoint_keep: int = 3
    cold_timeout: float = 30.0
    write_wait: float = 60.0
    cache_policy: str = "lru"
    attr_timeout: float = 60.0
    allow_other: bool | None = None     # None: on when running as root
    default_permissions: bool = True
    writeback_cache: bool = True
    xattr: bool = True
    read_ahead_kb: int = 1024
    s3_endpoint: str | None = None
    s3_region: str | None = None
    s3_path_style: bool = False
    metrics_port: int = 0
    metrics_addr: str = "127.0.0.1"
    log_level: str = "INFO"
    force: bool = False
    fault_file: str | None = None       # tests only: steer a fault-injecting store
    meta_map_size: int = 1 << 36        # LMDB map to start with; doubles when full
    meta_max_map_size: int = 1 << 40    # then ENOSPC


@dataclass(frozen=True)
class Option:
    name: str            # MountConfig field; flag --name-with-dashes; env TIERFS_NAME
    kind: str            # size | float | int | bool | str
    help: str
    choices: tuple = ()
    hidden: bool = False


OPTIONS = (
    Option("cache_dir", "str", "directory on local NVMe for the hot tier and the metadata "
           "(required)"),
    Option("foreground", "bool", "stay in the foreground"),
    Option("extent_size", "size", "extent size of a NEW filesystem (fixed once created)"),
    Option("cache_size", "size", "hot tier high watermark, e.g. 200G (0: 90%% of the cache disk)"),
    Option("min_free", "size", "free space to keep on the cache disk"),
    Option("upload_delay", "float", "seconds after the last write before an extent is uploaded "
           "(up to 4x as long while the mount is being written)"),
    Option("upload_parallel", "int", "concurrent uploads"),
    Option("unmount_upload_timeout", "float", "seconds unmount spends uploading dirty data"),
    Option("checkpoint_interval", "float", "seconds between metadata checkpoints into the "
           "bucket (0: only on sync --wait and unmount)"),
    Option("checkpoint_keep", "int", "metadata checkpoints kept in the bucket"),
    Option("cold_timeout", "float", "seconds a cold read waits for a failing or silent bucket "
           "before EIO"),
    Option("write_wait", "float", "seconds writes wait for room on a hot tier full of data "
           "not uploaded yet (a bucket outage) before ENOSPC"),
    Option("cache_policy", "str", "eviction policy of the hot tier", ("lru", "no-replace")),
    Option("attr_timeout", "float", "seconds the kernel may cache attributes and names"),
    Option("allow_other", "bool", "make the mount visible to all users (default: on when "
           "run as root)"),
    Option("default_permissions", "bool", "let the kernel check file permissions"),
    Option("writeback_cache", "bool", "use the kernel's writeback cache"),
    Option("read_ahead_kb", "int", "kernel readahead of the mount in KiB"),
    Option("xattr", "bool", "serve extended attributes; off: no user.* xattrs and no "
           "user.tierfs.state, but no xattr round trip before each write or per `ls -l` entry"),
    Option("s3_endpoint", "str", "S3 endpoint URL (default: AWS_ENDPOINT_URL or AWS)"),
    Option("s3_region", "str", "S3 region"),
    Option("s3_path_style", "bool", "path-style S3 addressing"),
    Option("metrics_port", "int", "serve Prometheus metrics on this port (0: off)"),
    Option("metrics_addr", "str", "address of the metrics endpoint"),
    Option("log_level", "str", "daemon log level", ("DEBUG", "INFO", "WARNING", "ERROR")),
    Option("force", "bool", "take over the filesystem from another node known to be dead"),
    Option("fault_file", "str", "tests only", hidden=True),
    Option("meta_map_size", "size", "initial LMDB map size", hidden=True),
    Option("meta_max_map_size", "size", "largest LMDB map size", hidden=True),
)
_BY_NAME = {o.name: o for o in OPTIONS}
_DEFAULTS = MountConfig("", "", "")


def default(name: str):
    return getattr(_DEFAULTS, name)


def convert(opt: Option, value, source: str):
    """Turn a raw value from a file, the environment or a flag into the option's type."""
    if value is None:
        return None
    try:
        if opt.kind == "size":
            value = parse_size(value)
        elif opt.kind == "float":
            value = float(value)
        elif opt.kind == "int":
            value = int(value)
        elif opt.kind == "bool" and not isinstance(value, bool):
            low = str(value).strip().lower()
            if low not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                raise ValueError(value)
            value = low in ("1", "true", "yes", "on")
        elif opt.kind == "str":
            value = str(value)
    except (ValueError, TypeError):
        raise UserError(f"invalid value {value!r} for {opt.name.replace('_', '-')} in "
                        f"{source}: expected {opt.kind}") from None
    if opt.choices and value not in opt.choices:
        raise UserError(f"invalid value {value!r} for {opt.name.replace('_', '-')} in {source}: "
                        f"choose one of {', '.join(opt.choices)}")
    return value


def read_config_file(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise UserError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"config file {path} is not valid TOML: {e}") from None
    out = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name in ("cold_url", "mountpoint"):
            out[name] = str(value)
            continue
        opt = _BY_NAME.get(name)
        if opt is None:
            raise UserError(f"unknown option {key!r} in config file {path}")
        out[name] = convert(opt, value, f"config file {path}")
    return out


def read_env(env) -> dict:
    out = {name: env[f"TIERFS_{name.upper()}"] for name in ("cold_url", "mountpoint")
           if env.get(f"TIERFS_{name.upper()}")}
    for opt in OPTIONS:
        raw = env.get("TIERFS_" + opt.name.upper())
        if raw is not None:
            out[opt.name] = convert(opt, raw, f"environment variable TIERFS_{opt.name.upper()}")
    return out


def build_config(flags: dict, config_path: str | None, env=os.environ) -> MountConfig:
    """Merge defaults < config file < environment < flags (None = not given)."""
    merged: dict = {}
    if config_path:
        merged.update(read_config_file(config_path))
    merged.update(read_env(env))
    for name, value in flags.items():
        if value is not None:
            opt = _BY_NAME.get(name)
            merged[name] = convert(opt, value, "the command line") if opt else value
    for required in ("cold_url", "mountpoint", "cache_dir"):
        if not merged.get(required):
            flag = required.replace("_", "-")
            raise UserError(f"no {flag} given: pass it on the command line, as "
                            f"TIERFS_{required.upper()} or in the --config file")
    names = {f.name for f in fields(MountConfig)}
    return MountConfig(**{k: v for k, v in merged.items() if k in names})
