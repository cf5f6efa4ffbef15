"""Data-loader integration: tell the daemon which files will be read next.

    import tierfs
    tierfs.hint(["/mnt/tierfs/ds/a.bin", "/mnt/tierfs/ds/b.bin"])   # prefetch in this order

    sampler = tierfs.HintingSampler(RandomSampler(ds), paths=ds.files)
    loader = DataLoader(ds, sampler=sampler, num_workers=8)

No extra service and no torch import: HintingSampler works with any sampler
(anything iterable with a length) and sends each epoch's order ahead of it.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Iterable, Sequence

from .client import call, daemon_info

log = logging.getLogger(__name__)


def hint(paths: Iterable[str], *, replace: bool = False) -> int:
    """Ask the daemon to prefetch `paths` (in a tierfs mount) in the given order.
    With replace=True the new list replaces the hints still pending. Returns the
    number of files queued."""
    paths = [os.path.abspath(p) for p in paths]
    if not paths:
        return 0
    info = daemon_info(paths[0])
    root = info["mountpoint"]
    rel = [os.path.relpath(p, root) for p in paths]
    outside = [p for p, r in zip(paths, rel) if r.startswith("..")]
    if outside:
        raise ValueError(f"{outside[0]} is not inside the tierfs mount {root}")
    return call(paths[0], "hint", paths=rel, replace=replace)["queued"]


class HintingSampler:
    """Wraps a sampler; at the start of every epoch sends that epoch's file order
    to the daemon (from a background thread, so the first batch is not delayed)."""

    def __init__(self, sampler, paths: Sequence[str]):
        self.sampler = sampler
        self.paths = paths
        self._warned = False

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:  # DistributedSampler compatibility
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def _send(self, order: list[int]) -> None:
        try:
            hint([self.paths[i] for i in order], replace=True)
        except Exception as e:  # hints are an optimisation: never break training
            if not self._warned:
                log.warning("tierfs hints disabled for this sampler: %s", e)
                self._warned = True

    def __iter__(self):
        order = list(iter(self.sampler))
        threading.Thread(target=self._send, args=(order,), daemon=True).start()
        return iter(order)
