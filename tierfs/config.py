"""Mount options: one table with types, defaults and help, read from a TOML file
(--config), TIERFS_* environment variables and command-line flags.

Precedence: command-line flag > environment variable > config file > default.
"""
from __future__ import annotations

import difflib
import math
import os
import re
import tomllib
from dataclasses import dataclass, fields

from .cold import endpoint_problem, region_problem
from .errors import UserError

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
_SIZE = re.compile(r"\s*([-+]?[0-9]*\.?[0-9]+)\s*([KMGTP]?)(?:i?B)?\s*", re.IGNORECASE)
_SIZE_FORMS = "use a number with an optional unit K, M, G, T or P, e.g. 64M or 200G"


def _parse_size(text, what: str) -> int:
    """Bytes of `text`; UserError naming `what` (the setting as the user wrote it)."""
    if isinstance(text, bool):
        raise UserError(f"{what} is not a size: {_SIZE_FORMS}")
    if isinstance(text, int):
        n = text
    else:
        m = _SIZE.fullmatch(str(text))
        if not m:
            raise UserError(f"{what} is not a size: {_SIZE_FORMS}")
        number, unit = float(m.group(1)), m.group(2).upper()
        exact = number * _UNITS[unit]
        if exact < 0:
            raise UserError(f"{what} must be ≥ 0")
        if not unit and exact != int(exact):
            raise UserError(f"{what} is not a whole number of bytes (a size without a unit "
                            f"counts bytes): add a unit, e.g. {m.group(1)}G")
        if 0 < exact < 1:
            raise UserError(f"{what} is less than one byte: {_SIZE_FORMS}")
        n = int(exact)
    if n < 0:
        raise UserError(f"{what} must be ≥ 0")
    return n


def parse_size(text: str | int) -> int:
    """'64M', '200G', '1.5T', '4096' -> bytes (binary units K..P; a trailing 'iB'/'B' is
    allowed). Refuses negative sizes and fractions of a byte."""
    return _parse_size(text, repr(text))


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


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
    pack_below: int = 1 << 20
    pack_size: int = 64 << 20
    compact_dead: float = 0.25
    compact_rate: int = 32 << 20
    compact_interval: float = 5.0
    unmount_upload_timeout: float = 60.0
    start_timeout: float = 1800.0       # tierfs mount: longest wait for the daemon to mount
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
    meta_url: str | None = None         # postgresql://...: a namespace shared by many nodes
    session_timeout: float = 30.0
    lease_ttl: float = 60.0             # one node: the writer lease's life without a renewal
    meta_timeout: float = 60.0          # shared namespace: longest wait for the database
    fault_file: str | None = None       # tests only: steer a fault-injecting store
    meta_map_size: int = 1 << 36        # LMDB map to start with; doubles when full
    meta_max_map_size: int = 1 << 40    # then ENOSPC

    @property
    def log_path(self) -> str:
        return os.path.join(self.cache_dir, "tierfs.log")


# --extent-size of a new filesystem: a power of two in this range. Below 64 KiB every
# request becomes many extents; above 256 MiB each upload and fetch holds that much memory.
MIN_EXTENT = 64 << 10
MAX_EXTENT = 256 << 20
# The largest FUSE read or write request (libfuse 3 negotiates 1 MiB).
MAX_REQUEST = 1 << 20


