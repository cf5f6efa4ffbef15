"""Connections to the metadata database, reused, opened when a caller needs one.

psycopg-pool reconnects on a schedule of its own that doubles its pause after
each failure, so after an outage of t seconds a node could stay away about t
seconds more, its heartbeat with it. Here a caller that finds no idle
connection opens one itself: the first request after the server is back gets
through, and the engine's retry loop (PostgresKV.run) paces the attempts while
it is away.
"""
from __future__ import annotations

import contextlib
import threading
import time

# Seconds a connection may stay idle and still be used. A NAT or firewall between a
# node and the server may forget an idle connection (Azure's load balancers after 4
# minutes) and drop its packets from then on without a word: a statement sent on it
# would wait the engine's whole answer bound and fail. Reopening costs a round trip.
MAX_IDLE_S = 60.0


class NoConnectionSlot(Exception):
    """Every connection stayed busy for the whole wait (a server that stopped answering)."""


class Connections:
    def __init__(self, connect, *, size: int, slot_wait: float):
        from psycopg.pq import TransactionStatus
        self._connect = connect  # () -> a new autocommit connection
        self._between_transactions = TransactionStatus.IDLE
        self._slots = threading.BoundedSemaphore(size)
        self._slot_wait = slot_wait
        self._lock = threading.Lock()
        self._idle: list = []  # (connection, when it went idle), the newest last
        self._closed = False

    @contextlib.contextmanager
    def connection(self):
        if not self._slots.acquire(timeout=self._slot_wait):
            raise NoConnectionSlot(f"no connection free within {self._slot_wait:.0f} s")
        try:
            with self._lock:
                fresh_since = time.monotonic() - MAX_IDLE_S
                stale = [c for c, since in self._idle if since < fresh_since]
                self._idle = [(c, since) for c, since in self._idle if since >= fresh_since]
                conn = self._idle.pop()[0] if self._idle else None
            for old in stale:
                old.close()
            if conn is None:
                conn = self._connect()
            try:
                yield conn
            finally:
                self._give_back(conn)
        finally:
            self._slots.release()

    def _give_back(self, conn) -> None:
        usable = not conn.closed and not conn.broken and \
            conn.info.transaction_status == self._between_transactions
        with self._lock:
            if usable and not self._closed:
                self._idle.append((conn, time.monotonic()))
                return
        conn.close()

    def forget_idle(self) -> None:
        """A connection failed: the idle ones most likely lost their server too."""
        with self._lock:
            idle, self._idle = self._idle, []
        for conn, _since in idle:
            conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.forget_idle()
