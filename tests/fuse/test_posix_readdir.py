"""readdir through the mount: huge directories and listings that run while the
directory changes."""
from __future__ import annotations

import collections
import os
import random

import pytest

from tests.fuse.test_posix_common import (d, getdents, raw_dirents, start_shared,  # noqa: F401
                                          stop_shared)


@pytest.fixture(scope="module")
def shared_mnt(tmp_path_factory):
    # Listing does not depend on the data cache options: the default mount only.
    m = start_shared(tmp_path_factory)
    yield m
    stop_shared(m)


def listing(path: str, limit: int) -> list[str]:
    """os.scandir names, failing (not hanging) if a listing never ends."""
    out = []
    with os.scandir(path) as it:
        for entry in it:
            out.append(entry.name)
            assert len(out) <= limit, f"listing of {path} runs past {limit} entries"
    return out


def test_readdir_30k_entries_complete(d):
    # Many pages both ways: hundreds of kernel readdir calls, over a hundred of the
    # daemon's store pages of 256 entries. Kept fast: one mknod round trip per entry (no open/close), names
    # in a dir fd so the path is not walked each time; 10-25 s on 2 cores.
    n = 30_000
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i in range(n):
            os.mknod(f"e{i:06d}", dir_fd=fd)
    finally:
        os.close(fd)
    names = listing(d, 2 * n)
    assert len(names) == n
    assert len(set(names)) == n
    assert set(names) == {f"e{i:06d}" for i in range(n)}
    assert os.stat(d).st_nlink == 2
    # A second listing (now with every inode in the kernel's cache) agrees,
    # and getdents shows '.' and '..' exactly once each.
    raw = collections.Counter(name for name, _ino in raw_dirents(d))
    assert raw[b"."] == 1 and raw[b".."] == 1
    assert len(raw) == n + 2 and max(raw.values()) == 1


def test_readdir_while_directory_changes(d):
    rng = random.Random(1234)
    stable = {f"stable{i:05d}" for i in range(3000)}
    doomed = [f"doomed{i:05d}" for i in range(1500)]
    for name in sorted(stable) + doomed:
        os.mknod(os.path.join(d, name))
    ever = stable | set(doomed)
    alive = set(ever)
    rng.shuffle(doomed)
    new_names = []
    seen = []
    with os.scandir(d) as it:
        for step, entry in enumerate(it):
            seen.append(entry.name)
            assert len(seen) < 20_000, "the listing does not end"
            if step % 7:
                continue
            # Churn while the listing is half done: unlink old entries, create
            # new ones, and unlink some of the new ones again.
            for _ in range(3):
                if doomed:
                    name = doomed.pop()
                    os.unlink(os.path.join(d, name))
                    alive.discard(name)
            for _ in range(2):
                name = f"new{len(new_names):05d}"
                os.mknod(os.path.join(d, name))
                new_names.append(name)
                ever.add(name)
                alive.add(name)
            if len(new_names) % 10 == 0:
                name = new_names[-5]
                os.unlink(os.path.join(d, name))
                alive.discard(name)
    counts = collections.Counter(seen)
    dupes = [n for n, c in counts.items() if c > 1]
    assert not dupes, f"listed more than once: {dupes[:10]}"
    missing = stable - set(seen)
    assert not missing, f"{len(missing)} stable entries missing, e.g. {sorted(missing)[:5]}"
    assert set(seen) <= ever, sorted(set(seen) - ever)[:10]
    assert len(new_names) > 500 and len(doomed) == 0  # the churn really overlapped
    # A fresh listing afterwards shows exactly the final state.
    assert set(listing(d, 20_000)) == alive


def test_readdir_resumes_at_offset(d):
    # The d_off of an entry is the daemon's cookie: seeking to it (telldir /
    # seekdir) must resume right after that entry, also after entries before
    # it were removed.
    for i in range(300):
        os.mknod(os.path.join(d, f"f{i:03d}"))
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        full = []
        while batch := getdents(fd, 4096):
            full += batch
            assert len(full) < 1000, "the listing does not end"
        names = [n for n, _i, _o in full]
        assert names[:2] == [b".", b".."] and len(names) == 302
        mark = 100
        for name in names[2:mark]:
            os.unlink(os.path.join(d, os.fsdecode(name)))
        os.lseek(fd, full[mark][2], os.SEEK_SET)
        rest = []
        while batch := getdents(fd, 4096):
            rest += batch
            assert len(rest) < 1000, "the listing does not end"
        assert [n for n, _i, _o in rest] == names[mark + 1:]
        os.lseek(fd, 0, os.SEEK_SET)
        again = []
        while batch := getdents(fd, 4096):
            again += batch
            assert len(again) < 1000, "the listing does not end"
        assert [n for n, _i, _o in again] == names[:2] + names[mark:]
    finally:
        os.close(fd)
