"""What other nodes changed, from PostgreSQL's LISTEN/NOTIFY.

Every write transaction of a PostgresKV that changed an inode record or a
directory entry sends, in the same round trip as its COMMIT, one notification
on the filesystem's channel naming what it changed: inode numbers and
(directory, name) entries. PostgreSQL delivers it only if the transaction
commits, in commit order. A node's Listener hands other nodes' changes to a
callback (the mount turns them into kernel cache invalidations) and skips its
own. Once LISTEN takes effect, at the start and after a lost connection, it
reports "everything may have changed", since notifications sent before are gone.
"""
from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field

from . import schema as s
from .kv import first_line

log = logging.getLogger("tierfs.meta")

PAYLOAD_MAX = 7900  # pg_notify refuses 8000 bytes and more
# Seconds between the listener's own statements: waiting for notifications sends
# nothing, so a connection that stopped carrying anything (a server process stuck, a
# firewall or NAT that dropped it while idle) would look quiet for ever.
PING_S = 10.0


@dataclass
class Changes:
    """What one transaction changed: inodes (attributes, size, content) and entries."""
    inodes: set[int] = field(default_factory=set)
    entries: set[tuple[int, bytes]] = field(default_factory=set)

    def note(self, key: bytes) -> None:
        tag = key[:1]
        if tag == b"I":
            self.inodes.add(s.read_u64(key, 1))
        elif tag == b"D":
            self.entries.add((s.read_u64(key, 1), key[9:]))

    def __bool__(self) -> bool:
        return bool(self.inodes or self.entries)


def payload(sender: str, changes: Changes) -> str:
    """The notification text; past PAYLOAD_MAX it says only "everything" (rare: one
    transaction changes a few records, a rename four)."""
    text = json.dumps({"from": sender, "inodes": sorted(changes.inodes),
                       "entries": sorted([p, n.hex()] for p, n in changes.entries)})
    if len(text) <= PAYLOAD_MAX:
        return text
    return json.dumps({"from": sender, "everything": True})


def new_sender() -> str:
    return secrets.token_hex(8)


class Listener:
    """A thread that listens on `channel` and calls on_change(inodes, entries,
    everything) for what other senders changed. stop() ends it."""

    def __init__(self, url: str, channel: str, sender: str, on_change, *,
                 connect_timeout: float = 5.0, application_name: str = "tierfs feed",
                 cursor_factory=None):
        import psycopg
        self._psycopg = psycopg
        self.url, self.channel, self.sender = url, channel, sender
        self.on_change = on_change
        self.connect_timeout = connect_timeout
        self.application_name = application_name
        # The engine's: it bounds the LISTEN's wait for an answer.
        self.cursor_factory = cursor_factory or psycopg.Cursor
        self._stop = threading.Event()
        self.listening = threading.Event()  # set while LISTEN is in force (and told)
        self._thread = threading.Thread(target=self._run, name="tierfs-meta-feed", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        lost = False
        while not self._stop.is_set():
            try:
                with self._psycopg.connect(
                        self.url, autocommit=True, connect_timeout=self.connect_timeout,
                        fallback_application_name=self.application_name,
                        cursor_factory=self.cursor_factory) as conn:
                    conn.execute(f'LISTEN "{self.channel}"')
                    # What was sent before LISTEN took effect (while starting, or while
                    # the connection was lost) is gone: everything may have changed.
                    self._tell(set(), set(), True)
                    self.listening.set()
                    lost = False
                    ping_due = time.monotonic() + PING_S
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=0.5):
                            self._deliver(note.payload)
                        if time.monotonic() >= ping_due:
                            # Answered within the engine's bound, or the connection is
                            # cut (NoAnswer): then listen again on a new one.
                            conn.execute("SELECT 1")
                            ping_due = time.monotonic() + PING_S
            except self._psycopg.Error as e:  # lost, or refused (LISTEN on a standby)
                if not lost:
                    log.warning("metadata change feed lost its connection (%s); "
                                "reconnecting", first_line(e))
                lost = True
                self.listening.clear()
                self._stop.wait(1.0)

    def _deliver(self, text: str) -> None:
        # Anyone who can reach the database may notify the channel: a payload that is
        # not what payload() writes must not end the thread (and with it the feed).
        try:
            msg = json.loads(text)
            if msg.get("from") == self.sender:
                return  # our own change: this node knows already
            everything = bool(msg.get("everything"))
            inodes = {int(i) for i in msg.get("inodes", [])}
            entries = {(int(p), bytes.fromhex(n)) for p, n in msg.get("entries", [])}
        except (ValueError, TypeError, AttributeError):
            # It may name a change all the same (a newer tierfs): assume the worst.
            log.error("metadata change feed: a notification it cannot read: %.80r; "
                      "dropping every cached name and attribute", text)
            self._tell(set(), set(), True)
            return
        if everything:
            self._tell(set(), set(), True)
            return
        self._tell(inodes, entries, False)

    def _tell(self, inodes: set[int], entries: set, everything: bool) -> None:
        try:
            self.on_change(inodes, entries, everything)
        except Exception:  # the feed must outlive a failing callback
            log.exception("metadata change feed: the change handler failed")
