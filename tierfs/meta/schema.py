"""The whole LMDB key/value schema of tierfs, in one place.

Keys are a one-byte table tag followed by big-endian integers (and raw names),
so an LMDB prefix scan returns a directory's entries, a file's extents or an
inode's xattrs in order. Values are struct-packed records whose first byte is a
record version, so a later format can still read older records.

  tag  key                                   value
  ---  ------------------------------------  ---------------------------------------------
  S    b'S'                                  Superblock: format version, extent size, fs id
  C    b'C' name                             counter (u64): b'ino', b'obj', b'epoch'
  I    b'I' ino:u64                          Inode (attributes, dir parent, next dir cookie)
  D    b'D' parent:u64 name                  Dentry: child ino:u64, cookie:u64
  K    b'K' parent:u64 cookie:u64            name (readdir order; cookies never reused)
  T    b'T' ino:u64                          symlink target bytes
  X    b'X' ino:u64 name                     xattr value bytes
  E    b'E' ino:u64 index:u64                Extent (state bits, length, xxh3, object ref)
  O    b'O' ino:u64                          owner : inode unlinked while open, purged when
                                             its owner's session ends (at mount on LMDB)
  G    b'G' object id:u64                    epoch:u64 [bytes:u64 [stamp:8]] : object to
                                             delete from the bucket once every kept checkpoint
                                             is newer than `epoch` (0: at once); its size when
                                             known; on a shared engine a random stamp, new each
                                             time the object is queued (gc's grace)
  U    b'U' object id:u64                    owner : upload in flight (gc'd if its owner dies)
  N    b'N' session:u64                      Session (JSON): one mount of a shared engine,
                                             with its heartbeat
  H    b'H' ino:u64 session:u64              bytes:u64 node name : a file with data only
                                             on that session's node (shared engines)
  W    b'W' ino:u64                          b'' : this node changed the file since it last
                                             published it (a node's own LMDB, shared mode)
  owner: b'' on LMDB (one node), else the session id:u64 of the mount that wrote it
  P    b'P' object id:u64                    Pack: total bytes:u64, live bytes:u64 (an object
                                             holding the extents of several small files)
  R    b'R' object id:u64 offset:u64         length:u64 ino:u64 index:u64 : one live reference
                                             into a pack, by the extent that holds it; the
                                             pack goes to gc when its last one is dropped

On a shared engine an extent record says only where its data is: flags are DIRTY
or 0 (hot and pinned belong to each node's own LMDB, and whether a hot copy was
checked to its memory); a DIRTY extent's
data is on one node only, and its obj_off names that node's session (obj_id 0).

An object without a P record holds one extent (format 1 wrote only these; large
extents still get them). Format 2 added P and R.

Directory cookies 1 and 2 are '.' and '..'; entries start at 3.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass

FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)  # older ones are upgraded in place at mount (nothing to rewrite)
FIRST_COOKIE = 3
ROOT_INO = 1

_U64 = struct.Struct(">Q")
_U64x2 = struct.Struct(">QQ")


def u64(n: int) -> bytes:
    return _U64.pack(n)


def read_u64(b: bytes, offset: int = 0) -> int:
    return _U64.unpack_from(b, offset)[0]


# ---- key builders -------------------------------------------------------------
SUPERBLOCK_KEY = b"S"


def counter_key(name: bytes) -> bytes:
    return b"C" + name


def inode_key(ino: int) -> bytes:
    return b"I" + _U64.pack(ino)


def dentry_key(parent: int, name: bytes) -> bytes:
    return b"D" + _U64.pack(parent) + name


def dentry_prefix(parent: int) -> bytes:
    return b"D" + _U64.pack(parent)


def cookie_key(parent: int, cookie: int) -> bytes:
    return b"K" + _U64x2.pack(parent, cookie)


def cookie_prefix(parent: int) -> bytes:
    return b"K" + _U64.pack(parent)


def symlink_key(ino: int) -> bytes:
    return b"T" + _U64.pack(ino)


def xattr_key(ino: int, name: bytes) -> bytes:
    return b"X" + _U64.pack(ino) + name


def xattr_prefix(ino: int) -> bytes:
    return b"X" + _U64.pack(ino)


def extent_key(ino: int, index: int) -> bytes:
    return b"E" + _U64x2.pack(ino, index)


def extent_prefix(ino: int) -> bytes:
    return b"E" + _U64.pack(ino)


def split_extent_key(key: bytes) -> tuple[int, int]:
    return _U64x2.unpack_from(key, 1)


def orphan_key(ino: int) -> bytes:
    return b"O" + _U64.pack(ino)


def gc_key(obj_id: int) -> bytes:
    return b"G" + _U64.pack(obj_id)


def intent_key(obj_id: int) -> bytes:
    return b"U" + _U64.pack(obj_id)


def session_key(sid: int) -> bytes:
    return b"N" + _U64.pack(sid)


def held_key(ino: int, sid: int) -> bytes:
    return b"H" + _U64x2.pack(ino, sid)


def held_prefix(ino: int) -> bytes:
    return b"H" + _U64.pack(ino)


def unpublished_key(ino: int) -> bytes:
    return b"W" + _U64.pack(ino)


def pack_key(obj_id: int) -> bytes:
    return b"P" + _U64.pack(obj_id)


def ref_key(obj_id: int, offset: int) -> bytes:
    return b"R" + _U64x2.pack(obj_id, offset)


def ref_prefix(obj_id: int) -> bytes:
    return b"R" + _U64.pack(obj_id)


_REF = struct.Struct(">QQQ")


@dataclass(frozen=True, slots=True)
class Ref:
    """A live reference into a pack: its bytes, and the extent that holds them."""
    offset: int
    length: int
    ino: int
    index: int

    def encode(self) -> bytes:
        return _REF.pack(self.length, self.ino, self.index)

    @classmethod
    def decode(cls, key: bytes, raw: bytes) -> "Ref":
        length, ino, index = _REF.unpack(raw)
        return cls(read_u64(key, 9), length, ino, index)


# ---- records ------------------------------------------------------------------
@dataclass(slots=True)
class Superblock:
    fs_id: str
    extent_size: int
    format_version: int = FORMAT_VERSION
    created_ns: int = 0
    shared: bool = False  # the namespace is in a shared engine (--meta-url), not LMDB

    def encode(self) -> bytes:
        d = {"format": self.format_version, "fs_id": self.fs_id,
             "extent_size": self.extent_size, "created_ns": self.created_ns}
        if self.shared:
            d["namespace"] = "shared"
        return json.dumps(d, sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "Superblock":
        d = json.loads(raw)
        # Valid JSON of another kind (a tierfs.json another tool wrote) is no superblock.
        if not (isinstance(d, dict) and isinstance(d.get("fs_id"), str)
                and isinstance(d.get("extent_size"), int) and d["extent_size"] > 0
                and isinstance(d.get("format"), int)):
            raise ValueError("not a tierfs superblock")
        return cls(fs_id=d["fs_id"], extent_size=d["extent_size"],
                   format_version=d["format"], created_ns=d.get("created_ns", 0),
                   shared=d.get("namespace") == "shared")


_INODE_V1 = struct.Struct("<BIIIQIqqqQQQQ")


@dataclass(slots=True)
class Inode:
    ino: int
    mode: int
    uid: int
    gid: int
    size: int = 0
    nlink: int = 1
    atime_ns: int = 0
    mtime_ns: int = 0
    ctime_ns: int = 0
    rdev: int = 0
    generation: int = 0
    parent: int = 0        # directories only: the one parent (for '..')
    next_cookie: int = FIRST_COOKIE  # directories only

    def encode(self) -> bytes:
        return _INODE_V1.pack(1, self.mode, self.uid, self.gid, self.size, self.nlink,
                              self.atime_ns, self.mtime_ns, self.ctime_ns, self.rdev,
                              self.generation, self.parent, self.next_cookie)

    @classmethod
    def decode(cls, ino: int, raw: bytes) -> "Inode":
        (_v, mode, uid, gid, size, nlink, at, mt, ct, rdev, gen, parent,
         cookie) = _INODE_V1.unpack(raw)
        return cls(ino, mode, uid, gid, size, nlink, at, mt, ct, rdev, gen, parent, cookie)


# Extent state bits
HOT = 1      # a copy is in the hot tier
DIRTY = 2    # the hot copy is newer than the bucket (never evicted)
PINNED = 4   # never evicted (user pin)

_EXTENT_V1 = struct.Struct("<BBIQQQQ")


@dataclass(slots=True)
class Extent:
    """One fixed-size piece [index*E, (index+1)*E) of a file.

    `length` and `checksum` describe the bytes held in the bucket (set when an
    upload completes); while DIRTY they describe nothing. The object reference
    (obj_id, obj_off, obj_len) allows packing several extents into one object.
    obj_id 0 means the extent was never uploaded.
    """
    flags: int = 0
    length: int = 0
    checksum: int = 0
    obj_id: int = 0
    obj_off: int = 0
    obj_len: int = 0

    @property
    def hot(self) -> bool:
        return bool(self.flags & HOT)

    @property
    def dirty(self) -> bool:
        return bool(self.flags & DIRTY)

    @property
    def pinned(self) -> bool:
        return bool(self.flags & PINNED)

    def encode(self) -> bytes:
        return _EXTENT_V1.pack(1, self.flags, self.length, self.checksum,
                               self.obj_id, self.obj_off, self.obj_len)

    @property
    def ref(self) -> tuple[int, int, int]:
        """(object id, offset, length): where its bytes are in the bucket."""
        return self.obj_id, self.obj_off, self.obj_len

    def published(self, holder: int) -> "Extent":
        """This node's record as a shared engine holds it: where the data is, no
        node-local bits; dirty data is named as held by session `holder`."""
        if self.dirty:
            return Extent(DIRTY, obj_off=holder)
        return Extent(0, self.length, self.checksum, self.obj_id, self.obj_off, self.obj_len)

    @property
    def holder(self) -> int:
        """The session holding a published dirty extent's data."""
        return self.obj_off if self.dirty else 0

    def same_data(self, other: "Extent") -> bool:
        """Whether two clean records name the same bytes in the bucket."""
        return (not self.dirty and not other.dirty and self.ref == other.ref
                and self.length == other.length and self.checksum == other.checksum)

    @classmethod
    def decode(cls, raw: bytes) -> "Extent":
        _v, flags, length, csum, oid, ooff, olen = _EXTENT_V1.unpack(raw)
        return cls(flags, length, csum, oid, ooff, olen)


