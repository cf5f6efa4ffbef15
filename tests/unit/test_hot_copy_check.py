"""Checking a hot extent file against its record, in pieces (HotStore.copy_matches,
checksum.HotCopyCheck), gives what the one-piece rule (checksum.hot_copy_matches)
gives, on a real directory."""
from __future__ import annotations

import os

import pytest

from tierfs.checksum import HotCopyCheck, hot_copy_matches, xxh3
from tierfs.hot import store as hot_store
from tierfs.hot.store import HotStore

E = 4 << 20


@pytest.mark.parametrize("size", [0, 1, 4095, 65536, E - 1, E])
@pytest.mark.parametrize("shape", ["exact", "hole at the end", "one byte more", "damaged"])
def test_copy_matches_agrees_with_the_one_piece_rule(tmp_path, size, shape):
    store = HotStore(str(tmp_path / "hot"))
    data = os.urandom(size)
    length, on_disk = size, data
    if shape == "hole at the end":      # the object ends in zeros the file lacks
        length = size + 5000
    elif shape == "one byte more":
        on_disk = data + b"x"
    elif shape == "damaged" and size:
        on_disk = data[:-1] + bytes([data[-1] ^ 1])
    checksum = xxh3(data + bytes(length - size))
    store.install_temp(store.write_temp(7, 3, on_disk), 7, 3)
    expected = hot_copy_matches(on_disk, length, checksum)
    assert expected == (shape in ("exact", "hole at the end") or (shape == "damaged" and not size))
    assert store.copy_matches(7, 3, length, checksum) is expected
    store.close()


def test_pieces_smaller_than_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(hot_store, "CHECK_PIECE", 4096)
    monkeypatch.setattr(hot_store, "_local", type(hot_store._local)())  # a new buffer
    store = HotStore(str(tmp_path / "hot"))
    data = os.urandom(3 * 4096 + 17)
    store.install_temp(store.write_temp(1, 0, data), 1, 0)
    assert store.copy_matches(1, 0, len(data), xxh3(data))
    assert not store.copy_matches(1, 0, len(data) - 1, xxh3(data[:-1]))  # file too long
    check = HotCopyCheck(len(data) + 3, xxh3(data + bytes(3)))
    for at in range(0, len(data), 1000):
        check.update(data[at:at + 1000])
    assert check.matches()


def test_a_missing_file_says_so(tmp_path):
    store = HotStore(str(tmp_path / "hot"))
    with pytest.raises(FileNotFoundError):
        store.copy_matches(7, 3, 10, 0)
