"""The daemon's last word: what it could not put in the bucket before exiting.

The daemon writes CACHE_DIR/exit.json as it stops; `tierfs umount` (not its
parent, so it cannot see an exit status) reads it once that pid is gone. A
report of another pid is stale and ignored.
"""
from __future__ import annotations

import json
import os

NAME = "exit.json"


def write(cache_dir: str, report: dict) -> None:
    path = os.path.join(cache_dir, NAME)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f)
    os.replace(tmp, path)


def read(cache_dir: str, pid: int) -> dict | None:
    try:
        with open(os.path.join(cache_dir, NAME)) as f:
            report = json.load(f)
    except (OSError, ValueError):
        return None
    return report if report.get("pid") == pid else None
