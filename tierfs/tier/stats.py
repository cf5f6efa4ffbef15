"""Counters of the tiering engine, read by `tierfs status` and metrics."""
from __future__ import annotations

import collections


class Stats:
    def __init__(self):
        self.counters: collections.Counter[str] = collections.Counter()

    def inc(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def snapshot(self) -> dict[str, int]:
        return dict(self.counters)
