"""PostgreSQL engine for the metadata store: the namespace in one table that
every node shares.

Keys and values are the same bytes LMDB holds (schema.py), in
`tierfs_kv(k bytea primary key, v bytea)`; bytea compares bytewise, so prefix
scans return what LMDB's cursors do. Writes run SERIALIZABLE, so every store
operation is one transaction that either sees no concurrent change or fails
with a serialization failure and is run again (`run`). Reads run REPEATABLE
READ, READ ONLY: one snapshot, never a serialization failure.

While the server cannot be reached a call waits (reconnecting) up to `wait`
seconds, then fails with EIO; a write whose connection was lost while its COMMIT
was in flight is looked up (`outcome`: never run twice), a read is run again. A server
that keeps its connections but does not answer gets as long for each statement
(at least MIN_ANSWER_WAIT; postgres_deadline.py), then the call fails with EIO.
"""
from __future__ import annotations

import bisect
import contextlib
import errno
import functools
import hashlib
import logging
import os
import random
import socket
import time
from typing import Iterator
from urllib.parse import urlsplit

from ..errors import FsError, UserError
from .kv import first_line
from .postgres_feed import Changes, Listener, new_sender, payload
from .postgres_pool import Connections, NoConnectionSlot

log = logging.getLogger("tierfs.meta")

SCHEMA_VERSION = 1
SCAN_BATCH = 512
CONNECT_TIMEOUT = 5  # seconds for one connection attempt
MIN_ANSWER_WAIT = 1.0  # seconds a statement gets at least, whatever `wait` is

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tierfs_schema (version integer NOT NULL);
CREATE TABLE IF NOT EXISTS tierfs_kv (k bytea PRIMARY KEY, v bytea NOT NULL);
"""


def describe(url: str) -> str:
    """The URL without its password, for messages."""
    parts = urlsplit(url)
    host = parts.hostname or "local socket"
    port = f":{parts.port}" if parts.port else ""
    user = f"{parts.username}@" if parts.username else ""
    return f"postgresql://{user}{host}{port}{parts.path}"


def application_name(role: str = "") -> str:
    """What pg_stat_activity shows for this process's connections (unless the URL
    names one): the node, the pid, and "feed" for the change feed's connection."""
    words = ["tierfs", role, socket.gethostname(), f"pid {os.getpid()}"]
    return " ".join(w for w in words if w)[:63]  # NAMEDATALEN


class _Retry(UserError):
    """The attempt failed in a way that running it again may fix. `run` catches it;
    one that escapes a caller without `run` still reads as one line."""

    def __str__(self) -> str:
        return (f"the metadata database failed ({first_line(self.args[0])}): check that "
                "PostgreSQL is running and reachable, then try again")


class _Txn:
    """One transaction on one pooled connection (autocommit off by explicit BEGIN).
    A write transaction notes the inode and entry keys it changes (the feed)."""

    __slots__ = ("cur", "changes", "xid")

    def __init__(self, cur, changes: Changes | None, xid: str | None = None):
        self.cur = cur
        self.changes = changes
        self.xid = xid  # a write's transaction id

    def get(self, key: bytes) -> bytes | None:
        row = self.cur.execute("SELECT v FROM tierfs_kv WHERE k = %s", (key,)).fetchone()
        return row[0] if row else None

    def put(self, key: bytes, value: bytes) -> None:
        self.changes.note(key)
        self.cur.execute("INSERT INTO tierfs_kv (k, v) VALUES (%s, %s) "
                         "ON CONFLICT (k) DO UPDATE SET v = EXCLUDED.v", (key, value))

    def delete(self, key: bytes) -> bool:
        self.changes.note(key)
        return self.cur.execute("DELETE FROM tierfs_kv WHERE k = %s RETURNING 1",
                                (key,)).fetchone() is not None

    def pop(self, key: bytes) -> bytes | None:
        self.changes.note(key)
        row = self.cur.execute("DELETE FROM tierfs_kv WHERE k = %s RETURNING v",
                               (key,)).fetchone()
        return row[0] if row else None


