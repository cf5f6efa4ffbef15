"""How tierfs.hint() cuts a list into requests and makes its paths relative."""
from __future__ import annotations

import json
import os

import pytest

from tierfs import hints
from tierfs.hints import HintingSampler


def slices(rel):
    return list(hints._requests(rel))


def test_a_long_list_goes_in_requests_of_at_most_paths_per_request(monkeypatch):
    monkeypatch.setattr(hints, "PATHS_PER_REQUEST", 4)
    rel = [f"f{i}" for i in range(10)]
    assert slices(rel) == [(0, 4), (4, 8), (8, 10)]
    assert slices(rel[:4]) == [(0, 4)]
    assert slices([]) == [(0, 0)]


def test_long_paths_cut_requests_by_bytes_too(monkeypatch):
    monkeypatch.setattr(hints, "BYTES_PER_REQUEST", 100)
    rel = ["x" * 40] * 5  # 44 bytes each on the wire
    assert slices(rel) == [(0, 2), (2, 4), (4, 5)]
    assert slices(["y" * 500, "z"]) == [(0, 1), (1, 2)]  # one path over the bound goes alone


def test_every_request_of_a_million_paths_stays_below_the_daemon_limit():
    from tierfs.fs.control import MAX_REQUEST
    rel = [f"dataset/train/class{i % 1000:04d}/sample{i:08d}.jpeg" for i in range(1_000_000)]
    cuts = slices(rel)
    assert cuts[0][0] == 0 and cuts[-1][1] == len(rel)
    assert all(a[1] == b[0] for a, b in zip(cuts, cuts[1:]))
    for start, end in cuts:
        assert 0 < end - start <= hints.PATHS_PER_REQUEST
        line = json.dumps({"cmd": "hint", "paths": rel[start:end], "replace": False})
        assert len(line) < MAX_REQUEST


def test_paths_are_made_relative_to_the_mount_whatever_their_spelling(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root = str(tmp_path / "mnt")
    spelled = [f"{root}/a/b", "mnt/a/c", f"{root}//a/./d", f"{root}/a/../e", root]
    absolute = [hints._absolute(p) for p in spelled]
    assert absolute == [os.path.abspath(p) for p in spelled]
    assert hints._relative(absolute, root) == ["a/b", "a/c", "a/d", "e", "."]
    with pytest.raises(ValueError, match="not inside the tierfs mount"):
        hints._relative([f"{root}x/f"], root)


def test_a_sampler_over_the_same_files_takes_over_the_list_of_the_one_before():
    """Each HintingSampler hints on a list named after its files: one made anew over
    the same files every epoch replaces its predecessor's list, where a list per
    sampler would leave the old ones queued beside it; other files get their own."""
    train = [f"/mnt/t/ds/{i}" for i in range(10)]
    first, again = HintingSampler(range(10), train), HintingSampler(range(10), list(train))
    other = HintingSampler(range(3), ["/mnt/t/val/0", "/mnt/t/val/1", "/mnt/t/val/2"])
    assert first._list == again._list != other._list
