"""Recovery from the bucket's newest checkpoint, on a real LMDB and the memory store."""
from __future__ import annotations

import os
import stat

import pytest

from tierfs.cold.memory import MemoryStore
from tierfs.errors import ColdStoreError
from tierfs.filesystem import has_metadata, meta_dir
from tierfs.meta import MetaStore
from tierfs.meta.schema import ROOT_INO, Superblock
from tierfs.tier.checkpoint import checkpoint_name, pack, remove_copy, snapshot
from tierfs.tier.recover import recover


def copy_of(meta: MetaStore, workdir: str) -> bytes:
    """The LMDB file a checkpoint of `meta` holds."""
    path = snapshot(meta, workdir)
    try:
        with open(path, "rb") as f:
            return f.read()
    finally:
        remove_copy(path)


class DataListingFails:
    """The bucket fails its listing of data objects: recovery's last long step."""

    def __init__(self, inner):
        self.inner = inner

    def list(self, prefix=""):
        if prefix.startswith("data/"):
            raise ColdStoreError("injected: listing data/ failed", transient=True)
        return self.inner.list(prefix)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_recovery_that_fails_halfway_leaves_no_metadata_behind(tmp_path):
    """Killed or failing halfway, a recovery must leave the cache dir without
    metadata, so that the next mount recovers again instead of taking half-fixed
    records (dirty extents with no hot file, counters not raised) as its own."""
    cold = MemoryStore()
    old = MetaStore(str(tmp_path / "old"))
    old.format(Superblock(fs_id="r", extent_size=1 << 20), 0, 0)
    old.create_node(ROOT_INO, b"kept", stat.S_IFREG | 0o644, 0, 0)
    cold.put(checkpoint_name(1), pack(1, copy_of(old, str(tmp_path))))
    old.close()

    cache = tmp_path / "cache"
    os.makedirs(cache)
    with pytest.raises(ColdStoreError):
        recover(DataListingFails(cold), meta_dir(str(cache)))
    assert not has_metadata(str(cache))

    meta, report = recover(cold, meta_dir(str(cache)))
    try:
        assert has_metadata(str(cache)) and report.checkpoint == 1
        assert meta.lookup(ROOT_INO, b"kept")
        assert not os.path.exists(meta_dir(str(cache)) + ".recovering")
    finally:
        meta.close()


def _one_file_db(tmp_path) -> bytes:
    """The metadata of a filesystem holding one file, "kept", as a checkpoint holds it."""
    old = MetaStore(str(tmp_path / "old"))
    old.format(Superblock(fs_id="r", extent_size=1 << 20), 0, 0)
    old.create_node(ROOT_INO, b"kept", stat.S_IFREG | 0o644, 0, 0)
    db = copy_of(old, str(tmp_path))
    old.close()
    return db


@pytest.mark.parametrize("damage", [(b'"size"', b'"sizf"'), (b'{"seq"', b'null\n')],
                         ids=["key flipped", "header not an object"])
def test_a_checkpoint_whose_header_is_damaged_but_parses_is_skipped(tmp_path, damage):
    """A damaged header that is still valid JSON (one flipped byte in a key) is a
    damaged checkpoint like any other: recovery takes the one before it, instead of
    failing the mount with an internal error."""
    cold = MemoryStore()
    db = _one_file_db(tmp_path)
    cold.put(checkpoint_name(1), pack(1, db))
    newest = pack(2, db)
    assert damage[0] in newest
    cold.put(checkpoint_name(2), newest.replace(damage[0], damage[1], 1))

    meta, report = recover(cold, meta_dir(str(tmp_path / "cache")))
    try:
        assert report.checkpoint == 1 and report.skipped_checkpoints == [2]
        assert meta.lookup(ROOT_INO, b"kept")
    finally:
        meta.close()


class PrunedWhileRecovering:
    """The live holder (a `tierfs dump` of a mounted filesystem reads its bucket)
    puts a newer checkpoint and prunes the one recovery listed, just before
    recovery's GET of it."""

    def __init__(self, inner, listed: int, newer: int, blob: bytes):
        self.inner = inner
        self.listed, self.newer, self.blob = listed, newer, blob
        self.pruned = False

    def get(self, key, offset=0, length=None):
        if key == checkpoint_name(self.listed) and not self.pruned:
            self.pruned = True
            self.inner.put(checkpoint_name(self.newer), self.blob)
            self.inner.delete(key)
        return self.inner.get(key, offset, length)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_checkpoint_pruned_between_listing_and_reading_it_is_not_a_failure(tmp_path):
    """A checkpoint is pruned only once a newer one landed: recovery that finds the
    one it listed gone reads the newer one, instead of failing as if the bucket
    had failed."""
    cold = MemoryStore()
    db = _one_file_db(tmp_path)
    cold.put(checkpoint_name(1), pack(1, db))
    cold.put(checkpoint_name(2), pack(2, db))

    racing = PrunedWhileRecovering(cold, listed=2, newer=3, blob=pack(3, db))
    meta, report = recover(racing, meta_dir(str(tmp_path / "cache")))
    try:
        assert report.checkpoint == 3 and report.skipped_checkpoints == []
        assert meta.lookup(ROOT_INO, b"kept")
    finally:
        meta.close()