class PostgresKV:
    kind = "postgresql"
    shared = True  # many nodes: sessions instead of the lease

    def __init__(self, url: str, *, wait: float = 60.0, pool_size: int = 8):
        try:
            import psycopg
            from psycopg import errors as pg_errors
        except ImportError:
            raise UserError("a postgresql:// metadata URL needs psycopg 3: "
                            "pip install 'tierfs[postgres]'") from None
        from .postgres_deadline import AnswerWatch, NoAnswer
        self._psycopg = psycopg
        self._sql = psycopg.sql
        self._no_answer = NoAnswer
        # Every statement: an answer within the bound, or its connection is cut.
        self.answers = AnswerWatch(bound=max(wait, MIN_ANSWER_WAIT))
        self._watched = watched = self.answers.cursor_class()
        self._retryable = (pg_errors.SerializationFailure, pg_errors.DeadlockDetected)
        self._unreachable = (psycopg.OperationalError, NoConnectionSlot)
        self._failed = (psycopg.Error, NoConnectionSlot)  # any error of the server
        self.url = url
        self.where = describe(url)
        self.wait = wait
        # pg_stat_activity shows which node and process holds each connection.
        self._connect = functools.partial(
            psycopg.connect, url, autocommit=True, connect_timeout=CONNECT_TIMEOUT,
            cursor_factory=watched, fallback_application_name=application_name())
        try:
            with self._connect() as conn:
                self._create_schema(conn)
                schema = conn.execute("SELECT current_schema()").fetchone()[0]
        except psycopg.Error as e:
            self.answers.close()
            raise UserError(f"cannot use the metadata database {self.where}: {first_line(e)}; "
                            "check --meta-url and that PostgreSQL is running") from None
        # One channel per filesystem: a database may hold several, one per schema.
        self.channel = "tierfs_" + hashlib.sha256(schema.encode()).hexdigest()[:16]
        self.sender = new_sender()
        self.pool = Connections(self._connect, size=pool_size,
                                slot_wait=min(max(wait, 0.1), 5.0))

    def _create_schema(self, conn) -> None:
        """Tables on first use, under an advisory lock (several nodes may start at once)."""
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(7316841)")
            conn.execute(_SCHEMA)
            row = conn.execute("SELECT max(version) FROM tierfs_schema").fetchone()
            if row[0] is None:
                conn.execute("INSERT INTO tierfs_schema (version) VALUES (%s)",
                             (SCHEMA_VERSION,))
            elif row[0] > SCHEMA_VERSION:
                raise UserError(f"the metadata database {self.where} has schema version "
                                f"{row[0]}, newer than this tierfs knows ({SCHEMA_VERSION}): "
                                "upgrade tierfs on this node")

    # ---- transactions -------------------------------------------------------
    @contextlib.contextmanager
    def _transaction(self, begin: str, write: bool):
        """One transaction on a pooled connection, BEGIN to COMMIT. A write that
        changed inodes or entries sends its notification with its COMMIT (one
        round trip: a query without parameters may hold two statements)."""
        try:
            conn_cm = self.pool.connection()
            conn = conn_cm.__enter__()
        except self._unreachable as e:
            raise _Retry(e) from None
        committing = False
        xid = None
        try:
            with conn.cursor() as cur:
                if write:  # its id, in the same round trip: how a lost COMMIT ended
                    cur.execute(begin + "; SELECT pg_current_xact_id()::text")
                    cur.nextset()
                    xid = cur.fetchone()[0]
                else:
                    cur.execute(begin)
                txn = _Txn(cur, Changes() if write else None, xid)
                try:
                    yield txn
                except BaseException:
                    if not conn.broken:
                        cur.execute("ROLLBACK")
                    raise
                committing = True
                if txn.changes:
                    cur.execute(self._sql.SQL("SELECT pg_notify({}, {}); COMMIT").format(
                        self.channel, payload(self.sender, txn.changes)))
                else:
                    cur.execute("COMMIT")
        except self._retryable as e:
            raise _Retry(e) from None
        except self._psycopg.OperationalError as e:
            if not committing or not write:  # a read changes nothing: run it again
                raise _Retry(e) from None
            outcome = self.outcome(xid)
            if outcome == "aborted":
                raise _Retry(e) from None
            if outcome != "committed":
                log.error("metadata database %s: connection lost during COMMIT (%s), and "
                          "whether it committed cannot be learned (%s)", self.where,
                          first_line(e), outcome)
                raise FsError(errno.EIO) from None
        except self._psycopg.Error as e:
            # Refused, not lost (a server that takes no writes during a failover or
            # maintenance): nothing was committed, and it may pass like an outage.
            raise _Retry(e) from None
        finally:
            conn_cm.__exit__(None, None, None)

    def outcome(self, xid: str | None) -> str:
        """How a transaction whose COMMIT lost its connection ended: "committed",
        "aborted", or why that is not known. Asks again (a restarting server) for up
        to `wait`: a restart ends every transaction one way or the other."""
        if xid is None:
            return "no transaction id"
        deadline = time.monotonic() + self.wait
        while True:
            try:
                with self._connect() as conn:
                    status = conn.execute("SELECT pg_xact_status(%s::xid8)",
                                          (xid,)).fetchone()[0]
                if status in ("committed", "aborted"):
                    return status
                if time.monotonic() >= deadline:
                    return f"still {status}"
            except self._psycopg.Error as e:
                if time.monotonic() >= deadline:
                    return first_line(e)
            time.sleep(0.2)

    def get(self, key: bytes) -> bytes | None:
        """One statement outside a transaction (its own snapshot): one round trip."""
        try:
            with self.pool.connection() as conn:
                row = conn.execute("SELECT v FROM tierfs_kv WHERE k = %s", (key,)).fetchone()
        except self._failed as e:
            raise _Retry(e) from None
        return row[0] if row else None

    def read(self):
        return self._transaction("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY", False)

    @contextlib.contextmanager
    def peek(self):
        """Statements on a pooled connection without BEGIN and COMMIT (autocommit: each
        its own snapshot), two round trips fewer than read()."""
        try:
            with self.pool.connection() as conn, conn.cursor() as cur:
                yield _Txn(cur, None)
        except self._failed as e:
            raise _Retry(e) from None

    def write(self):
        return self._transaction("BEGIN ISOLATION LEVEL SERIALIZABLE", True)

    def listen(self, on_change) -> Listener:
        """Call on_change(inodes, entries, everything) from a thread of its own for
        what other nodes' transactions changed (postgres_feed.py)."""
        return Listener(self.url, self.channel, self.sender, on_change,
                        connect_timeout=CONNECT_TIMEOUT,
                        application_name=application_name("feed"),
                        cursor_factory=self._watched)

    def run(self, fn, *args, **kwargs):
        """Run fn(*args, **kwargs) (its own transactions) until it commits; serialization failures and
        deadlocks are retried at once with a short random pause, an unreachable
        server; each until `wait` has passed since the first such failure (then EIO)."""
        first_failure = first_conflict = None
        pause = 0.001
        while True:
            try:
                return fn(*args, **kwargs)
            except _Retry as e:
                cause = e.args[0]
                now = time.monotonic()
                if isinstance(cause, self._retryable):
                    # Other nodes' changes may win every time (a long transaction
                    # beside a stream of short ones): a bound, as for an outage.
                    if first_conflict is None:
                        first_conflict = now
                    elif now - first_conflict >= self.wait:
                        log.error("metadata database %s: a change kept conflicting with "
                                  "other nodes' changes for %.0f s: returning EIO",
                                  self.where, now - first_conflict)
                        raise FsError(errno.EIO) from None
                    pause = min(pause * 2, 0.05)
                elif isinstance(cause, self._no_answer):  # the wait is spent already
                    self.pool.forget_idle()
                    log.error("metadata database %s did not answer within %.0f s: "
                              "returning EIO", self.where, self.answers.bound)
                    raise FsError(errno.EIO) from None
                else:
                    self.pool.forget_idle()
                    if first_failure is None:
                        first_failure = now
                        log.warning("metadata database %s unreachable (%s); waiting up "
                                    "to %.0f s", self.where, first_line(cause), self.wait)
                    if now - first_failure >= self.wait:
                        log.error("metadata database %s unreachable for %.0f s: "
                                  "returning EIO", self.where, now - first_failure)
                        raise FsError(errno.EIO) from None
                    pause = min(max(pause * 2, 0.05), 1.0)
                time.sleep(random.uniform(pause / 2, pause))

    def scan(self, txn, start: bytes, end: bytes,
             values: bool = True) -> Iterator[tuple[bytes, bytes | None]]:
        sql = ("SELECT k, v FROM tierfs_kv" if values else "SELECT k FROM tierfs_kv") + \
            " WHERE k >= %s AND k < %s ORDER BY k LIMIT %s"
        while True:
            rows = txn.cur.execute(sql, (start, end, SCAN_BATCH)).fetchall()
            for row in rows:
                yield (row[0], row[1] if values else None)
            if len(rows) < SCAN_BATCH:
                return
            start = rows[-1][0] + b"\x00"

    def last_keys(self, txn, start: bytes, end: bytes, limit: int) -> list[bytes]:
        rows = txn.cur.execute("SELECT k FROM tierfs_kv WHERE k >= %s AND k < %s"
                               " ORDER BY k DESC LIMIT %s", (start, end, limit)).fetchall()
        return [row[0] for row in rows]

    def get_many(self, txn, keys: list[bytes]) -> list[bytes | None]:
        if len(keys) <= 1:
            return [txn.get(key) for key in keys]
        rows = txn.cur.execute("SELECT k, v FROM tierfs_kv WHERE k = ANY(%s)",
                               (list(keys),)).fetchall()
        found = dict(rows)
        return [found.get(key) for key in keys]

    def scan_many(self, txn, ranges, values: bool = True) -> list[list]:
        """One statement for all ranges: one round trip, one snapshot."""
        if not ranges:
            return []
        where = " OR ".join(["(k >= %s AND k < %s)"] * len(ranges))
        sql = f"SELECT k{', v' if values else ''} FROM tierfs_kv WHERE {where} ORDER BY k"
        rows = txn.cur.execute(sql, [b for r in ranges for b in r]).fetchall()
        order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
        starts = [ranges[i][0] for i in order]
        out: list[list] = [[] for _ in ranges]
        for row in rows:  # ranges are disjoint: a key is in the last one starting below it
            i = order[bisect.bisect_right(starts, row[0]) - 1]
            out[i].append((row[0], row[1] if values else None))
        return out

    @staticmethod
    def now_ns(txn) -> int:
        """The server's clock: one clock for every node's heartbeats."""
        row = txn.cur.execute(
            "SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint").fetchone()
        return row[0] * 1000

    # ---- the rest of the engine interface ------------------------------------
    def reading_in_thread(self):
        return contextlib.nullcontext()

    def sync(self) -> None:
        """Commits are durable when they return (synchronous_commit)."""

    def close(self) -> None:
        self.pool.close()
        self.answers.close()
