"""Paths of a hint list to inodes, a pass at a time.

A data set's hint list holds every file of an epoch: hundreds of thousands of
paths. Resolved in one go on the trio thread, it would hold every other request of
the mount for seconds, so it is resolved RESOLVE_PER_PASS paths per pass, with the
event loop free between passes. Within a pass each directory is looked up once
(files of a data set share few directories); the directory cache lives for one pass
only, since a rename between passes may change what a name means.
"""
from __future__ import annotations

import trio

from ..errors import FsError
from ..meta.schema import ROOT_INO

RESOLVE_PER_PASS = 1024


def resolve_paths(ns, rels: list[str]) -> list[int | None]:
    """Inode of each path relative to the mount root (None if it does not exist;
    no symlinks followed). `ns` is the namespace's store (lookup(parent, name))."""
    dirs: dict[tuple[str, ...], int | None] = {(): ROOT_INO}
    out: list[int | None] = []
    for rel in rels:
        parts = tuple(p for p in rel.split("/") if p not in ("", "."))
        if not parts:
            out.append(ROOT_INO)
            continue
        parent = _directory(ns, dirs, parts[:-1])
        out.append(None if parent is None else _lookup(ns, parent, parts[-1]))
    return out


def _directory(ns, dirs: dict, parts: tuple[str, ...]) -> int | None:
    """Inode of the directory `parts`, through (and into) the pass's cache."""
    if parts in dirs:
        return dirs[parts]
    parent = _directory(ns, dirs, parts[:-1])
    ino = None if parent is None else _lookup(ns, parent, parts[-1])
    dirs[parts] = ino
    return ino


def _lookup(ns, parent: int, name: str) -> int | None:
    try:
        return ns.lookup(parent, name.encode())
    except FsError:
        return None


async def resolve_in_passes(ns, rels: list[str], call=None) -> list[int | None]:
    """resolve_paths over the whole list, a pass at a time. `call(fn, *args)` runs a
    pass elsewhere (a shared namespace's worker thread); without it a pass runs on
    the trio thread, which gets a checkpoint between passes."""
    out: list[int | None] = []
    for start in range(0, len(rels), RESOLVE_PER_PASS):
        chunk = rels[start:start + RESOLVE_PER_PASS]
        if call is None:
            out += resolve_paths(ns, chunk)
            await trio.lowlevel.checkpoint()
        else:
            out += await call(resolve_paths, ns, chunk)
    return out
