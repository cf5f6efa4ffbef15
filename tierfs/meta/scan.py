"""Whole-database scans for offline tools (fsck, recover): one read transaction
each, yielding decoded records in key order."""
from __future__ import annotations

from typing import Iterator

from . import schema as s
from .kv import prefix_end
from .schema import Extent, Inode, Pack, Ref


def _scan(store, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
    with store.kv.read() as txn:
        yield from store.kv.scan(txn, prefix, prefix_end(prefix))


def inodes(store) -> Iterator[Inode]:
    for key, val in _scan(store, b"I"):
        yield Inode.decode(s.read_u64(key, 1), val)


def inodes_by_number(store, inos) -> dict[int, Inode | None]:
    """The inodes numbered `inos` (None where missing), read in one round trip."""
    inos = list(inos)
    with store.kv.read() as txn:
        raws = store.kv.get_many(txn, [s.inode_key(i) for i in inos])
    return {i: None if raw is None else Inode.decode(i, raw) for i, raw in zip(inos, raws)}


def dentries(store) -> Iterator[tuple[int, bytes, int, int]]:
    """(parent, name, child ino, cookie)."""
    for key, val in _scan(store, b"D"):
        yield s.read_u64(key, 1), key[9:], s.read_u64(val), s.read_u64(val, 8)


def cookies(store) -> Iterator[tuple[int, int, bytes]]:
    """(parent, cookie, name)."""
    for key, val in _scan(store, b"K"):
        yield s.read_u64(key, 1), s.read_u64(key, 9), val


def extents(store) -> Iterator[tuple[int, int, Extent]]:
    for key, val in _scan(store, b"E"):
        ino, idx = s.split_extent_key(key)
        yield ino, idx, Extent.decode(val)


def extent_batches(store, size: int = 10_000) -> Iterator[list[tuple[int, int, Extent]]]:
    """Every extent, in batches of `size`, each read in a transaction of its own: the
    caller may write between batches, and never holds more than one in memory."""
    start, end = b"E", prefix_end(b"E")
    while True:
        with store.kv.read() as txn:
            batch = []
            for key, val in store.kv.scan(txn, start, end):
                batch.append((*s.split_extent_key(key), Extent.decode(val)))
                if len(batch) == size:
                    break
        if not batch:
            return
        yield batch
        start = s.extent_key(batch[-1][0], batch[-1][1]) + b"\0"


def packs(store) -> Iterator[tuple[int, Pack]]:
    for key, val in _scan(store, b"P"):
        yield s.read_u64(key, 1), Pack.decode(val)


def refs(store) -> Iterator[tuple[int, Ref]]:
    """(pack id, reference) of every live reference into a pack."""
    for key, val in _scan(store, b"R"):
        yield s.read_u64(key, 1), Ref.decode(key, val)


def paths_of(store, inos) -> dict[int, str]:
    """A path for each of `inos` (hard links: any of its names), holding in memory
    only the names on their way up: one pass over the dentries per level of the tree."""
    parent_of: dict[int, tuple[int, bytes]] = {}
    wanted = set(inos) - {s.ROOT_INO}
    while wanted:
        for parent, name, child, _cookie in dentries(store):
            if child in wanted:
                parent_of.setdefault(child, (parent, name))
        wanted = {parent_of[i][0] for i in wanted if i in parent_of} - set(parent_of) \
            - {s.ROOT_INO}
    out = {s.ROOT_INO: "/"}
    for ino in inos:
        chain, cur = [], ino
        while cur not in out and cur in parent_of and len(chain) <= len(parent_of):
            chain.append(cur)
            cur = parent_of[cur][0]
        base = out.get(cur)
        for node in reversed(chain):
            if base is None:
                out[node] = f"<unreachable inode {node}>"
                continue
            base = out[node] = base.rstrip("/") + "/" + parent_of[node][1].decode(errors="replace")
    return out
