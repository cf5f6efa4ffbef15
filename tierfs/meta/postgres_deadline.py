"""A bound on every answer from PostgreSQL.

A server that stops answering but keeps its connections open (stopped, frozen,
stuck on its disk, a partition that drops no connection) would leave a statement
waiting for ever: libpq has no timeout for an answer. Every statement of the
engine runs through `AnswerWatch.cursor_class()`: while it waits, its connection is
watched, and once the bound has passed the watch shuts the connection's socket
down. The statement then fails at once with `NoAnswer`, which the engine treats
as an unreachable server (EIO), and the connection is not used again. psycopg is
imported here: import this module only where psycopg is known to be installed.
"""
from __future__ import annotations

import contextlib
import os
import socket
import threading
import time

import psycopg


class NoAnswer(psycopg.OperationalError):
    """The server did not answer a statement within the bound."""


class AnswerWatch:
    def __init__(self, bound: float):
        self.bound = bound
        self._tick = min(1.0, max(0.05, bound / 4))
        self._lock = threading.Lock()
        self._waiting: dict = {}  # connection -> when its answer is overdue
        self._cut: set = set()  # connections whose socket this watch shut down
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def cursor_class(self) -> type:
        """A psycopg cursor class whose statements are watched (cursor_factory=).
        Inline rather than a context manager: it runs for every statement."""
        watch, waiting = self, self._waiting

        class WatchedCursor(psycopg.Cursor):
            def execute(self, query, params=None, **kwargs):
                conn = self.connection
                waiting[conn] = time.monotonic() + watch.bound  # one dict store: atomic
                if watch._thread is None:
                    watch._start()
                try:
                    return super().execute(query, params, **kwargs)
                except psycopg.OperationalError:
                    if watch._was_cut(conn):
                        raise NoAnswer(f"no answer within {watch.bound:g} s") from None
                    raise
                finally:
                    watch._done(conn)

        return WatchedCursor

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="tierfs-db-answers")
                self._thread.start()

    def _was_cut(self, conn) -> bool:
        with self._lock:
            return conn in self._cut

    def _done(self, conn) -> None:
        with self._lock:  # after this, the watch no longer touches the connection
            self._waiting.pop(conn, None)
            self._cut.discard(conn)

    def _run(self) -> None:
        while not self._stop.wait(self._tick):
            now = time.monotonic()
            # Under the lock: a connection still waiting is inside execute(), so its
            # socket is open and is the one the statement waits on.
            with self._lock:
                for conn, overdue in list(self._waiting.items()):
                    if overdue <= now and conn not in self._cut:
                        self._cut.add(conn)
                        _shut_down(conn)

    def close(self) -> None:
        self._stop.set()


def _shut_down(conn) -> None:
    """Make the connection's blocked read return (end of stream) at once."""
    with contextlib.suppress(Exception):  # already closed: nothing waits on it
        with socket.socket(fileno=os.dup(conn.pgconn.socket)) as sock:
            sock.shutdown(socket.SHUT_RDWR)
