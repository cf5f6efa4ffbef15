"""A hint list's paths to inodes (tierfs/fs/resolve.py) on both metadata engines:
the right inode for every path, and the event loop free between passes, so a
list of a million files does not hold up the mount's other requests."""
from __future__ import annotations

import collections

import trio

from tests.task_steps import TaskSteps
from tests.component.test_meta_conformance import DIR, location, meta, mkfile  # noqa: F401
from tierfs.errors import FsError
from tierfs.fs import resolve
from tierfs.fs.resolve import RESOLVE_PER_PASS, resolve_in_passes, resolve_paths
from tierfs.meta.schema import ROOT_INO


def one_by_one(meta, rel: str):
    """The reference: every component looked up on its own."""
    ino = ROOT_INO
    for part in rel.split("/"):
        if part in ("", "."):
            continue
        try:
            ino = meta.lookup(ino, part.encode())
        except FsError:
            return None
    return ino


def make_tree(meta) -> list[str]:
    """ds/{train,val}/cNN/fNNN: a data set's layout. Returns the file paths."""
    paths = []
    ds = mkfile(meta, ROOT_INO, b"ds", mode=DIR).ino
    for split in ("train", "val"):
        top = mkfile(meta, ds, split.encode(), mode=DIR).ino
        for c in range(3):
            cls = mkfile(meta, top, f"c{c:02d}".encode(), mode=DIR).ino
            for f in range(4):
                mkfile(meta, cls, f"f{f:03d}".encode())
                paths.append(f"ds/{split}/c{c:02d}/f{f:03d}")
    return paths


def test_every_path_resolves_to_its_inode_and_missing_ones_to_none(meta):
    files = make_tree(meta)
    asked = files + [
        "ds/train/c00/missing",      # no such file
        "ds/nope/c00/f000",          # no such directory
        "ds/train/c00/f000/x",       # a file used as a directory
        "./ds//val/./c01/f002",      # spelled oddly
        "ds/train", ".", "",         # a directory, the root
    ]
    found = resolve_paths(meta, asked)
    assert found == [one_by_one(meta, rel) for rel in asked]
    assert all(ino is not None for ino in found[:len(files)])
    assert len(set(found[:len(files)])) == len(files)
    assert found[len(files):len(files) + 3] == [None, None, None]
    assert found[-2:] == [ROOT_INO, ROOT_INO]


def test_each_directory_is_looked_up_once_per_pass(meta, monkeypatch):
    files = make_tree(meta)
    lookups = collections.Counter()
    real = meta.lookup

    def counting(parent, name):
        lookups[(parent, name)] += 1
        return real(parent, name)

    monkeypatch.setattr(meta, "lookup", counting)
    resolve_paths(meta, files)
    # 1 ds + 2 splits + 6 classes + 24 files, each once
    assert sum(lookups.values()) == 1 + 2 + 6 + len(files)
    assert max(lookups.values()) == 1


def test_a_long_list_is_resolved_a_pass_at_a_time_with_the_loop_free_between(meta,
                                                                              monkeypatch):
    monkeypatch.setattr(resolve, "RESOLVE_PER_PASS", 16)  # passes without a huge tree
    files = make_tree(meta) * 5  # 120 paths: 8 passes
    steps = TaskSteps()
    result = []

    async def resolving():
        result.extend(await resolve_in_passes(meta, files))

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(resolving, name="resolving")

    trio.run(main, instruments=[steps])
    assert result == [one_by_one(meta, rel) for rel in files]
    # It gave the loop back after every pass: another request waits one pass at most.
    assert steps.steps["resolving"] >= len(files) // 16


def test_a_pass_can_run_elsewhere(meta):
    """A shared namespace resolves each pass in a worker thread (its view's call)."""
    files = make_tree(meta)
    calls = []

    async def in_thread(fn, *args):
        calls.append(len(args[1]))
        return await trio.to_thread.run_sync(fn, *args)

    found = trio.run(resolve_in_passes, meta, files, in_thread)
    assert found == [one_by_one(meta, rel) for rel in files]
    assert calls == [len(files)]  # one pass: fewer than RESOLVE_PER_PASS paths
    assert len(files) < RESOLVE_PER_PASS
