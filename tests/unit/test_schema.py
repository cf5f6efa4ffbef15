"""The LMDB schema: record codecs round-trip, and key builders sort so that
prefix scans return dentries, cookies, xattrs and extents in order."""
from __future__ import annotations

import random
import struct

import pytest

from tierfs.meta import schema as s
from tierfs.meta.schema import DIRTY, HOT, PINNED, Extent, Inode, Superblock

U64_MAX = (1 << 64) - 1


# ---- records ---------------------------------------------------------------------
def test_superblock_round_trip():
    sb = Superblock(fs_id="0d5f6c1e-aaaa-4bbb-8ccc-123456789abc", extent_size=4 << 20,
                    created_ns=1_700_000_000_123_456_789)
    raw = sb.encode()
    assert Superblock.decode(raw) == sb
    assert sb.format_version == s.FORMAT_VERSION
    # A record written without created_ns (older writer) still decodes.
    old = b'{"extent_size": 1048576, "format": 1, "fs_id": "x"}'
    assert Superblock.decode(old) == Superblock(fs_id="x", extent_size=1 << 20, created_ns=0,
                                                format_version=1)
    assert 1 in s.READABLE_FORMATS and s.FORMAT_VERSION in s.READABLE_FORMATS


def test_superblock_encoding_is_deterministic():
    a = Superblock(fs_id="id", extent_size=1, created_ns=2)
    assert a.encode() == Superblock(fs_id="id", extent_size=1, created_ns=2).encode()


@pytest.mark.parametrize("inode", [
    Inode(1, 0o40755, 0, 0, nlink=2, parent=1),
    Inode(2, 0o100644, 1000, 1000, size=12345, nlink=3, atime_ns=1, mtime_ns=2,
          ctime_ns=3, rdev=0, generation=7, parent=0, next_cookie=3),
    # Every field at its limit: u32 mode/uid/gid/nlink, u64 sizes, i64 times.
    Inode(U64_MAX, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, size=U64_MAX, nlink=0xFFFFFFFF,
          atime_ns=(1 << 63) - 1, mtime_ns=-(1 << 63), ctime_ns=-1, rdev=U64_MAX,
          generation=U64_MAX, parent=U64_MAX, next_cookie=U64_MAX),
    Inode(5, 0o020600, 0, 0, rdev=(1 << 8) | 3),       # a character device
    Inode(6, 0o120777, 0, 0, size=4095),               # a symlink
])
def test_inode_round_trip(inode):
    raw = inode.encode()
    assert raw[0] == 1  # record version first
    assert Inode.decode(inode.ino, raw) == inode


def test_inode_defaults():
    node = Inode(9, 0o100600, 1, 2)
    assert (node.size, node.nlink, node.next_cookie, node.parent) == (0, 1, s.FIRST_COOKIE, 0)
    assert Inode.decode(9, node.encode()) == node


def test_inode_decode_rejects_wrong_length():
    raw = Inode(1, 0o100644, 0, 0).encode()
    with pytest.raises(struct.error):
        Inode.decode(1, raw[:-1])


@pytest.mark.parametrize("ext", [
    Extent(),
    Extent(flags=HOT | DIRTY),
    Extent(flags=HOT | PINNED, length=4 << 20, checksum=U64_MAX, obj_id=42,
           obj_off=8 << 20, obj_len=4 << 20),
    Extent(flags=0, length=0xFFFFFFFF, checksum=1, obj_id=U64_MAX, obj_off=U64_MAX,
           obj_len=U64_MAX),
])
def test_extent_round_trip(ext):
    raw = ext.encode()
    assert raw[0] == 1
    assert Extent.decode(raw) == ext


def test_extent_state_bits():
    e = Extent(flags=HOT | DIRTY)
    assert e.hot and e.dirty and not e.pinned
    e = Extent(flags=PINNED)
    assert e.pinned and not e.hot and not e.dirty
    assert len({HOT, DIRTY, PINNED}) == 3 and HOT & DIRTY == HOT & PINNED == DIRTY & PINNED == 0


def test_u64_helpers():
    for n in (0, 1, 255, 256, 1 << 32, U64_MAX):
        assert s.read_u64(s.u64(n)) == n
        assert len(s.u64(n)) == 8
    assert s.read_u64(b"xx" + s.u64(77), 2) == 77
    with pytest.raises(struct.error):
        s.u64(-1)


def test_object_names():
    assert s.object_name(1) == "data/0000000000000001"
    assert s.object_name(U64_MAX) == "data/ffffffffffffffff"
    ids = [0, 1, 15, 16, 255, 1 << 40, U64_MAX]
    names = [s.object_name(i) for i in ids]
    assert names == sorted(names)  # bucket listings come back in id order


