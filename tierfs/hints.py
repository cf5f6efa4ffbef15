"""Data-loader integration: tell the daemon which files will be read next.

    import tierfs
    tierfs.hint(["/mnt/tierfs/ds/a.bin", "/mnt/tierfs/ds/b.bin"])   # prefetch in this order

    sampler = tierfs.HintingSampler(RandomSampler(ds), paths=ds.files)
    loader = DataLoader(ds, sampler=sampler, num_workers=8)

No extra service and no torch import: HintingSampler works with any sampler
(anything iterable with a length) and sends each epoch's order ahead of it.
A list of any length goes in requests of PATHS_PER_REQUEST paths (at most
BYTES_PER_REQUEST of them), so no request nears the daemon's size limit and
the daemon takes a long list in without holding up the mount's other requests.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Callable, Iterable, Sequence

from .client import call, daemon_info
from .errors import UserError
from .mount_table import TABLE

log = logging.getLogger(__name__)

PATHS_PER_REQUEST = 10_000
BYTES_PER_REQUEST = 4 << 20  # well below the daemon's 8 MiB per request line
ANSWER_WAIT_S = 60.0  # a daemon that does not answer a hint within this is given up on


def hint(paths: Iterable[str], *, replace: bool = False) -> int:
    """Ask the daemon to prefetch `paths` (in a tierfs mount) in the given order.
    Each process has its own list: with replace=True the new list replaces the
    hints this process still has pending (an empty one just drops them, on every
    tierfs mount). Returns the number of files queued."""
    return _send(paths, replace, lambda: True)


def _send(paths: Iterable[str], replace: bool, still_wanted: Callable[[], bool],
          name: str = "") -> int:
    """hint() on the list `name` of this process, stopping between requests once
    `still_wanted()` is false."""
    paths = [_absolute(p) for p in paths]
    if not paths:
        if replace:
            _clear(name)
        return 0
    info = _daemon_of(paths[0])
    rel = _relative(paths, info["mountpoint"])
    queued = 0
    for start, end in _requests(rel):
        if not still_wanted():
            break
        queued += call(paths[0], "hint", daemon=info, wait_s=ANSWER_WAIT_S, list=name,
                       paths=rel[start:end], replace=replace and start == 0)["queued"]
    return queued


def _clear(name: str) -> None:
    """Drop this process's list `name` on every tierfs mount it sees (an empty list
    names no mount). A mount whose daemon is gone holds no hints."""
    for point in TABLE.points_of_type("fuse.tierfs"):
        try:
            call(point, "hint", wait_s=ANSWER_WAIT_S, list=name, paths=[], replace=True)
        except UserError:
            continue


def _daemon_of(path: str) -> dict:
    """daemon_info of the mount `path` is in. A hinted file may be gone (the daemon
    skips it and counts it unknown): then that of the nearest directory above it
    that exists."""
    probe = path
    while not os.path.exists(probe) and probe != "/":
        probe = os.path.dirname(probe)
    return daemon_info(probe)


def _absolute(path) -> str:
    """os.path.abspath, without its cost for a path that is already clean and
    absolute (a data set's list of a million paths)."""
    path = os.fspath(path)
    if path.startswith("/") and "/." not in path and "//" not in path:
        return path
    return os.path.abspath(path)


def _relative(paths: list[str], root: str) -> list[str]:
    prefix = root.rstrip("/") + "/"
    rel = []
    for p in paths:
        if p.startswith(prefix):
            rel.append(p[len(prefix):])
        elif p == root:
            rel.append(".")
        else:
            raise ValueError(f"{p} is not inside the tierfs mount {root}")
    return rel


def _requests(rel: list[str]):
    """(start, end) of each request's slice of the list."""
    start, size = 0, 0
    for i, p in enumerate(rel):
        size += len(p) + 4  # the quotes, comma and space JSON adds
        if i - start >= PATHS_PER_REQUEST or (size > BYTES_PER_REQUEST and i > start):
            yield start, i
            start, size = i, len(p) + 4
    yield start, len(rel)


class HintingSampler:
    """Wraps a sampler; at the start of every epoch sends that epoch's file order
    to the daemon (from a background thread, so the first batch is not delayed).
    A list still being sent when the next epoch starts stops there: the two
    epochs' lists are never interleaved."""

    def __init__(self, sampler, paths: Sequence[str]):
        self.sampler = sampler
        self.paths = paths
        # Its own list, named after its data set: a sampler over other files (a
        # validation set) keeps its own, one made anew over the same files (a loader
        # rebuilt every epoch) replaces the list of the one before.
        self._list = f"{len(paths)} {os.fspath(paths[0])}" if len(paths) else ""
        self._warned = False
        self._epoch = 0
        self._sending = threading.Lock()  # one epoch's list at a time

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:  # DistributedSampler compatibility
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def _send(self, order: list[int], epoch: int) -> None:
        with self._sending:
            if epoch != self._epoch:
                return  # a newer epoch's list is on its way
            try:
                _send([self.paths[i] for i in order], True, lambda: epoch == self._epoch,
                      self._list)
            except Exception as e:  # hints are an optimisation: never break training
                if not self._warned:
                    log.warning("tierfs hints disabled for this sampler: %s", e)
                    self._warned = True

    def __iter__(self):
        order = list(iter(self.sampler))
        self._epoch += 1
        threading.Thread(target=self._send, args=(order, self._epoch), daemon=True).start()
        return iter(order)
