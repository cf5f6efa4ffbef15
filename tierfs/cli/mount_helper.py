"""`mount.fuse.tierfs`: lets mount(8) and /etc/fstab mount tierfs.

    # /etc/fstab
    s3://bucket/train-fs  /mnt/tierfs  fuse.tierfs  cache_dir=/nvme/tierfs,cache_size=800G,_netdev,nofail  0 0

mount(8) runs `mount.fuse.tierfs SOURCE MOUNTPOINT -o OPTIONS`; tierfs options
are given as name=value (dashes or underscores); switches as bare names or name=true/false
(allow_other, no_writeback_cache...); generic mount options are ignored.
"""
from __future__ import annotations

import sys

from ..config import OPTIONS

_GENERIC = {"rw", "defaults", "auto", "noauto", "user", "nouser", "users", "nofail", "_netdev",
            "exec", "noexec", "suid", "nosuid", "dev", "nodev", "atime", "noatime", "relatime",
            "strictatime", "async", "sync", "owner", "group", "comment", "x-systemd"}

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def translate(options: str) -> list[str]:
    """fstab options -> tierfs mount flags."""
    names = {o.name: o for o in OPTIONS if not o.hidden}
    flags = []
    for item in filter(None, options.split(",")):
        key, has_value, value = item.partition("=")
        key_n = key.replace("-", "_")
        if key in _GENERIC or key.split(".")[0] in _GENERIC or key.startswith("x-"):
            continue
        if key == "ro":
            raise SystemExit("mount.fuse.tierfs: read-only mounts are not supported")
        if key_n == "config":
            flags += ["--config", value]
            continue
        negate = key_n.startswith("no_") and key_n[3:] in names
        opt = names.get(key_n[3:] if negate else key_n)
        if opt is None:
            raise SystemExit(f"mount.fuse.tierfs: unknown option {key!r}")
        flag = "--" + ("no-" if negate else "") + opt.name.replace("_", "-")
        if opt.kind == "bool":
            on = not negate
            if has_value:
                word = value.strip().lower()
                if word not in _ON + _OFF:
                    raise SystemExit(f"mount.fuse.tierfs: {item!r} is not a switch value: use "
                                     f"{key}, or {key}=VALUE with one of "
                                     f"{'/'.join(_ON + _OFF)}")
                on = (word in _ON) != negate  # no_SWITCH=false: on
            flags.append("--" + ("" if on else "no-") + opt.name.replace("_", "-"))
        else:
            if not has_value:
                raise SystemExit(f"mount.fuse.tierfs: option {key!r} needs a value ({key}=...)")
            flags += [flag, value]
    return flags


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    positional, options = [], []
    it = iter(argv)
    for arg in it:
        if arg == "-o":
            options.append(next(it, ""))
        elif arg.startswith("-o") and len(arg) > 2:
            options.append(arg[2:])
        elif arg in ("-n", "-s", "-v", "-f"):
            continue  # mount(8)'s no-mtab / sloppy / verbose / fake: nothing to do
        else:
            positional.append(arg)
    if len(positional) != 2:
        print("usage: mount.fuse.tierfs COLD_URL MOUNTPOINT [-o options]", file=sys.stderr)
        return 2
    from .main import main as tierfs_main
    return tierfs_main(["mount", *positional, *translate(",".join(options))])


if __name__ == "__main__":
    raise SystemExit(main())
