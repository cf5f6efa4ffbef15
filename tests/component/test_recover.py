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
from tierfs.tier.checkpoint import checkpoint_name, pack, snapshot
from tierfs.tier.recover import recover


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
    cold.put(checkpoint_name(1), pack(1, snapshot(old, str(tmp_path))))
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
