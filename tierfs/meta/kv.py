"""The ordered key-value engine the metadata store runs on.

The store (store.py) holds every namespace rule and speaks only this small
interface; an engine holds everything specific to its database. Two engines:
  lmdb_kv.LmdbKV          LMDB in the node's cache dir (the embedded default)
  postgres_kv.PostgresKV  one table in a PostgreSQL database (shared by many nodes)

An engine provides:
  get(key)                one key's value (None if missing), read on its own: cheaper
                          than a transaction where the engine has round trips
  read()                  context manager: a consistent read-only transaction
  peek()                  context manager like read(), but each statement may see its own
                          snapshot (PostgreSQL: no BEGIN and COMMIT round trips): for
                          reads that tolerate a change between their statements
  write()                 context manager: a read-write transaction, committed on a
                          clean exit and rolled back on an exception
  run(fn, *args)          call fn(*args) (which opens its own transactions) and again
                          when the engine says the attempt may be retried (LMDB: its map
                          grew; PostgreSQL: a serialization failure or deadlock)
  scan(txn, start, end, values=True)
                          (key, value) pairs with start <= key < end in key order
                          (value None when values=False)
  last_keys(txn, start, end, limit)
                          the highest `limit` keys with start <= key < end, highest
                          first (a huge file's tail, without reading the rest)
  get_many(txn, keys)     the values of many keys (None where missing), in one round trip
                          where the engine has round trips
  scan_many(txn, ranges, values=True)
                          scan() of each (start, end) of disjoint ranges, as a list per
                          range; one statement (one round trip, one snapshot) on PostgreSQL
  now_ns(txn)             the engine's clock, in ns since the epoch: on a shared engine
                          the database server's, so nodes whose clocks differ agree on
                          how old a heartbeat is
  sync()                  committed transactions survive power loss (blocking)
  close()
  reading_in_thread()     context manager around a worker thread's long reads
  listen(on_change)       a shared engine calls on_change(inodes, entries, everything) for
                          what other nodes changed, from a thread, until the returned
                          listener's stop(); LMDB returns None (one node)
A transaction has get(key) -> bytes | None, put(key, value), delete(key) -> bool
(whether it existed) and pop(key) -> bytes | None.

Keys and values are bytes; keys compare bytewise (schema.py relies on it for
prefix scans).
"""
from __future__ import annotations

KEY_END = b"\xff" * 32  # above every key the schema builds (tags are ASCII letters)


def prefix_end(prefix: bytes) -> bytes:
    """The smallest key above every key starting with `prefix`."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return KEY_END
    return stripped[:-1] + bytes([stripped[-1] + 1])


def first_line(e: BaseException) -> str:
    """An error's message in one line (a database's can run to several), for logs."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def is_postgres_url(location: str) -> bool:
    return location.startswith(("postgresql://", "postgres://"))
