"""Evicted hot files are reused as spares, never while anyone still has them open.

On a real directory: the store's files are the thing under test."""
from __future__ import annotations

import os

import pytest

from tierfs.hot.store import HotStore


def put(store: HotStore, ino: int, data: bytes) -> int:
    """Write and install extent (ino, 0); its inode number."""
    store.install_temp(store.write_temp(ino, 0, data), ino, 0)
    return os.stat(store.path(ino, 0)).st_ino


def spares(store: HotStore) -> list[os.stat_result]:
    return [os.stat(os.path.join(store.spare_dir, n)) for n in os.listdir(store.spare_dir)]


def test_an_evicted_file_becomes_an_empty_spare_and_is_reused(tmp_path):
    store = HotStore(str(tmp_path / "hot"))
    first = put(store, 1, b"a" * 70_000)
    store.remove(1, 0)
    if not store.leases:
        pytest.skip("the kernel refuses file leases here: evicted files are unlinked")
    assert not os.path.exists(store.path(1, 0))
    [spare] = spares(store)
    assert (spare.st_ino, spare.st_size, spare.st_blocks) == (first, 0, 0)  # no space held
    assert put(store, 2, b"b" * 1000) == first
    with open(store.path(2, 0), "rb") as f:
        assert f.read() == b"b" * 1000  # nothing of the evicted file's bytes
    assert spares(store) == []


def test_a_file_someone_has_open_is_unlinked_not_reused(tmp_path):
    store = HotStore(str(tmp_path / "hot"))
    first = put(store, 1, b"a" * 5000)
    fd = os.open(store.path(1, 0), os.O_RDONLY)  # as a descriptor the direct path handed out
    try:
        store.remove(1, 0)
        assert not os.path.exists(store.path(1, 0))
        assert spares(store) == []
        assert put(store, 2, b"b" * 5000) != first
        assert os.pread(fd, 10_000, 0) == b"a" * 5000  # the reader keeps its bytes
    finally:
        os.close(fd)


def test_a_new_store_takes_over_the_spares_left_behind(tmp_path):
    old = HotStore(str(tmp_path / "hot"))
    inos = {put(old, i, b"x" * 100) for i in range(1, 4)}
    for i in range(1, 4):
        old.remove(i, 0)
    old.close()
    if not old.leases:
        pytest.skip("the kernel refuses file leases here: evicted files are unlinked")
    new = HotStore(str(tmp_path / "hot"))
    assert {put(new, i, b"y") for i in range(10, 13)} == inos
    assert list(new.scan()) and all(size == 1 for _i, _x, size, _m in new.scan())
