"""The hot tier's index (tier/cache.py) under random bookkeeping: its extents per
inode, upload queue and per-inode dirty counts always agree with a walk over the
extents."""
from __future__ import annotations

import random

import pytest

from tierfs.tier.cache import HotIndex

E = 1 << 20


def check(index: HotIndex, taken: set, given_back: set, unchecked: set) -> None:
    dirty = index.dirty
    assert index.unchecked == unchecked  # clean copies found at mount, not read since
    assert set(index.queued) <= set(dirty)
    assert set(dirty) - set(index.queued) == taken & set(dirty)
    assert index.dirty_bytes == sum(index.sizes[k] for k in dirty)
    inos = {k[0] for k in dirty}
    for ino in inos | {1, 2, 3}:
        assert index.indices(ino) == sorted(i for j, i in index.sizes if j == ino)
        assert index.has_dirty(ino) == (ino in inos)
        assert index.dirty_bytes_of({ino}) == sum(index.sizes[k] for k in dirty if k[0] == ino)
    assert index.dirty_bytes_of(None) == index.dirty_bytes
    assert index.dirty_bytes_of({1, 2}) == sum(index.sizes[k] for k in dirty if k[0] in (1, 2))
    assert index.rush <= inos  # an inode with nothing dirty is not rushed
    # Those to upload at once come first, then the rest in order of their last write
    # (one given back after an upload that failed goes to the back all the same).
    order = list(index.queued)
    first = [k for k in order if dirty[k].found or k[0] in index.rush]
    rest = [k for k in order if not (dirty[k].found or k[0] in index.rush)]
    assert order == first + rest
    writes = [dirty[k].last_write for k in rest if k not in given_back]
    assert writes == sorted(writes)


@pytest.mark.parametrize("seed", range(8))
def test_the_upload_queue_and_dirty_counts_follow_every_change(seed):
    rng = random.Random(seed)
    index, taken, given_back, unchecked = HotIndex(), set(), set(), set()
    for step in range(3000):
        key = (rng.randint(1, 3), rng.randint(0, 5))
        op = rng.choice(["write", "write", "write", "add", "add_found", "remove", "clean",
                         "take", "give_back", "rush", "set_size", "grow"])
        if op == "write":
            index.written(key, rng.randint(0, E))
            given_back.discard(key)
            unchecked.discard(key)
        elif op == "add":  # a new life for the extent: any upload of it is stale
            dirty, checked = rng.random() < 0.5, rng.random() < 0.5
            index.add(key, rng.randint(0, E), dirty=dirty, checked=checked)
            taken.discard(key)
            given_back.discard(key)
            if dirty or checked:
                unchecked.discard(key)
            else:
                unchecked.add(key)
        elif op == "add_found":
            index.add(key, rng.randint(0, E), dirty=True, checked=False,
                      last_write=rng.random())
            taken.discard(key)
            given_back.discard(key)
            unchecked.discard(key)  # dirty: its bytes are what this node wrote
        elif op == "remove":
            index.remove(key)
            unchecked.discard(key)
        elif op == "clean" and key in index.dirty:
            gen = index.dirty[key].gen if rng.random() < 0.8 else -1
            assert index.cleaned(key, gen) == (gen != -1)
        elif op == "take" and key in index.queued:
            index.take(key)
            taken.add(key)
        elif op == "give_back" and key in taken:
            taken.discard(key)
            index.give_back(key)
            given_back.add(key)
        elif op == "rush":
            index.rush_inode(key[0])
        elif op == "set_size":
            index.set_size(key, rng.randint(0, E))
        elif op == "grow" and key in index.sizes:  # as its callers: an extent there
            index.grow(key, rng.randint(0, E))
        taken &= set(index.dirty)  # gone (removed, cleaned): no upload holds it
        check(index, taken, given_back, unchecked)