def min_cache_size(extent_size: int) -> int:
    """The smallest hot tier that can serve any one request: the extents a 1 MiB
    request can touch (one more than it covers when it is not aligned)."""
    return (-(-MAX_REQUEST // extent_size) + 1) * extent_size


@dataclass(frozen=True)
class Option:
    name: str            # MountConfig field; flag --name-with-dashes; env TIERFS_NAME
    kind: str            # size | float | int | bool | str
    help: str
    choices: tuple = ()
    hidden: bool = False
    low: float | None = None    # smallest value accepted
    high: float | None = None   # largest value accepted
    above: bool = False         # `low` itself is refused (> low)


_S = "seconds"
OPTIONS = (
    Option("cache_dir", "str", "directory on local NVMe for the hot tier and the metadata "
           "(required)"),
    Option("foreground", "bool", "stay in the foreground"),
    Option("extent_size", "size", "extent size of a NEW filesystem (fixed once created), a "
           "power of two from 64K to 256M", low=MIN_EXTENT, high=MAX_EXTENT),
    Option("cache_size", "size", "hot tier high watermark, e.g. 200G (default: 90%% of what "
           "the cache disk can give: the free space and the hot data already there, less "
           "--min-free)", low=0),
    Option("min_free", "size", "free space to keep on the cache disk", low=0),
    Option("upload_delay", "float", "seconds after the last write before an extent is uploaded "
           "(up to 4x as long while the mount is being written)", low=0),
    Option("upload_parallel", "int", "concurrent uploads", low=1, high=1024),
    Option("pack_below", "size", "files up to this size are uploaded packed together into "
           "shared objects (0: never)", low=0),
    Option("pack_size", "size", "largest shared object of packed small files", low=1 << 20,
           high=5 << 30),
    Option("compact_dead", "float", "rewrite a pack once this share of it belongs to files "
           "deleted or rewritten (the bucket then holds at most 1/(1-share) of the live "
           "data in packs; 1: never)", low=0, high=1),
    Option("compact_rate", "size", "bytes per second compaction may rewrite (0: off)", low=0),
    Option("unmount_upload_timeout", "float", "seconds unmount spends uploading dirty data",
           low=0),
    Option("start_timeout", "float", "seconds `tierfs mount` waits for its daemon to mount "
           "(a restore of a large filesystem, a slow bucket) before it stops the daemon and "
           "fails", low=0, above=True),
    Option("checkpoint_interval", "float", "seconds between metadata checkpoints into the "
           "bucket (0: only on sync --wait and unmount)", low=0),
    Option("checkpoint_keep", "int", "metadata checkpoints kept in the bucket", low=1),
    Option("cold_timeout", "float", "seconds a cold read waits for a failing or silent bucket "
           "before EIO", low=0, above=True),
    Option("write_wait", "float", "seconds writes wait for room on a hot tier full of data "
           "not uploaded yet (a bucket outage) before ENOSPC", low=0),
    Option("cache_policy", "str", "eviction policy of the hot tier", ("lru", "no-replace")),
    Option("attr_timeout", "float", "seconds the kernel may cache attributes and names", low=0),
    Option("allow_other", "bool", "make the mount visible to all users (default: on when "
           "run as root)"),
    Option("default_permissions", "bool", "let the kernel check file permissions"),
    Option("writeback_cache", "bool", "use the kernel's writeback cache"),
    Option("read_ahead_kb", "int", "kernel readahead of the mount in KiB", low=0),
    Option("xattr", "bool", "serve extended attributes; off: no user.* xattrs and no "
           "user.tierfs.state, but no xattr round trip before each write or per `ls -l` entry"),
    Option("s3_endpoint", "str", "S3 endpoint URL, http://HOST:PORT or https://HOST "
           "(default: AWS_ENDPOINT_URL, else AWS)"),
    Option("s3_region", "str", "S3 region (default: AWS_DEFAULT_REGION or the AWS "
           "configuration)"),
    Option("s3_path_style", "bool", "path-style S3 addressing"),
    Option("metrics_port", "int", "serve Prometheus metrics on this port (0: off)", low=0,
           high=65535),
    Option("metrics_addr", "str", "address of the metrics endpoint"),
    Option("log_level", "str", "daemon log level", ("DEBUG", "INFO", "WARNING", "ERROR")),
    Option("force", "bool", "take over the filesystem from another node known to be dead"),
    Option("meta_url", "str", "keep the namespace in PostgreSQL (postgresql://USER@HOST/DB), "
           "shared by every node that mounts the filesystem with it (default: LMDB in the "
           "cache dir, one node)"),
    Option("session_timeout", "float", "seconds without a heartbeat after which other nodes "
           "end a node's session (shared namespace)", low=3),
    Option("lease_ttl", "float", "seconds the writer lease in the bucket lasts without a "
           "renewal (one node; renewed every third of it): after that another node may "
           "mount without --force, and a node taken over notices within a third of it",
           low=3),
    Option("meta_timeout", "float", "seconds a request waits for an unreachable or silent "
           "metadata database before EIO (shared namespace)", low=0, above=True),
    Option("fault_file", "str", "tests only", hidden=True),
    Option("compact_interval", "float", "seconds between compaction passes", hidden=True,
           low=0, above=True),
    Option("meta_map_size", "size", "initial LMDB map size", hidden=True, low=1 << 16),
    Option("meta_max_map_size", "size", "largest LMDB map size", hidden=True, low=1 << 16),
)
_BY_NAME = {o.name: o for o in OPTIONS}
_DEFAULTS = MountConfig("", "", "")
CLI = "the command line"

# TIERFS_* variables that are not mount options: the spawned daemon's ready pipe, and
# settings of the scripts in scripts/ (tests/unit/test_config.py finds any new one).
OTHER_ENV = ("TIERFS_READY_FD", "TIERFS_DEMO_DIR", "TIERFS_DEBIAN_MIRROR",
             "TIERFS_DOCKER_RUN_ARGS", "TIERFS_TEST_IMAGE", "TIERFS_REINSTALL",
             "TIERFS_ACCELERATE", "TIERFS_TEST_LIMIT_S", "TIERFS_TEST_WORKERS",
             "TIERFS_ANSWER_WAIT")


def default(name: str):
    return getattr(_DEFAULTS, name)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def setting(name: str, raw, source: str) -> str:
    """The setting as the user wrote it in `source`: --cache-size 10T,
    TIERFS_CACHE_SIZE=10T, or cache_size = "10T" in config file F."""
    if source == CLI:
        return f"{_flag(name)} {raw if raw != '' else repr(raw)}"
    if source.startswith("environment variable "):
        return f"TIERFS_{name.upper()}={raw if raw != '' else repr(raw)}"
    shown = f'"{raw}"' if isinstance(raw, str) else str(raw).lower() if isinstance(
        raw, bool) else raw
    return f"{name} = {shown} in {source}"


_EXPECTED = {"int": "a whole number", "float": "a number",
             "bool": "a switch: use true or false (1/0, yes/no and on/off work too)",
             "str": "a string"}


def _number(opt: Option, value, what: str):
    if isinstance(value, bool):  # TOML true is an int to Python
        raise ValueError(value)
    if opt.kind == "int":
        if isinstance(value, float):
            if not value.is_integer():
                raise ValueError(value)
            return int(value)
        return int(value)
    value = float(value)
    if not math.isfinite(value):
        raise UserError(f"{what} is not a finite number of seconds")
    return value


def _check_range(opt: Option, value, what: str) -> None:
    low, high = opt.low, opt.high
    if low is None or opt.kind not in ("int", "float", "size"):
        return
    show = (lambda v: format_size(v)) if opt.kind == "size" else (lambda v: f"{v:g}")
    if high is not None and not low <= value <= high:
        raise UserError(f"{what} is out of range: must be between {show(low)} and {show(high)}")
    if value < low or (opt.above and value == low):
        raise UserError(f"{what} must be {'>' if opt.above else '≥'} {show(low)}")


def convert(opt: Option, value, source: str):
    """Turn a raw value from a file, the environment or a flag into the option's type,
    and check it is in the option's range."""
    if value is None:
        return None
    what = setting(opt.name, value, source)
    try:
        if opt.kind == "size":
            value = _parse_size(value, what)
        elif opt.kind in ("float", "int"):
            value = _number(opt, value, what)
        elif opt.kind == "bool" and not isinstance(value, bool):
            low = str(value).strip().lower()
            if low not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                raise ValueError(value)
            value = low in ("1", "true", "yes", "on")
        elif opt.kind == "str":
            value = str(value)
    except (ValueError, TypeError):
        raise UserError(f"{what} is not {_EXPECTED[opt.kind]}") from None
    if opt.choices and value not in opt.choices:
        value = next((c for c in opt.choices if c.lower() == value.lower()), value)
    if opt.choices and value not in opt.choices:
        raise UserError(f"{what} is not a choice: choose one of {', '.join(opt.choices)}")
    _check_range(opt, value, what)
    if opt.name == "extent_size" and value & (value - 1):
        raise UserError(f"{what} is not a power of two: use one from 64K to 256M, e.g. 1M or "
                        f"4M")
    if opt.name == "s3_endpoint":
        problem = endpoint_problem(value)
        if problem:
            raise UserError(f"{what} {problem}")
    if opt.name == "s3_region":
        problem = region_problem(value)
        if problem:
            raise UserError(f"{what} {problem}")
    if opt.name == "metrics_addr" and not value.strip():
        raise UserError(f"{what} is empty: use 127.0.0.1, or 0.0.0.0 for every interface")
    return value


def read_config_file(path: str) -> dict:
    return _read_config_file(path)[0]


def _read_config_file(path: str) -> tuple[dict, dict]:
    """(values, raw values as written) of a TOML file."""
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise UserError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"config file {path} is not valid TOML: {e}") from None
    out, given = {}, {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name in out:  # cache-dir and cache_dir: which one was meant?
            raise UserError(f"config file {path} sets {name!r} twice: keep one of them")
        if name in ("cold_url", "mountpoint"):
            if not isinstance(value, str) or not value:
                raise UserError(f"{key} in config file {path} must be a non-empty string, "
                                f"not {value!r}")
            out[name] = value
            continue
        opt = _BY_NAME.get(name)
        if opt is None:
            raise UserError(f"unknown option {key!r} in config file {path}")
        out[name] = convert(opt, value, f"config file {path}")
        given[name] = value
    return out, given


def read_env(env) -> dict:
    out = {name: env[f"TIERFS_{name.upper()}"] for name in ("cold_url", "mountpoint")
           if env.get(f"TIERFS_{name.upper()}")}
    for opt in OPTIONS:
        raw = env.get("TIERFS_" + opt.name.upper())
        if raw is not None:
            out[opt.name] = convert(opt, raw, f"environment variable TIERFS_{opt.name.upper()}")
    return out


def known_env() -> set[str]:
    """Every TIERFS_* variable tierfs or its scripts read."""
    return ({"TIERFS_" + o.name.upper() for o in OPTIONS}
            | {"TIERFS_COLD_URL", "TIERFS_MOUNTPOINT"} | set(OTHER_ENV))


def unknown_env_warnings(env=os.environ) -> list[str]:
    """One line per TIERFS_* variable that nothing reads (a typo, most likely), with the
    closest known name. None inside the spawned daemon: its caller has warned."""
    if "TIERFS_READY_FD" in env:
        return []
    known = known_env()
    lines = []
    for name in sorted(env):
        if not name.startswith("TIERFS_") or name in known:
            continue
        # Compare without the prefix, which every name shares and would make all close.
        near = difflib.get_close_matches(name[7:], sorted(k[7:] for k in known), n=1,
                                         cutoff=0.6)
        hint = f" (did you mean TIERFS_{near[0]}?)" if near else ""
        lines.append(f"tierfs: warning: unknown environment variable {name} ignored{hint}")
    return lines


def _check_together(merged: dict, given: dict) -> None:
    """Checks that involve two options (each one alone is already checked)."""
    def what(name):
        source, raw = given.get(name, (None, merged[name]))
        return setting(name, raw, source) if source else _flag(name)

    extent = merged.get("extent_size")
    cache = merged.get("cache_size")
    if cache:
        # The extent size is known for a new filesystem; an existing one has its own,
        # checked at mount, so without --extent-size only the smallest possible minimum.
        need = min_cache_size(extent if extent else MIN_EXTENT)
        if cache < need:
            src = given["cache_size"][0]
            label = setting("cache_size", format_size(cache), src)
            if extent:
                raise UserError(
                    f"{label} is too small for {format_size(extent)} extents: one request can "
                    f"touch {need // extent} extents, so the hot tier needs at least "
                    f"{format_size(need)}; raise it")
            dflt = default("extent_size")
            raise UserError(
                f"{label} is too small: the hot tier needs at least "
                f"{format_size(min_cache_size(dflt))} with the default {format_size(dflt)} "
                f"extents, and never less than {format_size(need)} (with the smallest, "
                f"{format_size(MIN_EXTENT)}); raise it")
    url = merged.get("meta_url")
    if url and not url.startswith(("postgresql://", "postgres://")):
        raise UserError(f"{what('meta_url')} is not a PostgreSQL URL: use "
                        f"postgresql://USER@HOST[:PORT]/DATABASE")
    low, high = merged.get("meta_map_size"), merged.get("meta_max_map_size")
    if low and high and high < low:
        raise UserError(f"{what('meta_max_map_size')} is smaller than "
                        f"{what('meta_map_size')}: raise it")


def build_config(flags: dict, config_path: str | None, env=os.environ) -> MountConfig:
    """Merge defaults < config file < environment < flags (None = not given)."""
    merged: dict = {}
    given: dict = {}  # name -> (source, raw value) of what the merge kept
    if config_path:
        values, raw = _read_config_file(config_path)
        merged.update(values)
        given.update({k: (f"config file {config_path}", v) for k, v in raw.items()})
    from_env = read_env(env)
    merged.update(from_env)
    given.update({k: (f"environment variable TIERFS_{k.upper()}", env[f"TIERFS_{k.upper()}"])
                  for k in from_env if k in _BY_NAME})
    for name, value in flags.items():
        if value is not None:
            opt = _BY_NAME.get(name)
            merged[name] = convert(opt, value, CLI) if opt else value
            if opt:
                given[name] = (CLI, value)
    for required in ("cold_url", "mountpoint", "cache_dir"):
        if not merged.get(required):
            flag = required.replace("_", "-")
            raise UserError(f"no {flag} given: pass it on the command line, as "
                            f"TIERFS_{required.upper()} or in the --config file")
    _check_together(merged, given)
    names = {f.name for f in fields(MountConfig)}
    return MountConfig(**{k: v for k, v in merged.items() if k in names})