@dataclass(slots=True)
class Session:
    """One mount of a shared engine. Times are the node's wall clock in ns, so the
    nodes' clocks must agree within a small part of the session timeout (NTP)."""
    sid: int
    node: str
    pid: int
    mountpoint: str
    started_ns: int
    heartbeat_ns: int

    def encode(self) -> bytes:
        return json.dumps({"node": self.node, "pid": self.pid, "mountpoint": self.mountpoint,
                           "started_ns": self.started_ns, "heartbeat_ns": self.heartbeat_ns},
                          sort_keys=True).encode()

    @classmethod
    def decode(cls, sid: int, raw: bytes) -> "Session":
        d = json.loads(raw)
        return cls(sid, d["node"], d["pid"], d["mountpoint"], d["started_ns"], d["heartbeat_ns"])


@dataclass(slots=True)
class Pack:
    """An object holding several extents: its size, and the bytes still referenced."""
    total: int
    live: int

    def encode(self) -> bytes:
        return _U64x2.pack(self.total, self.live)

    @classmethod
    def decode(cls, raw: bytes) -> "Pack":
        return cls(*_U64x2.unpack(raw))


def object_name(obj_id: int) -> str:
    """Bucket key of a data object: ids from a counter, never user paths."""
    return f"data/{obj_id:016x}"


SUPERBLOCK_OBJECT = "tierfs.json"  # bucket key naming the filesystem at a location
