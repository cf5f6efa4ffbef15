"""Builds format1-bucket.tar.gz: a filesystem made by tierfs at format version 1
(one object per extent), kept so that every later release is tested against it
(tests/fuse/test_format_upgrade.py). It was run once, as root, with the tierfs of
commit 882eaa5 on PYTHONPATH:

    PYTHONPATH=/path/to/tierfs-882eaa5 python tests/data/make_format1.py OUT.tar.gz

Contents (what the test checks): see FILES; every byte comes from content().
"""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile

E = 64 << 10  # the filesystem's extent size


def content(seed: int, n: int) -> bytes:
    """Deterministic, compressible bytes (the tarball stays small)."""
    line = bytes(f"tierfs format 1, file {seed:03d}, ", "ascii")
    return (line * (n // len(line) + 1))[:n]


# path -> bytes; "sparse" has a hole between its two extents of data
FILES = {
    "small/a.txt": b"hello from format 1\n",
    "small/b.bin": content(2, 10_000),
    "small/c.bin": content(3, E),          # exactly one extent
    "big.bin": content(4, 4 * E + 123),   # five extents, the last one short
    "deep/er/file": content(5, 777),
    "empty": b"",
}
SPARSE = ("sparse", content(6, 1000), 3 * E, content(7, 2000))  # head, hole to, tail
SYMLINK = ("link", "small/a.txt")
XATTR = ("small/a.txt", "user.origin", b"format-1")


def main(out: str) -> None:
    work = tempfile.mkdtemp(prefix="tierfs-fmt1-")
    bucket, cache, mnt = (os.path.join(work, d) for d in ("bucket", "cache", "mnt"))
    for d in (bucket, mnt):
        os.makedirs(d)
    tierfs = [sys.executable, "-m", "tierfs"]
    subprocess.run(tierfs + ["mount", f"file://{bucket}", mnt, "--cache-dir", cache,
                             "--extent-size", "64K"], check=True)
    try:
        for rel, data in FILES.items():
            path = os.path.join(mnt, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
        name, head, at, tail = SPARSE
        with open(os.path.join(mnt, name), "wb") as f:
            f.write(head)
            f.seek(at)
            f.write(tail)
        os.symlink(SYMLINK[1], os.path.join(mnt, SYMLINK[0]))
        os.setxattr(os.path.join(mnt, XATTR[0]), XATTR[1], XATTR[2])
    finally:
        subprocess.run(tierfs + ["umount", mnt], check=True)  # uploads and checkpoints
    with tarfile.open(out, "w:gz") as tar:
        tar.add(bucket, arcname="bucket")


if __name__ == "__main__":
    main(sys.argv[1])