# ---- keys -------------------------------------------------------------------------
def test_keys_have_distinct_table_tags():
    keys = {
        "S": s.SUPERBLOCK_KEY, "C": s.counter_key(b"ino"), "I": s.inode_key(1),
        "D": s.dentry_key(1, b"a"), "K": s.cookie_key(1, 3), "T": s.symlink_key(1),
        "X": s.xattr_key(1, b"user.a"), "E": s.extent_key(1, 0), "O": s.orphan_key(1),
        "G": s.gc_key(1), "U": s.intent_key(1), "P": s.pack_key(1), "R": s.ref_key(1, 0),
    }
    assert len(keys) == len({k[:1] for k in keys.values()})
    for tag, key in keys.items():
        assert key[:1] == tag.encode()


def test_key_layouts():
    assert s.inode_key(0x0102) == b"I" + bytes(6) + b"\x01\x02"
    assert s.dentry_key(1, b"name") == b"D" + s.u64(1) + b"name"
    assert s.dentry_prefix(1) == b"D" + s.u64(1)
    assert s.cookie_key(2, 3) == b"K" + s.u64(2) + s.u64(3)
    assert s.cookie_prefix(2) == b"K" + s.u64(2)
    assert s.xattr_key(3, b"user.x") == s.xattr_prefix(3) + b"user.x"
    assert s.extent_key(4, 5) == s.extent_prefix(4) + s.u64(5)
    assert s.split_extent_key(s.extent_key(4, 5)) == (4, 5)
    assert s.split_extent_key(s.extent_key(U64_MAX, U64_MAX)) == (U64_MAX, U64_MAX)
    assert s.orphan_key(6) == b"O" + s.u64(6)
    assert s.gc_key(7) == b"G" + s.u64(7)
    assert s.pack_key(8) == b"P" + s.u64(8)
    assert s.ref_key(8, 9) == s.ref_prefix(8) + s.u64(9)


def test_pack_round_trip_and_extent_ref():
    assert s.Pack.decode(s.Pack(64 << 20, 12345).encode()) == s.Pack(64 << 20, 12345)
    ext = s.Extent(flags=s.HOT, length=10, checksum=7, obj_id=3, obj_off=4096, obj_len=10)
    assert ext.ref == (3, 4096, 10)


def _scan(keys: list[bytes], prefix: bytes) -> list[bytes]:
    """What an LMDB prefix scan returns: keys in byte order that start with prefix."""
    return [k for k in sorted(keys) if k.startswith(prefix)]


def test_extent_keys_sort_numerically_and_group_by_inode():
    rng = random.Random(7)
    inos = [1, 2, 255, 256, 65535, 65536, 1 << 32, U64_MAX - 1]
    idxs = [0, 1, 2, 9, 10, 255, 256, 1280, 1 << 20, 1 << 33]
    pairs = [(i, x) for i in inos for x in idxs]
    keys = [s.extent_key(i, x) for i, x in pairs]
    rng.shuffle(keys)
    assert [s.split_extent_key(k) for k in sorted(keys)] == sorted(pairs)
    for ino in inos:
        got = [s.split_extent_key(k)[1] for k in _scan(keys, s.extent_prefix(ino))]
        assert got == idxs  # exactly this inode's extents, in index order


def test_cookie_keys_sort_numerically_and_group_by_directory():
    parents = [1, 2, 256, 1 << 40]
    cookies = [3, 4, 255, 256, 257, 65536, 1 << 35]
    keys = [s.cookie_key(p, c) for p in parents for c in cookies]
    random.Random(1).shuffle(keys)
    for p in parents:
        got = [s.read_u64(k, 9) for k in _scan(keys, s.cookie_prefix(p))]
        assert got == cookies


def test_dentry_prefix_scan_is_exactly_one_directory():
    names = [b"a", b"b", b"\xff" * 255, b"\x00x", b"zz", b"a" * 255]
    keys = [s.dentry_key(p, n) for p in (1, 2, 3, 256) for n in names]
    random.Random(2).shuffle(keys)
    for p in (1, 2, 3, 256):
        got = [k[9:] for k in _scan(keys, s.dentry_prefix(p))]
        assert got == sorted(names)
    # A parent whose big-endian number is a prefix of another's cannot collide:
    # the parent field is fixed width.
    assert not s.dentry_key(0x0100, b"").startswith(s.dentry_prefix(0x01))


def test_xattr_prefix_scan_is_exactly_one_inode():
    keys = [s.xattr_key(i, n) for i in (1, 2, 513) for n in (b"user.b", b"user.a", b"trusted.z")]
    for i in (1, 2, 513):
        got = [k[9:] for k in _scan(keys, s.xattr_prefix(i))]
        assert got == [b"trusted.z", b"user.a", b"user.b"]


def test_tables_do_not_interleave():
    # A scan of one table never runs into another: the single tag byte decides.
    keys = [s.inode_key(U64_MAX), s.dentry_key(U64_MAX, b"\xff" * 255),
            s.extent_key(U64_MAX, U64_MAX), s.cookie_key(0, 0), s.gc_key(0),
            s.orphan_key(U64_MAX), s.symlink_key(0), s.xattr_key(0, b"")]
    for tag in b"DEGIKOTX":
        prefix = bytes([tag])
        got = _scan(keys, prefix)
        assert all(k[:1] == prefix for k in got) and len(got) == 1
