"""`tierfs dump` and `tierfs load`: a namespace as one file, to move it between
engines (LMDB and PostgreSQL) or keep it.

The file is a JSON header line, then every record as (key length u32, value
length u32, key, value), in key order:
  {"tierfs_dump": 1, "format": 2, "fs_id": ..., "records": N, "xxh3": "<hex of the body>"}
Records are the engine-neutral ones of schema.py. What describes one node rather
than the namespace is left out: the hot bits of extents (the target has no hot
copies). A namespace with data not in the bucket yet (dirty extents), or with
mounts still open on it (sessions), is refused: the dump would lose that data or
race those mounts. A load writes into an empty target only, the superblock last,
so a load cut short leaves no filesystem that looks complete.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import replace
from typing import Iterator

import xxhash

from ..errors import UserError
from . import schema as s
from .kv import KEY_END
from .schema import DIRTY, HOT, Extent

MAGIC = "tierfs_dump"
VERSION = 1
_LENGTHS = struct.Struct(">II")
BATCH = 1000  # records per load transaction


def _records(meta) -> Iterator[tuple[bytes, bytes]]:
    """Every record of the namespace, node-local bits cleared; refuses what cannot
    move (one read transaction: a consistent snapshot)."""
    with meta.kv.read() as txn:
        dirty = 0
        for key, val in meta.kv.scan(txn, b"", KEY_END):
            tag = key[:1]
            if tag == b"N":
                raise UserError("the namespace has open mounts (sessions): unmount them "
                                "before dumping it")
            if tag == b"E":
                ext = Extent.decode(val)
                if ext.flags & DIRTY:
                    dirty += 1
                    continue
                if ext.flags & HOT:
                    val = replace(ext, flags=ext.flags & ~HOT).encode()
            yield key, val
        if dirty:
            raise UserError(f"{dirty} extents hold data that is not in the bucket yet: mount "
                            "the filesystem, run `tierfs sync --wait`, unmount, then dump")


def _chunk(key: bytes, val: bytes) -> bytes:
    """One record as the file holds it (and its checksum covers)."""
    return _LENGTHS.pack(len(key), len(val)) + key + val


def _write_body(meta, body_path: str):
    digest, count = xxhash.xxh3_64(), 0
    with open(body_path, "wb") as body:
        for key, val in _records(meta):
            chunk = _chunk(key, val)
            digest.update(chunk)
            body.write(chunk)
            count += 1
    return count, digest


def _is_empty(meta) -> bool:
    with meta.kv.read() as txn:
        return next(iter(meta.kv.scan(txn, b"", KEY_END, values=False)), None) is None


def dump(meta, path: str) -> int:
    """Write the namespace of `meta` to `path`; the number of records."""
    sb = meta.superblock()
    if sb is None:
        raise UserError("the source holds no tierfs filesystem")
    body_path = path + ".body"
    try:
        # run(): a database that fails for a while restarts the whole (consistent) read.
        count, digest = meta.kv.run(_write_body, meta, body_path)
    except BaseException:
        os.unlink(body_path)  # a refused or failed dump leaves nothing behind
        raise
    header = {MAGIC: VERSION, "format": sb.format_version, "fs_id": sb.fs_id,
              "records": count, "xxh3": digest.hexdigest()}
    with open(path, "wb") as out, open(body_path, "rb") as body:
        out.write(json.dumps(header, sort_keys=True).encode() + b"\n")
        while chunk := body.read(1 << 20):
            out.write(chunk)
        out.flush()
        os.fsync(out.fileno())
    os.unlink(body_path)
    return count


def _read(path: str) -> tuple[dict, Iterator[tuple[bytes, bytes]]]:
    f = open(path, "rb")
    try:
        header = json.loads(f.readline())
        # Valid JSON of another kind, or a header missing what check() reads: no dump.
        if (not isinstance(header, dict) or header.get(MAGIC) != VERSION
                or not {"format", "records", "xxh3"} <= header.keys()):
            raise ValueError("not a tierfs dump")
    except ValueError:
        f.close()
        raise UserError(f"{path} is not a tierfs dump (version {VERSION})") from None

    def records() -> Iterator[tuple[bytes, bytes]]:
        with f:
            while head := f.read(_LENGTHS.size):
                if len(head) < _LENGTHS.size:
                    raise UserError(f"{path} is cut short: dump the namespace again")
                klen, vlen = _LENGTHS.unpack(head)
                data = f.read(klen + vlen)
                if len(data) < klen + vlen:
                    raise UserError(f"{path} is cut short: dump the namespace again")
                yield data[:klen], data[klen:]
    return header, records()


def check(path: str) -> dict:
    """The dump's header once its body matches the checksum and count it states."""
    header, records = _read(path)
    digest, count = xxhash.xxh3_64(), 0
    for key, val in records:
        digest.update(_chunk(key, val))
        count += 1
    if count != header["records"] or digest.hexdigest() != header["xxh3"]:
        raise UserError(f"{path} is damaged (its checksum or record count does not match): "
                        "use another copy, or dump the namespace again")
    return header


def load(path: str, header: dict, meta) -> None:
    """Write the dump at `path`, whose header check(path) returned (checked before
    the target was opened, so a damaged dump creates nothing), into `meta`, which
    must be empty."""
    if header["format"] not in s.READABLE_FORMATS:
        raise UserError(f"{path} holds format {header['format']}; this tierfs reads "
                        f"{s.READABLE_FORMATS}: use a newer tierfs release")
    if not meta.kv.run(_is_empty, meta):
        raise UserError("the target already holds metadata: load into a new cache dir "
                        "or an empty database schema")
    superblock = None
    batch: list[tuple[bytes, bytes]] = []
    _header, records = _read(path)
    for key, val in records:
        if key == s.SUPERBLOCK_KEY:
            superblock = val
            continue
        batch.append((key, val))
        if len(batch) >= BATCH:
            meta.kv.run(_put_all, meta.kv, batch)
            batch = []
    if superblock is None:
        raise UserError(f"{path} holds no superblock: dump the namespace again")
    meta.kv.run(_put_all, meta.kv, batch + [(s.SUPERBLOCK_KEY, superblock)])
    meta.epoch = meta.peek_counter(b"epoch")
    # What the source node held open or was uploading when it stopped is nobody's now.
    for ino in meta.orphans():
        meta.purge_orphan(ino)
    meta.abandon_intents()
    meta.sync()


def _put_all(kv, items) -> None:
    with kv.write() as txn:
        for key, val in items:
            txn.put(key, val)
