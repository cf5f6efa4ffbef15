"""Mount options with their defaults, and parsing of human sizes."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

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
    extent_size: int = 4 << 20          # used when a new filesystem is created
    cache_size: int = 0                 # hot tier high watermark; 0 = 90% of the disk
    min_free: int = 1 << 30             # keep this much free on the NVMe
    upload_delay: float = 5.0           # seconds after the last write
    upload_parallel: int = 8
    unmount_upload_timeout: float = 60.0  # seconds unmount spends uploading dirty data
    checkpoint_interval: float = 300.0  # seconds between metadata checkpoints (0: off)
    checkpoint_keep: int = 3
    cold_timeout: float = 30.0          # a cold read gives EIO after this long
    force: bool = False                 # take over another node's writer lease
    fault_file: str | None = None       # tests only: steer a fault-injecting store
    attr_timeout: float = 60.0
    allow_other: bool | None = None     # None: on when running as root
    default_permissions: bool = True
    writeback_cache: bool = True
    read_ahead_kb: int = 1024
    cache_policy: str = "lru"           # or "no-replace"
    s3_endpoint: str | None = None
    s3_region: str | None = None
    s3_path_style: bool = False
    log_level: str = "INFO"
    extra: dict = field(default_factory=dict)
