"""Counters and latency histograms of the daemon, read by `tierfs status` and the
Prometheus endpoint. Plain dicts updated on the trio thread: cheap enough for
every FUSE request; readers in other threads take snapshots."""
from __future__ import annotations

import bisect
import collections

# Seconds; from page-cache-fast FUSE ops to slow cold fetches.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                   0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Histogram:
    __slots__ = ("counts", "sum", "count")

    def __init__(self):
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations <= bound) including +Inf, as Prometheus wants."""
        out, total = [], 0
        for bound, n in zip(list(LATENCY_BUCKETS) + [float("inf")], self.counts):
            total += n
            out.append((bound, total))
        return out


class Stats:
    def __init__(self):
        self.counters: collections.Counter[str] = collections.Counter()
        self.histograms: dict[tuple[str, str], Histogram] = {}

    def inc(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def observe(self, name: str, label: str, seconds: float) -> None:
        h = self.histograms.get((name, label))
        if h is None:
            h = self.histograms[(name, label)] = Histogram()
        h.observe(seconds)

    def snapshot(self) -> dict[str, int]:
        return dict(self.counters)
